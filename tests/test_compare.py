"""compare and gate: verdicts that survive noise and autocorrelation, and the CLI's exit codes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import invoke, ladder_config, ladder_run
from tiny_mlp import MODEL as TINY_MLP

from gpudiag.diagnose.compare import compare_runs, match_findings
from gpudiag.diagnose.gate import GateLimits, decide
from gpudiag.diagnose.trials import merge_trials, steady_state
from gpudiag.model.results import Finding, RunResult, StageResult, TelemetrySummary
from gpudiag.model.runfile import load_run, save_run
from gpudiag.present.compare import gate_lines

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
    return ladder_run(stage, device=device, gpu="H100",
                      config=ladder_config(model=model, preset="full", batch_size=BATCH,
                                           seq_len=128))


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
    decision = decide(comparison)
    assert decision.new_findings == [loop]
    # Offered as causes only of a regression; beside a pass they are run-to-run findings.
    lines = gate_lines(decision)
    assert decision.outcome != "regression"
    assert any(line.startswith("New findings since the baseline (no regression to explain")
               for line in lines), lines
    decision.outcome = "regression"
    assert "New findings since the baseline (likely causes):" in gate_lines(decision)


def test_a_finding_whose_line_moved_persists_rather_than_being_new() -> None:
    """A line inserted above the loop moves its finding from model.py:119 to :120: the same
    finding; one at a line of another file, or of another rule, is new."""
    def found(rule: str, location: str) -> Finding:
        return Finding(id=rule, rule="r", severity="warning", stage="train-fp16",
                       title=location, location=location, impact=0.1)

    before = [found("GD101", "model.py:119"), found("GD105", "data.py:10")]
    after = [found("GD101", "model.py:120"), found("GD105", "train.py:10"),
             found("GD102", "model.py:121")]
    resolved, new, persisting = match_findings(before, after)
    assert [f.location for f in persisting] == ["model.py:120"]
    assert sorted(f.location for f in new) == ["model.py:121", "train.py:10"]
    assert [f.location for f in resolved] == ["data.py:10"]


def test_a_finding_some_trials_show_and_others_not_is_neither_new_nor_resolved() -> None:
    """The H100 recipe's A/A gate printed "New findings since the baseline: warning GD102": a
    share near its threshold, over it in one process and under it in the next. Across the
    trials of each side only a finding every head trial shows and no base trial does is
    new (and resolved the other way round)."""
    def found(rule: str) -> Finding:
        return Finding(id=rule, rule="r", severity="warning", stage="train-fp16", title=rule,
                       location="train.py:9", impact=0.1)

    rng = np.random.default_rng(3)
    base = [_run(50.0, rng=rng) for _ in range(2)]
    head = [_run(50.0, rng=rng) for _ in range(2)]
    base[0].findings = [found("GD102"), found("GD703")]  # GD102: one base trial of two
    base[1].findings = [found("GD703")]
    head[0].findings = [found("GD102"), found("GD301")]  # GD102: both head trials
    head[1].findings = [found("GD102"), found("GD301"), found("GD105")]  # GD105: one of two
    comparison = compare_runs(merge_trials(base), merge_trials(head))
    assert [f.id for f in comparison.findings_new] == ["GD301"]
    assert [f.id for f in comparison.findings_resolved] == ["GD703"]
    assert sorted(f.id for f in comparison.findings_unsteady) == ["GD102", "GD105"]
    assert [f.id for f in decide(comparison).new_findings] == ["GD301"]
    # Merged again (a run --trials folder read as a side), the unsteady ones stay so.
    assert [f.id for f in merge_trials([merge_trials(head), head[0]]).unsteady_findings] == [
        "GD105"]


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
    assert invoke([*gate, str(base), str(same)]).exit_code == 0
    result = invoke([*gate, str(base), str(slow)])
    assert result.exit_code == 1 and "REGRESSION" in result.stdout and "train-fp16" in result.stdout
    noisy_result = invoke([*gate, "--on-inconclusive", "fail", str(base),
                                       str(noisy)])
    assert noisy_result.exit_code == 3 and "trials per side" in noisy_result.stdout
    lenient = invoke([*gate, str(base), str(noisy)])  # the default: pass, and say so
    assert lenient.exit_code == 0 and "could only detect" in lenient.stdout
    mismatch = invoke([*gate, str(base), str(other_dir)])
    assert mismatch.exit_code == 2 and "not comparable" in mismatch.stderr
    assert invoke([*gate, "--allow-mismatch", str(base), str(other_dir)]).exit_code == 0
    loose = invoke(["gate", "--max-regression", "train-fp16=15", str(base), str(slow)])
    assert loose.exit_code == 0
    bad = invoke(["gate", "--max-regression", "warp=3", str(base), str(slow)])
    assert bad.exit_code == 2 and "unknown stage" in bad.stderr
    assert invoke(["gate", str(base), str(tmp_path / "nope")]).exit_code == 2


def test_gate_appends_to_the_github_step_summary(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("earlier\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    base = _save(_side(50.0, 5, 0.005, 1), tmp_path / "a")
    slow = _save(_side(56.0, 5, 0.005, 3), tmp_path / "b")
    assert invoke(["gate", str(base), str(slow)]).exit_code == 1
    text = summary.read_text()
    assert text.startswith("earlier\n") and "## gpudiag gate: REGRESSION" in text


def test_baseline_save_is_small_and_gates(tmp_path: Path) -> None:
    run_dir = _save(_side(50.0, 3, 0.005, 1), tmp_path / "run")
    result = invoke(["baseline", "save", str(run_dir), "--name", "main",
                                 "--dir", str(tmp_path / ".gpudiag")])
    assert result.exit_code == 0, result.output
    baseline = tmp_path / ".gpudiag" / "main.json"
    assert load_run(baseline).stages[0].trials
    other = _save(_side(50.0, 3, 0.005, 2), tmp_path / "other")
    gated = invoke(["gate", str(baseline), str(other)])
    assert gated.exit_code == 0, gated.output
    same = invoke(["gate", str(baseline), str(run_dir)])
    assert same.exit_code == 2 and "same measurement" in same.output


def test_compare_cli_markdown_and_json(tmp_path: Path) -> None:
    a = _save(_side(50.0, 3, 0.005, 1), tmp_path / "a")
    b = _save(_side(40.0, 3, 0.005, 2), tmp_path / "b")
    md = tmp_path / "cmp.md"
    table = invoke(["compare", str(a), str(b), "--markdown", str(md)])
    assert table.exit_code == 0 and "faster" in table.stdout
    assert "| train-fp16 |" in md.read_text() and "95% CI" in md.read_text()
    data = json.loads(invoke(["compare", str(a), str(b), "--json"]).stdout)
    assert data["stages"][0]["verdict"] == "faster"
    assert invoke(["compare", str(a), str(tmp_path / "missing")]).exit_code == 2


def test_a_folder_of_runs_is_a_trial_set(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for k in range(3):
        _save(_run(50.0, rng=rng), tmp_path / "before" / f"trial-{k}")
        _save(_run(60.0, rng=rng), tmp_path / "after" / f"trial-{k}")
    comparison = compare_runs(*(load_run(p / "trial-0") for p in (tmp_path / "before",
                                                                  tmp_path / "after")))
    assert comparison.stage("train-fp16") is not None
    result = invoke(["gate", str(tmp_path / "before"), str(tmp_path / "after")])
    assert result.exit_code == 1


def test_energy_and_memory_limits(tmp_path: Path) -> None:
    before, after = _side(50.0, 5, 0.005, 1), _side(50.0, 5, 0.005, 2)
    before.stages[0].telemetry.energy_j, after.stages[0].telemetry.energy_j = 100.0, 120.0
    base, cur = _save(before, tmp_path / "a"), _save(after, tmp_path / "b")
    energy = invoke(["gate", "--max-regression", "energy=10", str(base), str(cur)])
    assert energy.exit_code == 1 and "energy +20.0%" in energy.stdout
    loose = invoke(["gate", "--max-regression", "train-fp16:energy=25", str(base),
                                str(cur)])
    assert loose.exit_code == 0, loose.stdout
    memory = invoke(["gate", "--max-regression", "memory=10", "--on-inconclusive",
                                 "fail", str(base), str(cur)])
    assert memory.exit_code == 3 and "no memory counter measured" in memory.stdout


@pytest.mark.heavy
@pytest.mark.slow
def test_run_trials_merges_fresh_processes(tmp_path: Path) -> None:
    """`run --trials 2` runs two child processes, keeps each one's folder, and merges them into
    one run with a trial per process and the evidence of the last one; every trial keeps its
    own evidence, whose exact counters the gate compares trial by trial."""
    result = invoke(["run", "--device", "cpu", "--preset", "tiny", "--stages",
                                 "train-fp16", "--iters", "20", "--evidence-steps", "1",
                                 "--model", TINY_MLP, "--trials", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    merged = load_run(tmp_path)
    stage = merged.stages[0]
    assert len(stage.trials) == 2 and all(t.samples_per_s > 0 for t in stage.trials)
    assert stage.evidence is not None
    first = load_run(tmp_path / "trial-1").stages[0].evidence
    assert first is not None and first.ops_per_step == stage.evidence.ops_per_step
    assert (tmp_path / "report.md").is_file()
    # The merged run draws the plots; its trials do not (1-2 s each, seen by no one).
    assert list(tmp_path.glob("*.png")) and not list((tmp_path / "trial-1").glob("*.png"))
