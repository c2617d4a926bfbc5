"""`gpudiag profile --try-fixes`: which remedies a diagnosed run calls for, and what each one
bought when the script ran with it (step time with an interval, energy, equivalence).

Pure functions of recorded runs, like the rules: the runs themselves are made by
gpudiag/measure/profile (the remedies applied inside the script, the runs sequenced by
tryfixes.py).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpudiag.diagnose.compare import estimate_ratio
from gpudiag.diagnose.headroom import Headroom, headroom
from gpudiag.diagnose.loaderadvice import loader_change, slower_workers
from gpudiag.diagnose.noise import floor_for
from gpudiag.diagnose.trials import BLOCK_STEPS, StageSamples, steady_state
from gpudiag.model.config import ProfileConfig
from gpudiag.model.facts import LoaderUse
from gpudiag.model.remedies import (
    BASELINE_RUNS,
    COMBINED_RUN,
    NO_REMEDY,
    REMEDIES,
    LoaderRecord,
    Numerics,
    Remedy,
    RemedyEvidence,
    remedies_for,
)
from gpudiag.model.results import Equivalence, Finding, MeasuredFix, RunResult, StageResult

FIX_ALPHA = 0.05  # 95% intervals, as compare shows
# Losses of two runs without any fix differ by this much at least (a relative difference):
# float reductions in a different order. Exact remedies must stay within EXACT_FLOOR_FACTOR
# times the measured floor (or EXACT_MIN_TOLERANCE on a machine that reproduces exactly).
EXACT_MIN_TOLERANCE = 1e-6
EXACT_FLOOR_FACTOR = 4.0
# A precision remedy (TF32, bf16) changes the first losses by well under this: the usual
# mixed-precision deviation of a loss at the start of training (fp16/bf16 keep 8 bits of
# exponent or more; a loss moving more than 5% is not rounding).
PRECISION_GAP = 0.05
# A reordered remedy (a fused or foreach optimizer step) rounds each element's update in
# another order. The rounding error of a sum of n terms grows as sqrt(n) times the unit
# roundoff in practice (Higham & Mary, "A New Approach to Probabilistic Rounding Error
# Analysis", SIAM J. Sci. Comput. 41(5), 2019; the worst case is n times, Higham, "Accuracy and
# Stability of Numerical Algorithms", 2nd ed., 2002, eq. 4.4); the loss sums the effect of every
# parameter element, and each optimizer step adds its own: the losses may differ by
# FP32_EPSILON x sqrt(elements) x steps. fp32: the dtype torch.optim's fused kernels update
# fp32 parameters and their moments in (a script stepping bf16 parameters rounds 65536x more,
# and is held to fp32's tolerance all the same: said "differs", never wrongly "same").
# Measured on an H200 (an 86M-parameter transformer under bf16 autocast, 5 losses): fused
# AdamW moved them 1.3e-5 (the exact check said DIFFERS), foreach 1.6e-5, within 4.4e-3; so did
# a learning rate 5% higher (4.3e-4): a few first losses tell a gross change (a dropped
# scaler, a wrong update) from rounding, not a small change of a hyperparameter.
FP32_EPSILON = 2.0 ** -23
# However many elements and steps: rounding that moves the first losses by more than this is
# training diverging (an update changed), not the order of a sum.
MAX_REORDER_GAP = 0.01
# Two runs without any fix whose first losses differ by more than a precision change may move
# them (a script resuming from its own checkpoint, a random data order) cannot tell whether a
# fix computes the same thing: the verdict is withheld.
MAX_LOSS_FLOOR = PRECISION_GAP
# NVML's total-energy counter moves in steps of about 100 ms (the quantum the presets' stage
# windows are sized against, gpudiag/model/config.py): a timed window this long keeps that
# within 5% of the energy.
MIN_ENERGY_WINDOW_S = 2.0
# The larger-batch remedy's factor: a power of two from MIN_BATCH_FACTOR (less is noise beside
# a step's spread) to MAX_BATCH_FACTOR (a host-bound step is rarely still host-bound at 8x, and
# a recipe tuned at one batch rarely survives more without its schedule retuned), and at most
# what the headroom says fits.
MIN_BATCH_FACTOR, MAX_BATCH_FACTOR = 2, 8
LARGER_BATCH = "larger-batch"


@dataclass
class FixPlan:
    """The remedies to measure, in order, and the findings no remedy can answer."""

    remedies: list[Remedy] = field(default_factory=list)
    untreated: list[MeasuredFix] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why a called-for remedy is not tried
    # The larger batch's ask (batch_factor): the training batch times this, that DataLoader
    # known by the line that built it.
    batch_factor: int = MIN_BATCH_FACTOR
    batch_site: str | None = None

    def configured(self, config: ProfileConfig) -> ProfileConfig:
        """`config` for the fixes' runs: with the larger batch's ask (which only a run given
        that remedy reads)."""
        return dataclasses.replace(config, batch_factor=self.batch_factor,
                                   batch_site=self.batch_site)


def training_loader(run: RunResult) -> LoaderUse | None:
    """The DataLoader whose batches fed the diagnosed run's training steps."""
    stage = _main_stage(run)
    loaders = stage.facts.script.loaders if stage is not None and stage.facts.script else []
    return next((use for use in loaders if use.training), None)


