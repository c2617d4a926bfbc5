"""The whole run's accounting (gpudiag/diagnose/timeline.py) on planted timelines: periodic
work at any period, two periods interleaved, a slow step after each occurrence, jitter; and
parts that add up to the wall time."""

from __future__ import annotations

import random

import pytest

from gpudiag.diagnose.timeline import RunAccount, account
from gpudiag.model.facts import OtherLoop, SaveRecord, StepTimeline

STEP_MS = 23.0


def _timeline(n: int = 200, *, eval_every: int | None = None, eval_ms: float = 0.0,
              save_every: int | None = None, save_ms: float = 0.0, after_ms: float = 0.0,
              other_every: int | None = None, other_ms: float = 0.0, jitter: float = 0.02,
              seed: int = 0) -> StepTimeline:
    rng = random.Random(seed)
    times = [1000.0] + [STEP_MS * (1 + rng.uniform(-jitter, jitter)) for _ in range(n - 1)]
    loop = OtherLoop(location="train.py:40", function="evaluate", caller="train.py:88")
    saves = []
    for i in range(1, n):
        if eval_every and i % eval_every == 0:
            times[i] += eval_ms
            loop.steps.append(i)
            loop.batches += 10
            if i + 1 < n:
                times[i + 1] += after_ms  # the step after an evaluation is a little slower
        if save_every and i % save_every == 0:
            times[i] += save_ms
            saves.append(SaveRecord(step=i, blocking_ms=save_ms))
        if other_every and i % other_every == 0:
            times[i] += other_ms
    return StepTimeline(step_ms=times, steps=n, total_ms=sum(times),
                        data_wait_ms=[0.0] * n, saves=saves,
                        loops=[loop] if loop.steps else [])


def _parts_add_up(timeline: StepTimeline) -> None:
    whole = account(timeline)
    assert whole is not None
    assert sum(ms for _, ms in whole.parts()) == pytest.approx(whole.wall_ms)
    assert sum(whole.share(ms) for _, ms in whole.parts()) == pytest.approx(1.0)


