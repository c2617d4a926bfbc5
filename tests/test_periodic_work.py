"""Periodic work (GD703) is work the script does, recurs, and is priced on the device's step
where the step is asynchronous; a saving step is the save's, priced whole once (GD701); and
gpudiag's own slow steps (its warm-up's end, its profiler window) are never either (issue 55).
Built runs: each plants what a real run showed on an H200 or a CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from conftest import profile_script, script_run, script_stage

from gpudiag.diagnose import evaluate
from gpudiag.diagnose.timeline import account, gpudiags_steps, stage_account
from gpudiag.model.facts import (
    CheckpointFacts,
    HostSamples,
    HostStep,
    OtherLoop,
    SaveRecord,
    StepTimeline,
)
from gpudiag.model.results import Evidence, Finding, RunResult
from gpudiag.present.findings import diagnosis_markdown

WARMUP, TIMED, WINDOW = 5, 30, 3  # gpudiag's default schedule
WINDOW_START = WARMUP + TIMED


def _timeline(times: list[float], saves: list[SaveRecord] | None = None) -> StepTimeline:
    """A run's host clock, with gpudiag's window after the timed steps."""
    return StepTimeline(step_ms=times, steps=len(times), total_ms=sum(times),
                        data_wait_ms=[0.0] * len(times), saves=saves or [],
                        window_start=WINDOW_START, window_end=WINDOW_START + WINDOW)


def _jittered(n: int, step_ms: float, seed: int = 0, jitter: float = 0.03) -> list[float]:
    rng = random.Random(seed)
    return [step_ms * (1 + rng.uniform(-jitter, jitter)) for _ in range(n)]


def _run(timeline: StepTimeline, iter_ms: list[float],
         host: HostSamples | None = None) -> RunResult:
    stage = script_stage(iter_ms, warmup=WARMUP, timed=TIMED, steps=len(timeline.step_ms),
                         timeline=timeline, host=host)
    stage.timer = "cuda-events"  # as a CUDA profile times its steps
    return script_run(stage, device="cuda")


def _codes(findings: list[Finding]) -> list[str]:
    return [f.id for f in findings]


def _launch_queue_run(device_steps: list[float]) -> RunResult:
    """A GPU-bound fp32 MLP (~180 ms of matmuls a step): the host runs ahead at 2.5 ms a step
    and, every 13 steps, blocks ~270 ms at `opt.step()` for CUDA's launch queue to drain,
    while the device's timed steps are `device_steps`."""
    times = [9000.0, *_jittered(199, 2.5)]
    for i in range(13, 200, 13):
        times[i] += 267.0
    slow = [HostStep(step=i, ms=times[i], loop_ms={"mlp.py:30": 1.5, "mlp.py:31": 268.0})
            for i in range(13, 200, 13)]
    host = HostSamples(period_ms=1.0, samples=400, steady_steps=150,
                       steady_wall_ms=150 * 2.5, sampled_ms=150 * 2.5, loop="mlp.py:25",
                       loop_ms={"mlp.py:30": 150 * 1.5, "mlp.py:31": 150 * 0.9},
                       slow_steps=slow, text={"mlp.py:31": "opt.step()"})
    return _run(_timeline(times), device_steps, host=host)


def test_a_host_blocked_on_a_full_launch_queue_is_no_periodic_work() -> None:
    """The issue's H200 case: "Work at `opt.step()`: 267 ms 3 times (37% of the training
    loop)", critical, on a step whose device time never varied. The host's steady step is far
    below the device's timed one: its clock shows where it waited, so the spikes are the
    device's queue, its own part, and the steady device steps show no periodic work."""
    run = _launch_queue_run(_jittered(TIMED, 180.0, seed=1, jitter=0.01))
    stage = run.stages[0]
    whole = stage_account(stage)
    assert whole is not None and whole.asynchronous and stage.facts.script is not None
    timeline = stage.facts.script.timeline
    assert timeline is not None
    assert not [w for w in whole.works if w.kind == "other"]
    blocked = [i for i in range(13, 200, 13) if i not in gpudiags_steps(timeline, WARMUP)]
    assert whole.device_wait_ms == pytest.approx(267.0 * len(blocked), rel=0.05)
    assert sum(ms for _, ms in whole.parts()) == pytest.approx(whole.wall_ms)
    assert "GD703" not in _codes(evaluate(run))
    # The same host clock from a synchronous step (the device's step is the host's): the
    # blocking is then the script's own work, and found: the branch above is what spared it.
    synchronous = _launch_queue_run(_jittered(TIMED, 2.5, seed=1, jitter=0.01))
    assert "GD703" in _codes(evaluate(synchronous))