def batch_factor(room: Headroom | None) -> int | None:
    """How many times the training batch the larger-batch remedy tries: the largest power of
    two from MIN_BATCH_FACTOR to MAX_BATCH_FACTOR that the diagnosed step's headroom `room`
    says fits; None where it fits less (or the run counted no owners on a CUDA device)."""
    times = room.times if room is not None else None
    if times is None or times < MIN_BATCH_FACTOR:
        return None
    return 2 ** int(math.log2(min(times, MAX_BATCH_FACTOR)))


def _headroom(run: RunResult) -> Headroom | None:
    stage = _main_stage(run)
    return headroom(stage) if stage is not None else None


def _no_larger_batch(run: RunResult) -> str | None:
    """Why the larger-batch remedy is not tried on `run` (None: it is)."""
    loader, room = training_loader(run), _headroom(run)
    if loader is None:
        return "no DataLoader fed the training steps"
    if loader.iterable:
        return "the training DataLoader reads an IterableDataset"
    if loader.batch_size is None:
        return "a batch_sampler makes the training batches"
    if room is None:
        return "no headroom measured (the memory owners of a step on a CUDA device)"
    if batch_factor(room) is None:
        return (f"the step's memory leaves room for {room.times or 0:.1f}x its batch, less "
                f"than {MIN_BATCH_FACTOR}x")
    return None


def _no_blocks(run: RunResult) -> str | None:
    """Why activation checkpointing is not tried on `run`: the diagnosis looked at the loop's
    models and found no repeated blocks to wrap (None: it found some, or could not look)."""
    stage = _main_stage(run)
    owners = stage.facts.script.owners if stage is not None and stage.facts.script else None
    if owners is None or not owners.models_looked or owners.blocks is not None:
        return None
    return (f"the {owners.models_looked} model(s) the training loop holds have no repeated "
            "blocks to checkpoint (an nn.ModuleList or nn.Sequential of two or more "
            "submodules of one class)")


# What a remedy needs of the diagnosed run beyond a finding that calls for it: why not, or None.
PRECONDITIONS: dict[str, Callable[[RunResult], str | None]] = {
    LARGER_BATCH: _no_larger_batch, "activation-checkpointing": _no_blocks}


def _why_not_tried(remedy: Remedy, run: RunResult) -> str | None:
    """Why a remedy a finding calls for is not tried on `run` (None: it is)."""
    if remedy.cuda_only and not run.env.device.startswith("cuda"):
        return "acts on a GPU only, the run had none"
    needs = PRECONDITIONS.get(remedy.name)
    return needs(run) if needs is not None else None


