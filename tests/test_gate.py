"""The gate's instruments, worked out on paper: exact counters (and the line a change comes
from), device time with its floor, limits, and when to add trials."""

from __future__ import annotations

import math

import pytest
from conftest import ladder_config, ladder_run

from gpudiag.diagnose.compare import compare_runs
from gpudiag.diagnose.counters import CounterChange, compare_counters, line_deltas
from gpudiag.diagnose.gate import GateLimits, decide, parse_limits
from gpudiag.diagnose.noise import DEVICE_FLOOR
from gpudiag.diagnose.trials import merge_trials
from gpudiag.model.errors import BadInput
from gpudiag.model.results import (
    Evidence,
    LineCount,
    RunResult,
    StageResult,
    TelemetrySummary,
)


def _line(location: str, ops: float = 1, syncs: float = 0, function: str = "forward",
          ) -> LineCount:
    return LineCount(location=location, function=function, ops=ops, kernels=ops, syncs=syncs,
                     device_ms=0.1 * ops, sync_idle_ms=0.4 * syncs)


def test_an_insertion_is_found_by_its_counts_not_its_line_number() -> None:
    before = [_line("m.py:10", 3), _line("m.py:11", 5), _line("m.py:12", 2)]
    after = [_line("m.py:10", 3), _line("m.py:11", 2, syncs=1), _line("m.py:12", 5),
             _line("m.py:13", 2)]  # a new line 11, the old 11 and 12 moved down by one
    (delta,) = line_deltas(before, after)
    assert (delta.location, delta.ops, delta.syncs) == ("m.py:11", 2, 1)
    assert delta.cost_ms == pytest.approx(0.2 + 0.4)


def test_a_grown_line_reports_its_growth() -> None:
    (delta,) = line_deltas([_line("m.py:5", 4)], [_line("m.py:5", 7)])
    assert delta.ops == 3 and delta.location == "m.py:5"
    assert line_deltas([_line("m.py:5", 4)], [_line("m.py:5", 4)]) == []


def test_exact_counters_change_by_any_amount_and_varying_ones_by_their_range() -> None:
    exact = CounterChange("syncs", "syncs", "/step", (768, 768), (769, 769))
    assert exact.changed and exact.increase == pytest.approx(1 / 768)
    assert CounterChange("syncs", "syncs", "/step", (0, 0), (1, 1)).increase == math.inf
    varying = CounterChange("kernels", "kernels", "/step", (100, 104), (103, 103))
    assert varying.varies and not varying.changed and varying.increase == 0
    assert CounterChange("kernels", "kernels", "/step", (100, 104), (106, 106)).changed


def test_counter_comparison_names_the_lines_behind_a_change() -> None:
    changes = compare_counters([{"syncs": 3.0, "ops": 10.0}], [{"syncs": 4.0, "ops": 12.0}],
                               [_line("m.py:1", 10)], [_line("m.py:1", 10),
                                                       _line("m.py:2", 2, syncs=1)])
    by_name = {c.name: c for c in changes}
    assert by_name["syncs"].lines[0].location == "m.py:2"
    assert [c.name for c in changes] == ["ops", "syncs"]  # declaration order, both sides only


@pytest.mark.parametrize(("text", "key", "value"), [
    ("5", (None, "wall"), 0.05), ("train=3", ("train", "wall"), 0.03),
    ("device=1", (None, "device"), 0.01), ("train:syncs=0", ("train", "syncs"), 0.0),
    ("copy-bytes=10", (None, "copy-bytes"), 0.10)])
def test_limits_parse(text: str, key: tuple[str | None, str], value: float) -> None:
    assert parse_limits([text]).limits == {key: value}


@pytest.mark.parametrize("text", ["0", "wall=0", "device=0", "syncs=-1", "100", "x=nan",
                                  "syncs=inf", "fast"])
def test_bad_limits_are_refused(text: str) -> None:
    with pytest.raises(BadInput):
        parse_limits([text])


def test_device_time_falls_back_to_the_wall_limit_and_counters_have_none() -> None:
    limits = parse_limits(["train=3"])
    assert limits.get("train", "device") == 0.03 and limits.get("other", "device") == 0.05
    assert limits.get("train", "syncs") is None and limits.counters("train") == set()


def _run(device_ms: list[float], *, syncs: float = 3.0, wall_ms: float = 90.0) -> RunResult:
    evidence = Evidence(steps=len(device_ms), step_ms=200.0, backend="cuda", ops_per_step=100,
                        syncs_per_step=syncs, device_ms_by_step=device_ms,
                        line_counts=[_line("m.py:1", 100, syncs=syncs)])
    stage = StageResult(name="train", status="ok", iter_ms=[wall_ms] * 30,
                        samples_per_step=64, evidence=evidence,
                        telemetry=TelemetrySummary(available=True))
    return ladder_run(stage, device="cuda:0", gpu="H100", config=ladder_config(model="m"))


def test_device_time_decides_what_wall_time_cannot() -> None:
    """One trial a side, steady kernel times: 3% more device time fails a 1% device limit
    (the floor keeps the interval honest), the same device time passes it."""
    base = _run([68.0, 68.1, 68.0, 68.05, 68.02])
    slow = _run([70.1, 70.0, 70.2, 70.1, 70.05])
    limits = parse_limits(["device=1"])
    decision = decide(compare_runs(base, slow), limits)
    device = next(g for g in decision.stages if g.metric == "device")
    assert device.outcome == "regression" and decision.exit_code() == 1
    same = decide(compare_runs(base, _run([68.02, 68.0, 68.1, 68.03, 68.0])), limits)
    assert next(g for g in same.stages if g.metric == "device").outcome == "pass"
    est = compare_runs(base, slow).stages[0].device
    assert est is not None and est.on_prior_alone
    assert est.high - est.low > 2 * 2.5 * DEVICE_FLOOR.sigma  # the floor widens one trial