def test_a_cpu_steps_timed_steps_are_no_device_clock() -> None:
    """A CPU has no launch queue: its timed steps are host-clock steps, which a loaded machine
    makes slower than the timeline's by chance (a Lightning run on a 2-core VM: timed 96 ms,
    steady 1.1 ms). The run is then no asynchronous one: no "host waiting for the device"
    part, and its spikes stay the script's."""
    run = _launch_queue_run(_jittered(TIMED, 180.0, seed=1, jitter=0.01))
    run.stages[0].timer = "host-clock"
    whole = stage_account(run.stages[0])
    assert whole is not None and not whole.asynchronous and whole.device_wait_ms == 0.0
    assert "the host waiting for the device" not in " ".join(name for name, _ in whole.parts())


def test_an_asynchronous_steps_periodic_work_is_judged_on_the_device_clock() -> None:
    """Work the device does every 10 steps (an evaluation's forward passes): the timed steps,
    CUDA-event-timed, spike with its period, and GD703 prices it on them."""
    device = _jittered(TIMED, 180.0, seed=2, jitter=0.01)
    for i in range(9, TIMED, 10):
        device[i] += 90.0
    findings = [f for f in evaluate(_launch_queue_run(device)) if f.id == "GD703"]
    assert len(findings) == 1
    assert findings[0].evidence["device_clock"] is True
    assert findings[0].evidence["period_steps"] == 10
    assert "evaluation job" not in findings[0].fix


def test_an_asynchronous_steps_evaluation_loop_is_one_finding() -> None:
    """An evaluation DataLoader loop every 10 steps, named on the host's timeline, spikes the
    device's timed steps too: it is priced once, at its loop, not again on the device clock."""
    run = _launch_queue_run(_jittered(TIMED, 180.0, seed=1, jitter=0.01))
    stage = run.stages[0]
    assert stage.facts.script is not None and stage.facts.script.timeline is not None
    timeline = stage.facts.script.timeline
    loop = OtherLoop(location="mlp.py:50", function="evaluate", caller="mlp.py:40")
    for i in range(10, 200, 10):
        timeline.step_ms[i] += 900.0
        loop.steps.append(i)
    timeline.loops = [loop]
    timeline.total_ms = sum(timeline.step_ms)
    for i in range(10 - WARMUP, TIMED, 10):  # the same evaluations, on the device's clock
        stage.iter_ms[i] += 900.0
    findings = [f for f in evaluate(run) if f.id == "GD703"]
    assert [f.location for f in findings] == ["mlp.py:40"]


def test_gpudiags_own_steps_are_the_schedules_boundaries() -> None:
    timeline = _timeline([1.0] * 60)
    assert gpudiags_steps(timeline, WARMUP) == {4, 5, 6, 34, 35, 36, 37, 38, 39}
    timeline.window_end = None  # the script ended inside the window: all that follows
    assert gpudiags_steps(timeline, WARMUP) >= set(range(34, 60))


def test_gpudiags_warm_up_end_and_window_never_become_periodic_work() -> None:
    """The issue's Lightning and pandas runs: the end of gpudiag's warm-up, the steps around
    its profiler window (its start, its close on the step after, a step either side) and one
    hiccup became critical findings on `clip_grad_norm_` and `pd.concat` lines. Their extra is
    gpudiag's own part; the one hiccup has no period; nothing is periodic work."""
    times = [4000.0, *_jittered(119, 20.0, seed=3)]
    for i, extra in {WARMUP: 184.0, WARMUP + 1: 40.0, WINDOW_START - 1: 60.0,
                     WINDOW_START: 500.0, WINDOW_START + WINDOW: 300.0,
                     WINDOW_START + WINDOW + 1: 90.0, 77: 184.0}.items():
        times[i] += extra
    slow = [HostStep(step=i, ms=times[i], loop_ms={"train.py:40": 12.0 + times[i] - 20.0,
                                                  "train.py:41": 8.0})
            for i in (WARMUP, WARMUP + 1, WINDOW_START - 1, 77)]
    host = HostSamples(period_ms=1.0, samples=400, steady_steps=100,
                       steady_wall_ms=2000.0, sampled_ms=2000.0, loop="train.py:30",
                       loop_ms={"train.py:40": 100 * 4.0, "train.py:41": 100 * 8.0},
                       slow_steps=slow, text={"train.py:40": "clip_grad_norm_(...)"})
    timeline = _timeline(times)
    whole = account(timeline, host, warmup=WARMUP)
    assert whole is not None and not whole.works
    assert whole.window_ms == pytest.approx(184 + 40 + 60 + 500 + 300 + 90, rel=0.05)
    assert whole.irregular_ms == pytest.approx(184.0, rel=0.1)  # the hiccup
    run = _run(timeline, _jittered(TIMED, 20.0, seed=4), host=host)
    assert not {"GD701", "GD703"} & set(_codes(evaluate(run)))