def plan_fixes(run: RunResult, forced: list[str] | None = None) -> FixPlan:
    """Remedies for the run's warning- and critical-level findings (and any `forced` by name),
    without those that only act on a GPU when the run had none, nor a larger batch where the
    headroom or the training DataLoader does not allow one."""
    plan = FixPlan()
    wanted: dict[str, Remedy] = {name: REMEDIES[name] for name in forced or []}
    for finding in (f for f in run.findings if f.severity != "info"):
        remedies = remedies_for(finding.id)
        if "remedy" in finding.evidence and finding.evidence["remedy"] is None:
            # The finding saw nothing its remedies can change (GD107: the script's profiler).
            plan.skipped += [f"{r.name}: {finding.id} saw nothing it turns off" for r in remedies
                             if r.name not in wanted]
            remedies = [r for r in remedies if r.name in wanted]
        skipped = {r.name: why for r in remedies if r.name not in wanted
                   and (why := _why_not_tried(r, run)) is not None}
        plan.skipped += [line for name, why in skipped.items()
                         if (line := f"{name}: {why}") not in plan.skipped]
        tried = [r for r in remedies if r.name not in skipped]
        if not tried and finding.id in NO_REMEDY:
            plan.untreated.append(_untreated(finding))
        for remedy in tried:
            wanted.setdefault(remedy.name, remedy)
    plan.remedies = list(wanted.values())
    if LARGER_BATCH in wanted:
        loader = training_loader(run)
        plan.batch_factor = batch_factor(_headroom(run)) or MIN_BATCH_FACTOR
        plan.batch_site = loader.site if loader is not None else None
    return plan


def _untreated(finding: Finding) -> MeasuredFix:
    return MeasuredFix(remedy="none", title=finding.title, findings=[finding.id],
                       status="no-remedy", change=finding.fix, location=finding.location,
                       note=f"no safe automatic remedy: {NO_REMEDY[finding.id]}")


def measured_fix(remedy: Remedy | None, names: list[str], before: RunResult,
                 after: RunResult, baseline_losses: list[float], run: RunResult) -> MeasuredFix:
    """What `after` (the script with the remedies `names`) bought against `before` (the same
    schedule without them); the equivalence check holds `after`'s first losses against
    `baseline_losses` (the diagnosis run), with `before`'s own difference as the floor."""
    fix = _fix_of(remedy, names, run)
    a, b = _main_stage(before), _main_stage(after)
    _measured_memory(fix, a, b)
    if remedy is not None and remedy.frees_memory and fix.before_oom_step is not None \
            and b is not None and b.iter_ms:
        return _fitted(fix, names, b, baseline_losses, run)
    if a is None or b is None or not a.iter_ms or not b.iter_ms:
        fix.status = "failed"
        fix.note = (_why_not_measured(after, b, "the script with this fix")
                    if b is None or not b.iter_ms else
                    _why_not_measured(before, a, "the script without fixes"))
        return fix
    _seen_by(fix, names, b)
    # The mean step: what a run's length is made of. A median would not see a save every N
    # steps, the very cost a background save removes.
    fix.before_ms = statistics.fmean(steady_state(a.iter_ms))
    fix.after_ms = statistics.fmean(steady_state(b.iter_ms))
    fix.speedup = fix.before_ms / fix.after_ms
    estimate = estimate_ratio(_step_samples(a), _step_samples(b),
                              floor_for((before, after), a.name, "wall"), FIX_ALPHA)
    if estimate is not None:
        fix.speedup_low, fix.speedup_high = estimate.low, estimate.high
    fix.before_j_per_step, fix.after_j_per_step = _energy_per_step(a), _energy_per_step(b)
    if (fix.before_j_per_step is None) != (fix.after_j_per_step is None):
        fix.before_j_per_step = fix.after_j_per_step = None
    no_effect = fix.evidence.unchanged(names)
    fix.changed_nothing = no_effect is not None and remedy is not None  # one, not several
    fix.note = no_effect or _queued_saves(fix.evidence)
    fix.change = _switched_off(fix.evidence) or fix.change
    _measured_loader_change(fix)
    _per_sample(fix, (a, b), run)
    _check_losses(fix, names, run, baseline_losses, (_losses(a), _losses(b)))
    return fix


def _seen_by(fix: MeasuredFix, names: Sequence[str], after: StageResult) -> None:
    """What the run with the fix saw of it (its remedies' records), and the script's line they
    acted on where one did."""
    fix.evidence = after.facts.script.remedies if after.facts.script else RemedyEvidence()
    fix.location = fix.evidence.site(names) or fix.location


def _peak_and_oom(stage: StageResult | None) -> tuple[float | None, int | None]:
    """The allocator's peak over a run's steps (CUDA), and the step it died of out-of-memory
    at (None: it did not)."""
    script = stage.facts.script if stage is not None else None
    memory = script.memory if script is not None else None
    if memory is None:
        return None, None
    peak = max(memory.peak_mib, default=None) if memory.device == "cuda" else None
    return peak, memory.oom.step if memory.oom is not None else None


