"""What no real run can hold, beyond what each field's type bounds (gpudiag/model/schema.py):
values that contradict each other. A run.json edited by hand, stitched from two runs or written
by a broken tool is refused on load with one line naming the field, rather than compared: a
gate that scores a run from numbers the run's own steps contradict decides nothing.
"""

from __future__ import annotations

from gpudiag.model.config import RunConfig
from gpudiag.model.results import Evidence, RunResult, StageResult, Trial
from gpudiag.model.schema import SchemaError

# Relative slack for a trial's time per step against the stage's steps (float rounding).
DERIVED_REL = 1e-6
# A CUDA kernel launch costs the host about 2 us or more and an eager CPU operator about 1 us
# (PyTorch's dispatch), so a step cannot hold more than one counted event per microsecond;
# the bound allows ten.
MAX_EVENTS_PER_US = 10.0
# Step times sum to at most the time that measured them (the stage's window, the run's
# duration); this slack covers clocks read at slightly different moments.
CLOCK_SLACK_REL, CLOCK_SLACK_MS = 0.02, 5.0
# A stage's steps take, on average, at least the device work each one queues: a GPU runs a
# step's kernels no faster for being timed. The kernel time is measured in the stage's profiler
# window, other steps of the same stage; this share allows those to differ from the timed ones
# (measured runs' timed mean was never below 0.8 of it, reports/examples/).
MIN_STEP_OF_DEVICE_WORK = 0.5
_COUNTED = ("kernels_per_step", "launches_per_step", "ops_per_step", "syncs_per_step",
            "memset_per_step", "collective_calls_per_step")


def _within(value: float, low: float, high: float) -> bool:
    return low * (1 - DERIVED_REL) <= value <= high * (1 + DERIVED_REL)


def _check_trials(stage: StageResult, where: str) -> None:
    for k, trial in enumerate(stage.trials):
        if stage.samples_per_step and trial.samples_per_step != stage.samples_per_step:
            raise SchemaError(f"{where}.trials[{k}].samples_per_step: {trial.samples_per_step} "
                               f"is not the stage's {stage.samples_per_step}")
    if stage.trials and stage.iter_ms and not any(
            _within(t.ms_per_iter, min(stage.iter_ms), max(stage.iter_ms))
            for t in stage.trials):
        raise SchemaError(f"{where}.trials: no trial's time per step lies within the stage's "
                           f"own steps ({min(stage.iter_ms):g}..{max(stage.iter_ms):g} ms)")
    seen: dict[tuple[object, ...], int] = {}
    for k, t in enumerate(stage.trials):
        key = trial_key(t)
        if key in seen:
            raise SchemaError(f"{where}.trials[{k}]: a copy of trials[{seen[key]}] (the same "
                               "step times): trials must be separate processes")
        seen[key] = k


def trial_key(trial: Trial) -> tuple[object, ...]:
    """What no two separate processes share: their step times' summary and kernel times."""
    return (trial.ms_per_iter, trial.iters, tuple(trial.device_ms_by_step),
            trial.energy_per_sample_j)


def _check_evidence(ev: Evidence, where: str) -> None:
    step_us = ev.step_ms * 1e3
    for name in _COUNTED:
        value = getattr(ev, name)
        if value > MAX_EVENTS_PER_US * step_us:
            raise SchemaError(f"{where}.evidence.{name}: {value:g} per step in a "
                               f"{ev.step_ms:g} ms step is impossible")


def _device_work_ms(ev: Evidence) -> float | None:
    """The device work a step of the window surely did: the window's compute per step (not
    its collectives, whose kernels spin while a peer is late and can exceed the step), and no
    more than its lightest step's kernels (one heavy step, an evaluation, weighs on the mean)."""
    busy = ev.compute_busy_ms_per_step
    if busy is None and not ev.collective_ms_per_step:
        busy = ev.device_busy_ms_per_step
    if busy is None or not ev.device_ms_by_step:
        return busy
    return min(busy, *ev.device_ms_by_step)


def _check_steps_against_evidence(stage: StageResult, where: str) -> None:
    """The timed steps are no shorter than the work the same stage's profiler window saw each
    step do: not fewer than a microsecond per ten counted events (host launches, operator
    calls), and on a GPU not shorter than a share of its kernels' busy time. Steps saved from
    the wrong window (a warm-up's microseconds as the timed ones) contradict both."""
    ev = stage.evidence
    if ev is None or not stage.iter_ms:
        return
    mean_ms = sum(stage.iter_ms) / len(stage.iter_ms)
    for name in _COUNTED:
        value = getattr(ev, name)
        if value > MAX_EVENTS_PER_US * mean_ms * 1e3:
            raise SchemaError(f"{where}.iter_ms: a mean step of {mean_ms:.4g} ms cannot hold the "
                              f"{value:g} {name.removesuffix('_per_step')} per step its "
                              "evidence counted")
    busy = _device_work_ms(ev)
    if ev.backend == "cuda" and busy is not None and mean_ms < MIN_STEP_OF_DEVICE_WORK * busy:
        raise SchemaError(f"{where}.iter_ms: a mean step of {mean_ms:.4g} ms is shorter than "
                          f"the {busy:.4g} ms of device work per step its evidence measured")


def _check_flops(stage: StageResult, where: str) -> None:
    ev = stage.evidence
    matmul_ms = (sum(ev.matmul_ms_by_dtype.values())
                 + sum(ev.device_ms_by_kind.get(kind, 0)
                       for kind in ("matmul", "convolution", "attention"))
                 ) if ev is not None else 0.0
    if stage.facts.flops_per_step is not None and stage.facts.flops_per_step <= 0 \
            and matmul_ms > 0:
        raise SchemaError(f"{where}.facts.flops_per_step: {stage.facts.flops_per_step:g} "
                           f"with {matmul_ms:.3g} ms of matmuls per step")


def _check_clock(run: RunResult, stage: StageResult, where: str) -> None:
    timed = sum(stage.iter_ms)
    for name, span_s in (("wall_s", stage.wall_s), ("duration_s", run.duration_s)):
        if span_s is not None and timed > span_s * 1e3 * (1 + CLOCK_SLACK_REL) + CLOCK_SLACK_MS:
            holder = where if name == "wall_s" else "the run"
            raise SchemaError(f"{where}.iter_ms: {timed / 1e3:.4g} s of steps in {holder}'s "
                               f"{span_s:.4g} s ({name})")


def _check_batch(run: RunResult, stage: StageResult, where: str) -> None:
    """A `run` stage's samples per step is the config's batch; a DDP stage's, the batch times
    its ranks (and accumulation steps)."""
    config = run.config
    if not isinstance(config, RunConfig) or not stage.samples_per_step:
        return
    ddp = stage.facts.ddp is not None or stage.facts.ddp_job is not None
    if (stage.samples_per_step % config.batch_size if ddp
            else stage.samples_per_step != config.batch_size):
        what = "a multiple of" if ddp else "equal to"
        raise SchemaError(f"{where}.samples_per_step: {stage.samples_per_step} is not {what} "
                          f"the config's batch of {config.batch_size}")


def check_run(run: RunResult) -> None:
    """SchemaError, naming the field, for the first value the run's others contradict."""
    for i, stage in enumerate(run.stages):
        where = f"stages[{i}]"
        _check_batch(run, stage, where)
        _check_trials(stage, where)
        _check_clock(run, stage, where)
        _check_flops(stage, where)
        if stage.evidence is not None:
            _check_evidence(stage.evidence, where)
            _check_steps_against_evidence(stage, where)
