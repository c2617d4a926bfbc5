"""compare and gate: verdicts that survive noise and autocorrelation, and the CLI's exit codes."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import ladder_config
from typer.testing import CliRunner

from gpudiag.cli import app
from gpudiag.diagnose.compare import compare_runs
from gpudiag.diagnose.gate import GateLimits, decide
from gpudiag.diagnose.trials import merge_trials, steady_state
from gpudiag.model.results import (
    Env,
    Finding,
    RunResult,
    StageResult,
    TelemetrySummary,
    load_run,
    save_run,
)

runner = CliRunner()
BATCH = 128


def _ar1_steps(mean_ms: float, n: int, noise: float, rho: float,
               rng: np.random.Generator) -> list[float]:
    """Step times with lag-1 autocorrelation `rho` (0.3-0.8 measured on an H100)."""
    e = np.empty(n)
    e[0] = rng.standard_normal()
    for i in range(1, n):
        e[i] = rho * e[i - 1] + np.sqrt(1 - rho ** 2) * rng.standard_normal()
    return list(mean_ms * (1 + noise * e))


def _run(mean_ms: float, *, rng: np.random.Generator, steps: int = 40, step_noise: float = 0.01,
         rho: float = 0.6, device: str = "cuda:0", model: str = "dgca") -> RunResult:
    times = _ar1_steps(mean_ms, steps, step_noise, rho, rng)
    stage = StageResult(name="train-fp16", status="ok", iter_ms=times, samples_per_step=BATCH,
                        telemetry=TelemetrySummary(available=True))
    return RunResult(tool_version="test", env=Env(device=device, gpu_name="H100"),
                     config=ladder_config(model=model, preset="full", batch_size=BATCH,
                                          seq_len=128), stages=[stage])


def _side(mean_ms: float, trials: int, trial_noise: float, seed: int, **kw: object) -> RunResult:
    rng = np.random.default_rng(seed)
    runs = [_run(mean_ms * (1 + trial_noise * rng.standard_normal()), rng=rng, **kw)
            for _ in range(trials)]
    return merge_trials(runs) if trials > 1 else runs[0]


def _outcome(before: RunResult, after: RunResult, limit: float = 0.05) -> str:
    return decide(compare_runs(before, after), GateLimits({(None, "wall"): limit})).outcome


@pytest.mark.parametrize("seed", range(5))
def test_ten_percent_slowdown_with_low_noise_fails_a_five_percent_gate(seed: int) -> None:
    before = _side(50.0, 5, 0.005, seed)
    after = _side(55.5, 5, 0.005, seed + 100)  # ~10% lower throughput
    assert _outcome(before, after) == "regression"


@pytest.mark.parametrize("seed", range(5))
def test_the_same_slowdown_in_thirty_percent_noise_is_inconclusive(seed: int) -> None:
    before = _side(50.0, 3, 0.30, seed)
    after = _side(55.5, 3, 0.30, seed + 100)
    assert _outcome(before, after) == "inconclusive"


@pytest.mark.parametrize("seed", range(5))
def test_identical_distributions_pass(seed: int) -> None:
    assert _outcome(_side(50.0, 5, 0.005, seed), _side(50.0, 5, 0.005, seed + 100)) == "pass"


@pytest.mark.parametrize("seed", range(10))
def test_single_trials_of_identical_code_never_regress(seed: int) -> None:
    # One process per side: strongly autocorrelated steps and a process-to-process offset the
    # blocks cannot see; the noise floor keeps this from reading as a regression.
    before = _side(50.0, 1, 0.0, seed, rho=0.8)
    after = _side(50.0 * 1.008, 1, 0.0, seed + 100, rho=0.8)
    assert _outcome(before, after) != "regression"


def test_verdicts_and_detectable_change_are_reported() -> None:
    comparison = compare_runs(_side(50.0, 5, 0.005, 1), _side(40.0, 5, 0.005, 2))
    stage = comparison.stage("train-fp16")
    assert stage is not None and stage.verdict == "faster"
    assert stage.throughput is not None and stage.throughput.ratio == pytest.approx(1.25, rel=0.03)
    # Five trials of 0.5% spread pulled the built-in 5% prior (5 degrees of freedom) down.
    assert stage.throughput.sigma < 0.05 and 0 < stage.throughput.min_detectable < 0.08
    assert not stage.throughput.on_prior_alone
    single = compare_runs(_side(50.0, 1, 0, 1), _side(50.0, 1, 0, 2)).stage("train-fp16")
    assert single is not None and single.throughput is not None and single.throughput.on_prior_alone
    assert "one trial on a side" in single.note


def test_steady_state_drops_the_warm_up_transient() -> None:
    assert steady_state([90.0, 70.0, 55.0, *([50.0] * 20)]) == [50.0] * 20


def test_throttled_trials_are_invalid() -> None:
    after = _side(50.0, 3, 0.005, 7)
    for trial in after.stages[0].trials:
        trial.throttled = True
    gate = decide(compare_runs(_side(50.0, 3, 0.005, 8), after)).stages[0]
    assert gate.outcome == "inconclusive" and "throttled" in gate.reason


def test_findings_new_since_the_baseline_travel_with_the_decision() -> None:
    before, after = _side(50.0, 3, 0.005, 1), _side(50.0, 3, 0.005, 2)
    loop = Finding(id="GD101", rule="python-loop-launches", severity="critical",
                   stage="train-fp16", title="loop", location="model.py:119", impact=0.5)
    after.findings = [loop]
    comparison = compare_runs(before, after)
    assert comparison.findings_new == [loop] and not comparison.findings_resolved
    assert decide(comparison).new_findings == [loop]


def _save(run: RunResult, path: Path) -> Path:
    save_run(run, path / "run.json")
    return path


def test_gate_cli_exit_codes(tmp_path: Path) -> None:
    base = _save(_side(50.0, 5, 0.005, 1), tmp_path / "base")
    same = _save(_side(50.0, 5, 0.005, 2), tmp_path / "same")
    slow = _save(_side(56.0, 5, 0.005, 3), tmp_path / "slow")
    noisy = _save(_side(56.0, 3, 0.30, 4), tmp_path / "noisy")
    other = _side(50.0, 5, 0.005, 5)
    other.config = dataclasses.replace(other.config, model="bert")
    other_dir = _save(other, tmp_path / "other")
    gate = ["gate", "--max-regression", "5"]
    assert runner.invoke(app, [*gate, str(base), str(same)]).exit_code == 0
    result = runner.invoke(app, [*gate, str(base), str(slow)])
    assert result.exit_code == 1 and "REGRESSION" in result.stdout and "train-fp16" in result.stdout
    noisy_result = runner.invoke(app, [*gate, "--on-inconclusive", "fail", str(base),
                                       str(noisy)])
    assert noisy_result.exit_code == 3 and "trials per side" in noisy_result.stdout
    lenient = runner.invoke(app, [*gate, str(base), str(noisy)])  # the default: pass, and say so
    assert lenient.exit_code == 0 and "could only detect" in lenient.stdout
    mismatch = runner.invoke(app, [*gate, str(base), str(other_dir)])
    assert mismatch.exit_code == 2 and "not comparable" in mismatch.stderr
    assert runner.invoke(app, [*gate, "--allow-mismatch", str(base), str(other_dir)]).exit_code == 0
    loose = runner.invoke(app, ["gate", "--max-regression", "train-fp16=15", str(base), str(slow)])
    assert loose.exit_code == 0
    bad = runner.invoke(app, ["gate", "--max-regression", "warp=3", str(base), str(slow)])
    assert bad.exit_code == 2 and "unknown stage" in bad.stderr
    assert runner.invoke(app, ["gate", str(base), str(tmp_path / "nope")]).exit_code == 2


def test_gate_appends_to_the_github_step_summary(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("earlier\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    base = _save(_side(50.0, 5, 0.005, 1), tmp_path / "a")
    slow = _save(_side(56.0, 5, 0.005, 3), tmp_path / "b")
    assert runner.invoke(app, ["gate", str(base), str(slow)]).exit_code == 1
    text = summary.read_text()
    assert text.startswith("earlier\n") and "## gpudiag gate: REGRESSION" in text


def test_baseline_save_is_small_and_gates(tmp_path: Path) -> None:
    run_dir = _save(_side(50.0, 3, 0.005, 1), tmp_path / "run")
    result = runner.invoke(app, ["baseline", "save", str(run_dir), "--name", "main",
                                 "--dir", str(tmp_path / ".gpudiag")])
    assert result.exit_code == 0, result.output
    baseline = tmp_path / ".gpudiag" / "main.json"
    assert load_run(baseline).stages[0].trials
    other = _save(_side(50.0, 3, 0.005, 2), tmp_path / "other")
    gated = runner.invoke(app, ["gate", str(baseline), str(other)])
    assert gated.exit_code == 0, gated.output
    same = runner.invoke(app, ["gate", str(baseline), str(run_dir)])
    assert same.exit_code == 2 and "same measurement" in same.output


def test_compare_cli_markdown_and_json(tmp_path: Path) -> None:
    a = _save(_side(50.0, 3, 0.005, 1), tmp_path / "a")
    b = _save(_side(40.0, 3, 0.005, 2), tmp_path / "b")
    md = tmp_path / "cmp.md"
    table = runner.invoke(app, ["compare", str(a), str(b), "--markdown", str(md)])
    assert table.exit_code == 0 and "faster" in table.stdout
    assert "| train-fp16 |" in md.read_text() and "95% CI" in md.read_text()
    data = json.loads(runner.invoke(app, ["compare", str(a), str(b), "--json"]).stdout)
    assert data["stages"][0]["verdict"] == "faster"
    assert runner.invoke(app, ["compare", str(a), str(tmp_path / "missing")]).exit_code == 2


def test_a_folder_of_runs_is_a_trial_set(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for k in range(3):
        _save(_run(50.0, rng=rng), tmp_path / "before" / f"trial-{k}")
        _save(_run(60.0, rng=rng), tmp_path / "after" / f"trial-{k}")
    comparison = compare_runs(*(load_run(p / "trial-0") for p in (tmp_path / "before",
                                                                  tmp_path / "after")))
    assert comparison.stage("train-fp16") is not None
    result = runner.invoke(app, ["gate", str(tmp_path / "before"), str(tmp_path / "after")])
    assert result.exit_code == 1


def _slowed_trials(run: RunResult, factor: float) -> RunResult:
    """The same trials with every step `factor` times longer (what is derived from them
    follows)."""
    slow = copy.deepcopy(run)
    if slow.duration_s:
        slow.duration_s *= factor
    for stage in slow.stages:
        stage.iter_ms = [t * factor for t in stage.iter_ms]
        if stage.wall_s:
            stage.wall_s *= factor
        for trial in stage.trials:
            trial.ms_per_iter *= factor
    return slow


@pytest.mark.slow
def test_real_tiny_runs(tmp_path: Path) -> None:
    """Two real single runs of the same code never exit 1 at a 5% gate; a real run of six
    fresh-process trials against the same trials 50% slower exits 1; runs of different models
    are not comparable (exit 2).

    The slowdown uses trials because on a shared 2-core CPU fresh processes of the same code
    differ by 6-12% (20-30% while other work shares the cores: a clean-clone CI run saw eight
    trials that could only detect a 29% change, three attempts in a row): one trial per side
    cannot prove a slowdown at 99% there, and honestly says inconclusive. 50% is beyond that
    noise; a noisy attempt may still say inconclusive, so it gets up to two fresh retries; it
    must never pass."""
    args = ["run", "--device", "cpu", "--preset", "tiny", "--stages", "train-fp16",
            "--evidence-steps", "0", "--quiet", "--model"]
    for name, model in (("a", "dgca"), ("b", "dgca"), ("bert", "bert")):
        result = runner.invoke(app, [*args, model, "--iters", "50", "--out",
                                     str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    gate = ["gate", "--max-regression", "5"]
    assert runner.invoke(app, [*gate, str(tmp_path / "a"), str(tmp_path / "b")]).exit_code != 1
    assert runner.invoke(app, [*gate, str(tmp_path / "a"), str(tmp_path / "bert")]).exit_code == 2
    outcomes = []
    for attempt in range(3):
        base = tmp_path / f"trials-{attempt}"
        result = runner.invoke(app, [*args, "dgca", "--iters", "20", "--trials", "6",
                                     "--out", str(base)])
        assert result.exit_code == 0, result.output
        _save(_slowed_trials(load_run(base), 3.0), tmp_path / f"slow-{attempt}")
        slowed = runner.invoke(app, [*gate, "--on-inconclusive", "fail", str(base),
                                     str(tmp_path / f"slow-{attempt}")])
        outcomes.append(slowed.exit_code)
        if slowed.exit_code != 3:
            break
    assert outcomes[-1] == 1 and set(outcomes) <= {1, 3}, (outcomes, slowed.stdout)


def test_energy_and_memory_limits(tmp_path: Path) -> None:
    before, after = _side(50.0, 5, 0.005, 1), _side(50.0, 5, 0.005, 2)
    before.stages[0].telemetry.energy_j, after.stages[0].telemetry.energy_j = 100.0, 120.0
    base, cur = _save(before, tmp_path / "a"), _save(after, tmp_path / "b")
    energy = runner.invoke(app, ["gate", "--max-regression", "energy=10", str(base), str(cur)])
    assert energy.exit_code == 1 and "energy +20.0%" in energy.stdout
    loose = runner.invoke(app, ["gate", "--max-regression", "train-fp16:energy=25", str(base),
                                str(cur)])
    assert loose.exit_code == 0, loose.stdout
    memory = runner.invoke(app, ["gate", "--max-regression", "memory=10", "--on-inconclusive",
                                 "fail", str(base), str(cur)])
    assert memory.exit_code == 3 and "no memory counter measured" in memory.stdout


@pytest.mark.slow
def test_run_trials_merges_fresh_processes(tmp_path: Path) -> None:
    """`run --trials 2` runs two child processes, keeps each one's folder, and merges them into
    one run with a trial per process and the evidence of the last one; every trial keeps its
    own evidence, whose exact counters the gate compares trial by trial."""
    result = runner.invoke(app, ["run", "--device", "cpu", "--preset", "tiny", "--stages",
                                 "train-fp16", "--iters", "20", "--evidence-steps", "1",
                                 "--model", "dgca", "--trials", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    merged = load_run(tmp_path)
    stage = merged.stages[0]
    assert len(stage.trials) == 2 and all(t.samples_per_s > 0 for t in stage.trials)
    assert stage.evidence is not None
    first = load_run(tmp_path / "trial-1").stages[0].evidence
    assert first is not None and first.ops_per_step == stage.evidence.ops_per_step
    assert (tmp_path / "report.md").is_file()