def _measured_memory(fix: MeasuredFix, before: StageResult | None,
                     after: StageResult | None) -> None:
    fix.before_peak_mib, fix.before_oom_step = _peak_and_oom(before)
    fix.after_peak_mib, fix.after_oom_step = _peak_and_oom(after)


def _fitted(fix: MeasuredFix, names: list[str], after: StageResult,
            baseline_losses: list[float], run: RunResult) -> MeasuredFix:
    """A fix that frees memory, where the script died of out-of-memory without it and ran its
    steps with it: what it bought is the run itself; its time cost cannot be measured (no
    step ran without it)."""
    _seen_by(fix, names, after)
    fix.after_ms = statistics.fmean(steady_state(after.iter_ms))
    no_effect = fix.evidence.unchanged(names)
    fix.changed_nothing = no_effect is not None
    fix.note = no_effect or (
        f"without it the script died of out-of-memory at step {fix.before_oom_step}; with it, "
        f"it ran its {len(after.iter_ms)} timed steps: its time cost is not measured (no step "
        "ran without it)")
    _check_losses(fix, names, run, baseline_losses, ([], _losses(after)))
    return fix


def _check_losses(fix: MeasuredFix, names: Sequence[str], run: RunResult,
                  baseline_losses: list[float], runs: tuple[list[float], list[float]]) -> None:
    """The equivalence of `fix` (remedies `names`): the first losses of the runs without and
    with it (`runs`) against the diagnosis run's, over what the remedies leave comparable."""
    repeat, fixed = runs
    compared = _first_pass(run) if any(REMEDIES[n].reorders for n in names) else None
    if compared is not None:
        fix.note = _joined(fix.note, (
            f"losses compared over the training DataLoader's first pass ({compared} steps): "
            "workers kept across passes draw its shuffle's seeds in another order after it"))
    fixed = fixed[:compared]
    tolerance = reordering_tolerance(_parameter_elements(run), len(fixed) - 1) \
        if any(REMEDIES[n].numerics == "reordered" for n in names) else 0.0
    fix.equivalence, fix.loss_gap, fix.loss_floor = equivalence(
        baseline_losses[:compared], repeat[:compared], fixed, _numerics(names), tolerance)
    if fix.equivalence == "same" and fix.loss_gap is not None and fix.loss_gap > max(
            EXACT_MIN_TOLERANCE, EXACT_FLOOR_FACTOR * (fix.loss_floor or 0.0)):
        fix.note = _joined(fix.note, (
            f"same within reordering: the losses differ by {fix.loss_gap:.2g}, within the "
            f"{tolerance:.2g} a reordered fp32 sum over the parameters may move them"))


def _joined(note: str, more: str) -> str:
    return "; ".join(filter(None, (note, more)))


def _numerics(names: Sequence[str]) -> Numerics:
    """What remedies `names` together may change: the recipe over precision over reordering
    over nothing."""
    kinds = {REMEDIES[n].numerics for n in names}
    return next((k for k in ("recipe", "precision", "reordered") if k in kinds), "exact")


def _per_sample(fix: MeasuredFix, stages: tuple[StageResult, StageResult],
                run: RunResult) -> None:
    """A larger batch's speedup in samples per second, not steps: its step takes longer, each
    sample less. The batches are the runs' own (the first batch each one's training DataLoader
    yielded), else the remedy's record; the note says both, and what the diagnosed step's
    headroom predicted: the peak at that batch (beside the one measured) and the largest
    batch that fits."""
    record = fix.evidence.larger_batch if fix.remedy == LARGER_BATCH else None
    if record is None or fix.speedup is None:
        return
    a, b = stages
    batches = (a.samples_per_step, b.samples_per_step) \
        if a.samples_per_step and b.samples_per_step else record.batches()
    if batches is None or not batches[0]:
        fix.note = _joined(fix.note, "no batch seen in either run: the speedup is per step")
        return
    ratio = batches[1] / batches[0]
    fix.speedup *= ratio
    if fix.speedup_low is not None and fix.speedup_high is not None:
        fix.speedup_low, fix.speedup_high = fix.speedup_low * ratio, fix.speedup_high * ratio
    room = _headroom(run)
    predicted = ""
    if room is not None:
        measured = (f", measured {fix.after_peak_mib / 1024:,.2f}"
                    if fix.after_peak_mib is not None else "")
        predicted = (f"; the headroom predicted a peak of {room.peak_at(ratio) / 2**30:,.2f} GiB "
                     f"at that batch{measured}" + (
                         f", and a batch of up to ~{room.largest_batch:,} to fit"
                         if room.largest_batch else ""))
    fix.note = _joined(fix.note, (
        f"batch {batches[0]:,} -> {batches[1]:,} a step"
        + (f", from the DataLoader at {record.site}" if record.site else "") + predicted
        + f"; its step takes {fix.after_ms or 0:,.2f} ms against {fix.before_ms or 0:,.2f}: "
        f"the speedup is in samples per second ({1e3 * batches[0] / (fix.before_ms or 1):,.0f}"
        f" -> {1e3 * batches[1] / (fix.after_ms or 1):,.0f})"))