def test_real_periodic_work_is_still_found_around_gpudiags_steps() -> None:
    """An evaluation every 10 steps whose occurrence falls on gpudiag's own steps (step 5, the
    window's): those slots are unseen, the rest still show the period."""
    times = [4000.0, *_jittered(119, 20.0, seed=5)]
    for i in range(5, 120, 10):
        times[i] += 150.0
    whole = account(_timeline(times), warmup=WARMUP)
    assert whole is not None
    other = next(w for w in whole.works if w.kind == "other")
    assert other.period == 10 and other.per_occurrence_ms == pytest.approx(150.0, rel=0.05)


def test_slow_steps_at_the_line_that_is_the_step_are_no_work() -> None:
    """Lightning's `self.advance(data_fetcher)` holds the whole step: three runs gave three
    different findings at it (20-28 ms, irregular). Slow steps at the step's own line are
    slow steps; at another line, with no period, they recur by chance: neither is work."""
    times = [4000.0, *_jittered(99, 20.0, seed=6)]
    irregular = (23, 51, 62)
    for i in irregular:
        times[i] += 25.0
    steady = {"fit.py:10": 19.0, "fit.py:11": 1.0}

    def host_at(line: str) -> HostSamples:
        slow = [HostStep(step=i, ms=times[i], loop_ms={**steady, line: steady.get(line, 0.0)
                                                      + 25.0}) for i in irregular]
        return HostSamples(period_ms=1.0, samples=400, steady_steps=80,
                           steady_wall_ms=1600.0, sampled_ms=1600.0, loop="fit.py:5",
                           loop_ms={k: 80 * v for k, v in steady.items()}, slow_steps=slow)

    for line in ("fit.py:10", "fit.py:12"):
        whole = account(_timeline(times), host_at(line), warmup=WARMUP)
        assert whole is not None and not whole.works, line
        assert whole.irregular_ms == pytest.approx(75.0, rel=0.1)


def _hf_save_run(*, timeline: bool) -> RunResult:
    """HF Trainer's checkpoint (`save_steps=25`): ~80 ms a saving step, of which the
    torch.save calls (optimizer, scheduler, RNG) block ~10 ms; the model's safetensors write
    and the Trainer's bookkeeping around it are the rest."""
    times = [9000.0, *_jittered(149, 30.0, seed=7)]
    saves = []
    for i in range(25, 150, 25):
        times[i] += 80.0
        saves.append(SaveRecord(step=i, blocking_ms=10.0, total_ms=10.0))
    iter_ms = times[WARMUP:WARMUP + TIMED]
    if timeline:
        return _run(_timeline(times, saves), iter_ms)
    # An older run without a timeline: the timed steps' saves, a save every 10 steps.
    iter_ms = _jittered(TIMED, 30.0, seed=8)
    timed_saves = []
    for i in range(9, TIMED, 10):
        iter_ms[i] += 80.0
        timed_saves.append(SaveRecord(step=i, blocking_ms=10.0, total_ms=10.0))
    run = _run(_timeline(times), iter_ms)
    stage = run.stages[0]
    assert stage.facts.script is not None
    stage.facts.script.timeline = None
    stage.facts.checkpoint = CheckpointFacts(mode="sync", every=10, saves=timed_saves)
    return run


@pytest.mark.parametrize("timeline", [True, False], ids=["timeline", "timed-steps"])
def test_a_saving_step_is_priced_whole_once(timeline: bool) -> None:
    """GD701 priced only the torch.save part (~10 of ~80 ms) and the rest became a GD703 "not
    a checkpoint save": the saving step is the save's, priced whole by GD701, and no GD703."""
    findings = evaluate(_hf_save_run(timeline=timeline))
    assert "GD703" not in _codes(findings)
    stall = next(f for f in findings if f.id == "GD701")
    assert stall.evidence["stall_ms_per_save"] == pytest.approx(80.0, rel=0.1)


