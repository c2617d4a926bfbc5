"""Where a profiled step's host time grew (gpudiag/diagnose/hostdiff.py) and what the gate makes
of it: a step that grew at a line the head edited is the code's doing, even between runs
recorded apart; one that grew at an unchanged line (a collective's wait inside backward, a
loader) is not, whatever its size."""

from __future__ import annotations

import random
from pathlib import Path

from conftest import script_run, script_stage

from gpudiag.diagnose.gate import GateRules, judge
from gpudiag.diagnose.hostdiff import host_line_changes, localized_growth
from gpudiag.model.calibration import Calibration, CalibrationRecord, StageSpread
from gpudiag.model.facts import HostLine, HostSamples
from gpudiag.model.results import Evidence, StageResult

STEPS = 30


def stage(lines: dict[str, tuple[str, float]], *, step_ms: float, seed: int) -> StageResult:
    """A profiled train.py whose host samples charge `lines` (location -> source, ms per
    step), its timed steps `step_ms` each give or take 0.5%."""
    host = HostSamples(period_ms=2.5, steady_steps=STEPS,
                       lines=[HostLine(loc, "<module>", "python", ms * STEPS)
                              for loc, (_, ms) in lines.items()],
                       text={loc: text for loc, (text, _) in lines.items()})
    rng = random.Random(seed)
    return script_stage([step_ms * (1 + rng.uniform(-0.005, 0.005)) for _ in range(STEPS)],
                        steps=40, timed=STEPS, host=host,
                        evidence=Evidence(steps=3, step_ms=step_ms, backend="cpu",
                                          ops_per_step=12.0, syncs_per_step=0.0))


BASE = {"train.py:9": ("loss = model(x).mean()", 4.0),
        "train.py:10": ("loss.backward()", 6.0),
        "train.py:14": ("time.sleep(0.020)", 20.0)}


def test_a_step_that_grew_at_an_edited_line_is_the_codes() -> None:
    """The sleep's line was edited (0.020 -> 0.028) and took the whole growth: localized. Two
    lines moved down by an inserted line pair by their source, unedited."""
    head = {"train.py:9": ("loss = model(x).mean()", 4.1),
            "train.py:11": ("loss.backward()", 5.9),
            "train.py:15": ("time.sleep(0.028)", 28.0)}
    changes = host_line_changes(stage(BASE, step_ms=30, seed=1), stage(head, step_ms=38, seed=2))
    grown = localized_growth(changes)
    assert grown is not None and grown.location == "train.py:15" and grown.edited
    assert grown.before_ms == 20.0 and grown.after_ms == 28.0
    moved = next(c for c in changes if c.text == "loss.backward()")
    assert moved.location == "train.py:11" and not moved.edited


def test_a_step_that_grew_inside_an_unchanged_line_is_not_the_codes() -> None:
    """A/A under DDP: backward() (the all-reduce's wait) took 22 ms more while nothing was
    edited. Not localized, however concentrated; nor is growth spread over every line."""
    waited = {**BASE, "train.py:10": ("loss.backward()", 28.0)}
    assert localized_growth(host_line_changes(stage(BASE, step_ms=30, seed=1),
                                              stage(waited, step_ms=52, seed=2))) is None
    slower = {loc: (text, ms * 1.4) for loc, (text, ms) in BASE.items()}
    edited = {**slower, "train.py:14": ("time.sleep(0.021)", 28.0)}
    assert localized_growth(host_line_changes(stage(BASE, step_ms=30, seed=1),
                                              stage(edited, step_ms=42, seed=2))) is None


def test_the_gate_keeps_a_regression_at_an_edited_line_between_runs_recorded_apart() -> None:
    """Two runs recorded apart, the same work (no counters), 27% slower: at an edited line it
    is a regression naming it; at an unchanged line the gate cannot tell the code from the
    machine, and says so."""
    spread = CalibrationRecord(device="cpu", gpu_name=None, workload={"mode": "profile"},
                               stages=[StageSpread("train.py", trials=8, wall_sd=0.01)])
    rules = GateRules(calibration=Calibration([spread]))
    base = script_run(stage(BASE, step_ms=30, seed=1))
    head = {**BASE, "train.py:14": ("time.sleep(0.028)", 28.0)}
    decision, _ = judge(base, script_run(stage(head, step_ms=38, seed=2)), rules)
    (wall,) = [g for g in decision.stages if g.metric == "wall"]
    assert wall.outcome == "regression", wall.reason
    assert "grew at train.py:14 `time.sleep(0.028)` +8.0 ms/step" in wall.reason
    assert "a line the head changed" in wall.reason
    waited = {**BASE, "train.py:10": ("loss.backward()", 14.0)}
    decision, _ = judge(base, script_run(stage(waited, step_ms=38, seed=2)), rules)
    (wall,) = [g for g in decision.stages if g.metric == "wall"]
    assert wall.outcome == "inconclusive" and wall.drift, wall.reason


def test_an_uncalibrated_host_bound_script_is_told_its_wall_prior_is_only_the_floor() -> None:
    """nanoGPT's A/A trials on an H200 (reports/examples/h200-gate-nanogpt): the GPU idles ~47%
    of the step and fresh processes differed by 25% in wall time. Gated without a calibration,
    the summary says the wall prior is only the built-in floor; with the machine's calibration
    committed beside them, it does not."""
    from gpudiag.diagnose.trials import load_run_set
    from gpudiag.model.calibration import load_calibration

    example = Path(__file__).resolve().parents[1] / "reports" / "examples" / "h200-gate-nanogpt"
    base, head = load_run_set(example / "aa" / "base"), load_run_set(example / "aa" / "head")
    decision, _ = judge(base, head, GateRules())
    assert any("the built-in floor (5%), and the GPU idles" in line for line in decision.unseen)
    calibrated = GateRules(calibration=load_calibration(example / "calibration.json"))
    decision, _ = judge(base, head, calibrated)
    assert not any("built-in floor" in line for line in decision.unseen), decision.unseen
    (wall,) = [g for g in decision.stages if g.metric == "wall"]
    assert wall.outcome == "inconclusive"  # 25% between processes: it cannot tell, and says so