def _parameter_elements(run: RunResult) -> int:
    """The elements of every parameter the diagnosed run's optimizers step (0: none seen)."""
    stage = _main_stage(run)
    script = stage.facts.script if stage is not None else None
    return sum(o.numel for o in script.optimizers) if script else 0


def reordering_tolerance(elements: int, steps: int) -> float:
    """How far a reordered remedy may move the first losses after `steps` optimizer steps
    over `elements` parameter elements: FP32_EPSILON x sqrt(elements) x steps, at most
    MAX_REORDER_GAP."""
    return min(FP32_EPSILON * math.sqrt(max(elements, 1)) * max(steps, 0), MAX_REORDER_GAP)


def _first_pass(run: RunResult) -> int | None:
    """Steps in the first pass over the diagnosed run's training DataLoader; None where its
    passes were not recorded (runs of earlier versions): every loss is compared then."""
    stage = _main_stage(run)
    loaders = stage.facts.script.loaders if stage is not None and stage.facts.script else []
    return next((use.epochs[0].batches for use in loaders if use.training and use.epochs),
                None)


def _fix_of(remedy: Remedy | None, names: Sequence[str], run: RunResult) -> MeasuredFix:
    """The row of one remedy (`remedy`) or of several together (`names`), before measuring."""
    return MeasuredFix(
        remedy=remedy.name if remedy else "combined",
        title=remedy.title if remedy else " + ".join(REMEDIES[n].title for n in names),
        findings=sorted({f.id for f in run.findings for n in names
                         if f.id in REMEDIES[n].findings}),
        applied=remedy.applied if remedy else "; ".join(REMEDIES[n].applied for n in names),
        change=remedy.change if remedy else "the changes of each fix above",
        location=_location(run, list(names)))


def not_measured(names: Sequence[str], run: RunResult) -> MeasuredFix:
    """A remedy (or a combination) planned but left unmeasured by a stop."""
    fix = _fix_of(REMEDIES[names[0]] if len(names) == 1 else None, names, run)
    fix.status, fix.note = "not-measured", "not measured: interrupted"
    return fix


def assess(run: RunResult, plan: FixPlan, runs: dict[str, RunResult],
           unmeasured: Sequence[Sequence[str]] = ()) -> list[MeasuredFix]:
    """Every fix measured in `runs` (by label: the runs without fixes, each remedy's name, and
    "combined"), against the baseline the runs without fixes bracket; ranked, with those a
    stop left `unmeasured` (each remedy's names) and the findings no remedy answers."""
    stopped = [not_measured(names, run) for names in unmeasured]
    baselines = [runs[label] for label in BASELINE_RUNS if label in runs]
    if not baselines:
        return ranked(stopped + plan.untreated)
    before = bracketed(baselines[0], baselines[-1])
    first = [s for s in run.stages if s.facts.script]
    losses = first[0].facts.script.losses if first and first[0].facts.script else []
    fixes = [measured_fix(r, [r.name], before, runs[r.name], losses, run)
             for r in plan.remedies if r.name in runs]
    if COMBINED_RUN in runs:
        names = _combined(runs[COMBINED_RUN])
        fixes.append(measured_fix(None, names, before, runs[COMBINED_RUN], losses, run))
    return ranked(fixes + stopped + plan.untreated)


def _combined(kept: RunResult) -> list[str]:
    """The remedies the combined run's script applied, in the order the run was given them
    (a config of schema 2 and before has no remedies: in REMEDIES' order)."""
    stage = _main_stage(kept)
    seen = stage.facts.script.remedies if stage and stage.facts.script else RemedyEvidence()
    given = kept.config.remedies if isinstance(kept.config, ProfileConfig) else ()
    return [name for name in given or seen.applied if seen.record(name) is not None]