def test_an_evaluation_on_the_saving_step_at_another_line_stays_its_own() -> None:
    """Where the host samples put the save at one line and most of the step's extra at
    another (nanoGPT's `estimate_loss()` on the saving step), the rest is other work: the
    save is priced at its blocking, the evaluation apart."""
    times = [4000.0, *_jittered(79, 20.0, seed=9)]
    saves = []
    for i in (20, 40, 60):
        times[i] += 340.0
        saves.append(SaveRecord(step=i, blocking_ms=40.0))
    steady = {"train.py:30": 15.0, "train.py:31": 5.0}
    slow = [HostStep(step=i, ms=times[i], loop_ms={**steady, "train.py:44": 300.0,
                                                   "train.py:46": 40.0}) for i in (20, 40, 60)]
    host = HostSamples(period_ms=1.0, samples=400, steady_steps=60, steady_wall_ms=1200.0,
                       sampled_ms=1200.0, loop="train.py:28",
                       loop_ms={k: 60 * v for k, v in steady.items()}, slow_steps=slow)
    whole = account(_timeline(times, saves), host, warmup=WARMUP)
    assert whole is not None
    kinds = {w.kind: w for w in whole.works}
    assert kinds["save"].per_occurrence_ms == pytest.approx(40.0, rel=0.1)
    assert kinds["other"].line == "train.py:44"
    assert kinds["other"].per_occurrence_ms == pytest.approx(300.0, rel=0.1)


def test_a_loaded_machines_jitter_on_a_saving_step_leaves_the_save_whole() -> None:
    """HF Trainer's save at one loop line (`self._maybe_log_save_evaluate(`) with a loaded
    2-core machine's jitter spread over the step's other lines, together more than half the
    save's blocking but none of them alone: the extra is the save's, not other work (CI split
    it off once, when the lines' sum was the test)."""
    times = [4000.0, *_jittered(79, 20.0, seed=11)]
    saves = []
    for i in (20, 40, 60):
        times[i] += 80.0
        saves.append(SaveRecord(step=i, blocking_ms=10.0))
    steady = {f"trainer.py:{n}": 4.0 for n in range(10, 15)}
    slow = [HostStep(step=i, ms=times[i], loop_ms={
        **{line: ms + 1.5 for line, ms in steady.items()}, "trainer.py:20": 72.0})
        for i in (20, 40, 60)]
    host = HostSamples(period_ms=1.0, samples=400, steady_steps=60, steady_wall_ms=1200.0,
                       sampled_ms=1200.0, loop="trainer.py:8",
                       loop_ms={k: 60 * v for k, v in steady.items()}, slow_steps=slow)
    whole = account(_timeline(times, saves), host, warmup=WARMUP)
    assert whole is not None
    assert [w.kind for w in whole.works] == ["save"], whole.works
    assert whole.works[0].per_occurrence_ms == pytest.approx(80.0, rel=0.15)


def test_a_script_that_raised_after_its_timed_steps_keeps_its_findings() -> None:
    """A script that raised after 45 timed steps got "No evidence ... the stage failed" though
    its steps were timed and profiled: they are judged, and the failure is said beside them."""
    run = _hf_save_run(timeline=True)
    stage = run.stages[0]
    stage.status, stage.error = "error", "the script raised ValueError: boom"
    assert "GD701" not in _codes(evaluate(run))  # no window: nothing profiled to judge
    stage.evidence = Evidence(steps=3, step_ms=30.0, backend="cuda")
    run.findings = evaluate(run)
    assert "GD701" in _codes(run.findings)
    text = "\n".join(diagnosis_markdown(run))
    assert "No evidence" not in text
    assert "train.py: the script raised ValueError: boom, after its 30 timed steps" in text


CLEAN = Path(__file__).resolve().parent.parent / "examples" / "clean.py"


@pytest.mark.heavy
def test_a_clean_script_profiled_five_times_gives_no_warning(tmp_path: Path) -> None:
    """examples/clean.py, profiled five times on this CPU (a short schedule, stopped after
    gpudiag's window: ~20 s a run): no run gives a warning-level finding, whatever noise,
    warm-up end or window its steps carried. Each run starts afresh (its own folder)."""
    said = []
    for trial in range(5):
        folder = tmp_path / str(trial)
        folder.mkdir()
        run = profile_script(folder, CLEAN, "--warmup", "3", "--timed", "20",
                             "--evidence-steps", "2", "--stop-after-window").ok()
        said += [f"run {trial}: {f.id} {f.severity} {f.title}" for f in run.findings
                 if f.severity != "info"]
    assert not said, said