@pytest.mark.parametrize("every", [3, 10, 20, 50, 90])
def test_an_evaluation_at_any_period_is_priced_on_the_whole_run(every: int) -> None:
    timeline = _timeline(eval_every=every, eval_ms=218.0, after_ms=2.0)
    whole = account(timeline)
    assert whole is not None
    loop = next(w for w in whole.works if w.kind == "loop")
    assert loop.period == every and loop.per_occurrence_ms == pytest.approx(218.0, rel=0.03)
    planted = 218.0 * (199 // every)
    assert whole.share(loop.extra_ms) == pytest.approx(planted / timeline.total_ms, rel=0.03)
    assert whole.step_ms == pytest.approx(STEP_MS, rel=0.02)
    _parts_add_up(timeline)


def test_a_save_every_7_and_an_evaluation_every_10_are_two_parts_that_add_up() -> None:
    timeline = _timeline(eval_every=10, eval_ms=218.0, save_every=7, save_ms=60.0, after_ms=2.0)
    whole = account(timeline)
    assert whole is not None
    kinds = {w.kind: w for w in whole.works}
    assert kinds["save"].period == 7 and kinds["loop"].period == 10
    assert kinds["save"].per_occurrence_ms == pytest.approx(60.0, rel=0.05)
    assert kinds["loop"].per_occurrence_ms == pytest.approx(218.0, rel=0.05)
    truth = (60.0 * (199 // 7) + 218.0 * (199 // 10)) / timeline.total_ms
    assert whole.share(kinds["save"].extra_ms + kinds["loop"].extra_ms) == pytest.approx(
        truth, rel=0.03)
    _parts_add_up(timeline)


def test_periodic_work_that_is_neither_save_nor_loop_is_found_by_its_period() -> None:
    timeline = _timeline(other_every=13, other_ms=120.0, eval_every=20, eval_ms=80.0)
    whole = account(timeline)
    assert whole is not None
    other = next(w for w in whole.works if w.kind == "other")
    assert other.period == 13 and other.per_occurrence_ms == pytest.approx(120.0, rel=0.05)
    assert whole.irregular_ms < 0.01 * whole.wall_ms
    _parts_add_up(timeline)


def test_a_steady_run_has_no_periodic_work() -> None:
    timeline = _timeline(jitter=0.1)
    whole = account(timeline)
    assert whole is not None and not whole.works
    assert whole.share(whole.steady_ms + whole.startup_ms) > 0.98
    _parts_add_up(timeline)


def test_a_short_timeline_is_not_accounted() -> None:
    assert account(_timeline(n=12, eval_every=3, eval_ms=100.0)) is None


def test_the_profiler_window_is_gpudiags_own_part() -> None:
    timeline = _timeline()
    timeline.window_start, timeline.window_end = 35, 38
    for i in range(35, 39):  # the window's steps, and the one that closes it
        timeline.step_ms[i] += 225.0
    timeline.total_ms = sum(timeline.step_ms)
    whole = account(timeline)
    assert whole is not None and not whole.works
    assert whole.window_ms == pytest.approx(900.0, rel=0.02)
    _parts_add_up(timeline)


def test_an_evaluation_too_rare_for_a_period_beside_saves_is_named_at_its_line() -> None:
    """nanoGPT's case: an evaluation every 20 steps of a 60-step run (no DataLoader), on the
    steps that also save. Two occurrences show no period; the host samples of those slow
    steps put the extra beyond the save at the evaluation's call: a work of its own, priced
    apart from the saves, nothing left irregular. Jitter's lone spikes stay irregular."""
    from gpudiag.model.facts import HostLine, HostSamples, HostStep

    timeline = _timeline(n=60, other_every=20, other_ms=300.0, save_every=20, save_ms=40.0,
                         jitter=0.02)
    timeline.step_ms[33] += 60.0  # a lone spike the samples put elsewhere
    steady = {"train.py:30": 15.0, "train.py:31": 8.0}
    slow = [HostStep(step=s, ms=timeline.step_ms[s], loop_ms={**steady, "train.py:44": 300.0,
                                                              "train.py:46": 40.0})
            for s in (20, 40)]
    slow.append(HostStep(step=33, ms=timeline.step_ms[33],
                         loop_ms={"train.py:30": 75.0, "train.py:31": 8.0}))
    host = HostSamples(period_ms=5.0, samples=400, steady_steps=50,
                       steady_wall_ms=50 * STEP_MS, sampled_ms=50 * STEP_MS,
                       lines=[HostLine("train.py:30", "<module>", "torch", 50 * 15.0)],
                       loop="train.py:28", loop_ms={k: 50 * v for k, v in steady.items()},
                       slow_steps=slow, text={"train.py:44": "losses = estimate_loss()"})
    whole = account(timeline, host)
    assert whole is not None
    kinds = {w.kind: w for w in whole.works}
    assert kinds["save"].steps == [20, 40]
    assert kinds["save"].per_occurrence_ms == pytest.approx(40.0, rel=0.1)
    evaluation = kinds["other"]
    assert (evaluation.line, evaluation.steps) == ("train.py:44", [20, 40])
    assert evaluation.per_occurrence_ms == pytest.approx(300.0, rel=0.1)
    assert evaluation.line_text == "losses = estimate_loss()"
    assert whole.irregular_ms == pytest.approx(60.0, rel=0.2)  # the lone spike
    _parts_add_up(timeline)


def test_a_saves_callers_say_exactly_whether_a_saving_steps_extra_is_the_saves() -> None:
    """Where each save recorded the lines that called it, the training-loop line holding a
    saving step's most extra decides: its own call (building the state it writes, HF
    Trainer's `_maybe_log_save_evaluate(`) keeps the extra with the save however the rest of
    the step jitters; another line's (an evaluation) is a work of its own."""
    from gpudiag.model.facts import HostSamples, HostStep

    def saving_run(top_line: str) -> RunAccount:
        timeline = _timeline(n=60, save_every=20, save_ms=40.0, other_every=20,
                             other_ms=200.0, jitter=0.02)
        for save in timeline.saves:
            save.stack = ["torch/serialization.py:900", "trainer.py:3100", "train.py:46"]
        steady = {"train.py:30": 15.0, "train.py:31": 8.0}
        # Another line's jitter at half the save's blocking: the old rule split the extra off.
        slow = [HostStep(step=s, ms=timeline.step_ms[s],
                         loop_ms={"train.py:30": 15.0 + 25.0, "train.py:31": 8.0,
                                  top_line: 200.0 + (40.0 if top_line == "train.py:46" else 0),
                                  **({"train.py:46": 40.0} if top_line != "train.py:46"
                                     else {})})
                for s in (20, 40)]
        host = HostSamples(period_ms=5.0, samples=400, steady_steps=50,
                           steady_wall_ms=50 * STEP_MS, sampled_ms=50 * STEP_MS,
                           loop="train.py:28", loop_ms={k: 50 * v for k, v in steady.items()},
                           slow_steps=slow)
        whole = account(timeline, host)
        assert whole is not None
        _parts_add_up(timeline)
        return whole

    kinds = {w.kind: w for w in saving_run("train.py:46").works}
    assert "other" not in kinds
    assert kinds["save"].per_occurrence_ms == pytest.approx(240.0, rel=0.1)
    kinds = {w.kind: w for w in saving_run("train.py:44").works}
    assert kinds["save"].per_occurrence_ms == pytest.approx(40.0, rel=0.1)
    assert kinds["other"].line == "train.py:44"


def test_steps_the_machine_slowed_are_no_lines_work() -> None:
    """Another process on the CPU stretches a step's every line alike: its extra sits most at
    the busiest line (the backward), in the share that line always holds. Two such steps are
    irregular, not work at that line; where the same extra sits at a line ordinary steps barely
    visit, it is that line's work (item_sync.py under load once read "Work at
    item_sync.py:25 (`per_sample.mean().backward()`): 8 ms every 12 steps")."""
    from gpudiag.model.facts import HostSamples, HostStep

    def stretched(extra_at: dict[str, float]) -> RunAccount | None:
        timeline = _timeline(n=40, jitter=0.02)
        for s in (14, 26):
            timeline.step_ms[s] += 2.5 * STEP_MS
        timeline.total_ms = sum(timeline.step_ms)
        steady = {"train.py:25": 7.0, "train.py:24": 3.0}
        slow = [HostStep(step=s, ms=timeline.step_ms[s],
                         loop_ms={k: v + extra_at.get(k, 0.0) for k, v in steady.items()})
                for s in (14, 26)]
        host = HostSamples(period_ms=1.0, samples=400, steady_steps=30,
                           steady_wall_ms=30 * STEP_MS, sampled_ms=30 * STEP_MS,
                           loop="train.py:20", loop_ms={k: 30 * v for k, v in steady.items()},
                           slow_steps=slow)
        return account(timeline, host)

    load = stretched({"train.py:25": 2.5 * 7.0, "train.py:24": 2.5 * 3.0})
    assert load is not None and not [w for w in load.works if w.line is not None]
    work = stretched({"train.py:24": 2.5 * 10.0})  # ordinarily 30% of the loop
    assert work is not None
    assert [(w.line, w.steps) for w in work.works] == [("train.py:24", [14, 26])]


def test_a_run_cut_short_is_projected_to_the_steps_it_means_to_make() -> None:
    """Stopped after gpudiag's window at step 40 of the 2,000 its loop makes: the whole run
    at this run's cost per step, start-up and exit as measured; a run that ended by itself
    (a `break` before its loop's end) is not projected."""
    from gpudiag.present.waterfall import projection

    times = [2000.0] + [10.0] * 39
    timeline = StepTimeline(step_ms=times, steps=40, total_ms=sum(times) + 50.0, tail_ms=50.0,
                            planned_steps=2000, planned_from="the loop at train.py:12",
                            cut_short=True)
    whole = account(timeline)
    assert whole is not None and whole.projected_ms == pytest.approx(2000 + 10 * 2000 + 50)
    text = projection(whole)
    assert text is not None and "2,000 steps (the loop at train.py:12)" in text
    assert "the training loop 90.7% of it" in text  # 20,000 of 22,050 ms
    ended = account(StepTimeline(step_ms=times, steps=40, total_ms=sum(times) + 50.0,
                                 tail_ms=50.0, planned_steps=2000, planned_from="x"))
    assert ended is not None and ended.projected_ms is None and projection(ended) is None