def reassess(run: RunResult, runs: dict[str, RunResult]) -> list[MeasuredFix]:
    """The fixes of a recorded --try-fixes again, from its kept runs (`gpudiag report --rules`
    on its directory): what this gpudiag makes of the same measurements. A run a stop cut
    short measured nothing, as when it was made; a remedy the stop kept from running at all
    is known from the run's own rows."""
    plan = plan_fixes(run)
    finished = {label: kept for label, kept in runs.items() if not kept.interrupted}
    plan.remedies = [REMEDIES[label] for label in finished if label in REMEDIES]
    unmeasured = [kept.config.remedies for kept in runs.values() if kept.interrupted
                  and isinstance(kept.config, ProfileConfig) and kept.config.remedies]
    unmeasured += [(f.remedy,) for f in run.fixes if f.status == "not-measured"
                   and f.remedy in REMEDIES and f.remedy not in runs]
    return assess(run, plan, finished, unmeasured)


def bracketed(first: RunResult, last: RunResult) -> RunResult:
    """One baseline from the runs without fixes before and after the fixes' runs: each one's
    steady steps, in order (blocks of each stay within one process), and the losses of the
    first (both start from the same seed)."""
    a, b = _main_stage(first), _main_stage(last)
    if a is None or b is None or not a.iter_ms or not b.iter_ms:
        return first if a is not None and a.iter_ms else last
    merged = copy.deepcopy(first)
    stage = _main_stage(merged)
    assert stage is not None
    stage.iter_ms = steady_state(a.iter_ms) + steady_state(b.iter_ms)
    energies = [e for e in (_energy_per_step(a), _energy_per_step(b)) if e is not None]
    stage.telemetry = dataclasses.replace(
        stage.telemetry, energy_j=statistics.fmean(energies) * len(stage.iter_ms)
        if len(energies) == 2 else None)
    return merged


def equivalence(baseline: list[float], repeat: list[float], fixed: list[float],
                numerics: Numerics, reorder_tolerance: float = 0.0,
                ) -> tuple[Equivalence, float | None, float | None]:
    """(verdict, gap, floor): the largest relative difference of the fixed run's first losses
    from the baseline's, and of a second run without the fix (the floor). "unchecked" with a
    floor: the runs without the fix already differ too much to tell. A "reordered" remedy is
    "same" within `reorder_tolerance` (reordering_tolerance) too; a "recipe" remedy is
    always "recipe": it trains something else, whatever its first losses."""
    gap = _largest_difference(baseline, fixed)
    if numerics == "recipe":
        return "recipe", gap, _largest_difference(baseline, repeat)
    if gap is None:
        return "unchecked", None, None
    floor = _largest_difference(baseline, repeat) or 0.0
    if floor > MAX_LOSS_FLOOR:
        return "unchecked", gap, floor
    allowed = reorder_tolerance if numerics == "reordered" else 0.0
    if gap <= max(EXACT_MIN_TOLERANCE, EXACT_FLOOR_FACTOR * floor, allowed):
        return "same", gap, floor
    if numerics == "precision" and gap <= PRECISION_GAP:
        return "mixed-precision", gap, floor
    return "differs", gap, floor


def _largest_difference(a: list[float], b: list[float]) -> float | None:
    pairs = list(zip(a, b, strict=False))
    if not pairs:
        return None
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in pairs)


def passing(fixes: list[MeasuredFix]) -> list[str]:
    """Remedies worth combining: measured faster (the interval above 1 where there is one)
    and computing the same thing, or what mixed precision changes (never a larger batch's
    other recipe: its speedup is in samples, and the others' are held against its step)."""
    return [f.remedy for f in fixes
            if f.status == "measured" and f.remedy in REMEDIES and f.speedup is not None
            and not REMEDIES[f.remedy].frees_memory  # its time is a cost, not a saving
            and not f.changed_nothing
            and (f.speedup_low if f.speedup_low is not None else f.speedup) > 1.0
            and f.equivalence in ("same", "mixed-precision")]