def test_an_undecided_gate_passes_or_fails_as_asked_and_says_what_it_missed() -> None:
    rough = _run([68.0] * 5)
    rough.stages[0].iter_ms = [90.0 * (1 + 0.2 * ((i * 7) % 5 - 2)) for i in range(30)]
    decision = decide(compare_runs(_run([68.0] * 5), rough))
    assert decision.outcome == "inconclusive"
    assert decision.exit_code("pass") == 0 and decision.exit_code("fail") == 3
    assert any("wall time could only detect" in line for line in decision.unseen)


def test_a_new_sync_fails_only_where_a_limit_is_set() -> None:
    base, head = _run([68.0] * 5), _run([68.0] * 5, syncs=4.0)
    head.stages[0].evidence.line_counts.append(_line("m.py:9", 2, syncs=1))  # type: ignore[union-attr]
    unlimited = decide(compare_runs(base, head), GateLimits())
    assert [c.name for _, c in unlimited.changes] == ["syncs"]
    assert all(g.metric != "syncs" for g in unlimited.stages)
    limited = decide(compare_runs(base, head), parse_limits(["syncs=0"]))
    gate = next(g for g in limited.stages if g.metric == "syncs")
    assert gate.outcome == "regression" and "m.py:9" in gate.reason


def test_more_flops_fail_a_flops_limit_and_the_same_flops_pass_it() -> None:
    """A layer added to the model: 5% more FLOPs per step fails `flops=2` at one trial a side
    (an exact counter), the same FLOPs pass it (benchmarks/gate_regressions.py's extra-layer
    build shows it on real runs)."""
    base, same, wider = _run([68.0] * 5), _run([68.0] * 5), _run([68.0] * 5)
    for run, flops in ((base, 1.0e12), (same, 1.0e12), (wider, 1.05e12)):
        run.stages[0].facts.flops_per_step = flops
    limits = parse_limits(["flops=2"])
    grown = next(g for g in decide(compare_runs(base, wider), limits).stages
                 if g.metric == "flops")
    assert grown.outcome == "regression"
    kept = next(g for g in decide(compare_runs(base, same), limits).stages
                if g.metric == "flops")
    assert kept.outcome == "pass"


def test_trials_wanted_stops_when_decided_at_the_cap_or_out_of_reach() -> None:
    trials = [_run([68.0] * 5, wall_ms=w) for w in (88.0, 95.0)]
    other = [_run([68.0] * 5, wall_ms=w) for w in (91.0, 97.0)]
    decision = decide(compare_runs(merge_trials(trials), merge_trials(other)))
    assert decision.outcome == "inconclusive"
    wanted = decision.trials_wanted(2, 6)
    assert wanted == 0 or 2 < wanted <= 6
    assert decision.trials_wanted(6, 6) == 0


def test_calibrate_warns_of_a_noisy_spread_and_refuses_an_implausible_one() -> None:
    """A spread past 10% is recorded with a warning (the gate then decides only large
    changes); one past 50% is not written at all (the gate would refuse the file)."""
    from gpudiag.model.calibration import CalibrationRecord, StageSpread, plausible
    from gpudiag.model.errors import BadInput

    def record(sd: float) -> CalibrationRecord:
        return CalibrationRecord(device="cpu", gpu_name=None, workload={"model": "dgca"},
                                 stages=[StageSpread(stage="train", trials=5, wall_sd=sd)])

    assert plausible(record(0.02)) == []
    (warning,) = plausible(record(0.2))
    assert "differ by 20.0%" in warning
    with pytest.raises(BadInput, match="differ by 60%"):
        plausible(record(0.6))


def test_calibrating_a_second_script_keeps_the_first() -> None:
    """Profiled scripts share one workload identity and are told apart by their stage (the
    script's name): calibrating finetune.py replaced train.py's record. A stage measured
    again is replaced, each stage found with its own record's date."""
    from gpudiag.model.calibration import Calibration, CalibrationRecord, StageSpread

    def record(stages: dict[str, float], when: str) -> CalibrationRecord:
        return CalibrationRecord(device="cuda", gpu_name="H100", workload={"mode": "profile"},
                                 stages=[StageSpread(stage=n, trials=5, wall_sd=sd)
                                         for n, sd in stages.items()], created_utc=when)

    calibration = (Calibration()
                   .with_record(record({"train.py": 0.04}, "2026-11-01"))
                   .with_record(record({"finetune.py": 0.06}, "2026-11-02"))
                   .with_record(record({"train.py": 0.03, "eval.py": 0.02}, "2026-11-03")))
    found = {name: calibration.find("cuda", "H100", {"mode": "profile"}, name)
             for name in ("train.py", "finetune.py", "eval.py", "other.py")}
    assert {n: (f[0].created_utc, f[1].wall_sd) for n, f in found.items() if f} == {
        "train.py": ("2026-11-03", 0.03), "finetune.py": ("2026-11-02", 0.06),
        "eval.py": ("2026-11-03", 0.02)}
    assert found["other.py"] is None and len(calibration.records) == 2
    assert calibration.find("cpu", None, {"mode": "profile"}, "train.py") is None