def ranked(fixes: list[MeasuredFix]) -> list[MeasuredFix]:
    """Measured fixes fastest first (those that changed nothing after them), then failed ones,
    those a stop left unmeasured, then findings with no remedy."""
    order = {"measured": 0, "failed": 1, "not-measured": 2, "no-remedy": 3}
    return sorted(fixes, key=lambda f: (order[f.status], f.changed_nothing,
                                        -(f.speedup or 0.0)))


def _main_stage(run: RunResult) -> StageResult | None:
    """The script's stage (the first rank's in a multi-process job)."""
    return min(run.stages, key=lambda s: s.name) if run.stages else None


def _step_samples(stage: StageResult) -> StageSamples:
    """Steps per second of consecutive blocks of steady steps, each block's mean (a profiled
    script may not say its batch size, and a block's mean keeps its periodic saves)."""
    steady = steady_state(stage.iter_ms)
    blocks = [steady[i:i + BLOCK_STEPS] for i in range(0, len(steady) - BLOCK_STEPS + 1,
                                                       BLOCK_STEPS)]
    return StageSamples(scores=[1e3 / statistics.fmean(b) for b in blocks], kind="blocks",
                        invalid=0, iters=len(steady))


def _energy_per_step(stage: StageResult) -> float | None:
    """Energy per timed step, where the timed window was long enough to measure it."""
    t = stage.telemetry
    if t.energy_j is None or not stage.iter_ms or (t.window_s or 0) < MIN_ENERGY_WINDOW_S:
        return None
    return t.energy_j / len(stage.iter_ms)


def _losses(stage: StageResult) -> list[float]:
    return list(stage.facts.script.losses) if stage.facts.script else []


def _location(run: RunResult, names: list[str]) -> str | None:
    """The line the permanent change goes to: the finding's own location, when it has one."""
    for finding in run.findings:
        if finding.location and any(finding.id in REMEDIES[n].findings for n in names):
            return finding.location
    return None


def _switched_off(evidence: RemedyEvidence) -> str | None:
    """The tf32 remedy found the script switching TF32 off itself: that line is the change."""
    kept = evidence.tf32.kept_on if evidence.tf32 is not None else []
    if not kept:
        return None
    others = ", ".join(str(k.site) for k in kept[1:])
    return (f"the script switches TF32 off here (`{kept[0].set}`"
            + (f"; also at {others}" if others else "") + "): delete that, or set it to True")


def _measured_loader_change(fix: MeasuredFix) -> None:
    """A loader remedy's change: the settings its run measured (not the catalog's), in the
    terms of the framework that built the loader, at the line where the script sets them."""
    record = fix.evidence.record(fix.remedy) if fix.remedy in ("loader",
                                                                "persistent-workers") else None
    if not isinstance(record, LoaderRecord):
        return
    recorded = loader_change(record.loaders)
    if recorded is not None:
        fix.change, fix.location = recorded.change, recorded.location or fix.location
    high = fix.speedup_high if fix.speedup_high is not None else fix.speedup
    if fix.remedy == "loader" and recorded is not None and fix.speedup is not None \
            and high is not None and high < 1.0:
        fix.note = _joined(fix.note, slower_workers(record.loaders, fix.speedup))


QUEUED_SAVE_MS = 10.0  # a background save that waits this long for the previous one queues


def _queued_saves(evidence: RemedyEvidence) -> str:
    """Why background saves bought less than they could: each waited for the one before."""
    if evidence.async_save is None or not evidence.async_save.saves:
        return ""
    count, waited = evidence.async_save.saves, evidence.async_save.waited_ms
    if waited / count < QUEUED_SAVE_MS:
        return ""
    return (f"each save waited {waited / count:.0f} ms on average for the one before it: "
            "saves start faster than they are written, so save less often (see "
            "checkpoint-async-contention)")


def _why_not_measured(kept: RunResult, stage: StageResult | None, who: str) -> str:
    """Why the run `who` names (with the fix, or the runs without) measured nothing."""
    # A write its confinement refused (a log in /tmp) failed that run: the fix's failure,
    # said so; the diagnosis stands.
    refused = next((r.wrote_outside[0] for r in kept.reruns if r.confined and r.wrote_outside),
                   None)
    if refused is not None and not kept.interrupted:
        return (f"failed: {who} was refused a write to {refused} (a run in a scratch copy may "
                "write only there)")
    if stage is not None and stage.error:
        return f"{who}: {stage.error}"
    if kept.interrupted:
        return "interrupted"
    return f"{who} recorded no timed steps"

