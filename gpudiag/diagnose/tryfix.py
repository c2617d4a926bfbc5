"""`gpudiag profile --try-fixes`: which remedies a diagnosed run calls for, and what each one
bought when the script ran with it (step time with an interval, energy, equivalence).

Pure functions of recorded runs, like the rules: the runs themselves are made by
gpudiag/measure/profile (the remedies applied inside the script) and sequenced by the CLI.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from dataclasses import dataclass, field

from gpudiag.diagnose.compare import PROCESS_NOISE_FLOOR, estimate_ratio
from gpudiag.diagnose.trials import StageSamples, stage_samples, steady_state
from gpudiag.model.remedies import NO_REMEDY, REMEDIES, Remedy, remedies_for
from gpudiag.model.results import Finding, MeasuredFix, RunResult, StageResult

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


@dataclass
class FixPlan:
    """The remedies to measure, in order, and the findings no remedy can answer."""

    remedies: list[Remedy] = field(default_factory=list)
    untreated: list[MeasuredFix] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why a called-for remedy is not tried


def plan_fixes(run: RunResult, forced: list[str] | None = None) -> FixPlan:
    """Remedies for the run's warning- and critical-level findings (and any `forced` by name),
    without those that only act on a GPU when the run had none."""
    plan = FixPlan()
    on_gpu = run.env.device.startswith("cuda")
    wanted: dict[str, Remedy] = {name: REMEDIES[name] for name in forced or []}
    for finding in (f for f in run.findings if f.severity != "info"):
        remedies = remedies_for(finding.id)
        if not remedies and finding.id in NO_REMEDY:
            plan.untreated.append(_untreated(finding))
        for remedy in remedies:
            if remedy.cuda_only and not on_gpu and remedy.name not in wanted:
                plan.skipped.append(f"{remedy.name}: acts on a GPU only, the run had none")
                continue
            wanted.setdefault(remedy.name, remedy)
    plan.remedies = list(wanted.values())
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
    title = remedy.title if remedy else " + ".join(REMEDIES[n].title for n in names)
    fix = MeasuredFix(
        remedy=remedy.name if remedy else "combined", title=title,
        findings=sorted({f.id for f in run.findings for n in names
                         if f.id in REMEDIES[n].findings}),
        applied=remedy.applied if remedy else "; ".join(REMEDIES[n].applied for n in names),
        change=remedy.change if remedy else "the changes of each fix above",
        location=_location(run, names))
    a, b = _main_stage(before), _main_stage(after)
    if a is None or b is None or not a.iter_ms or not b.iter_ms:
        fix.status = "failed"
        fix.note = _why_not_measured(after, b)
        return fix
    fix.evidence = (b.facts.script.remedies if b.facts.script else {})
    fix.location = _site_seen(fix.evidence) or fix.location
    fix.before_ms, fix.after_ms = a.ms_per_iter, b.ms_per_iter
    fix.speedup = a.ms_per_iter / b.ms_per_iter if a.ms_per_iter and b.ms_per_iter else None
    estimate = estimate_ratio(_step_samples(a), _step_samples(b),
                              PROCESS_NOISE_FLOOR["cuda" if _on_gpu(before) else "cpu"],
                              FIX_ALPHA)
    if estimate is not None:
        fix.speedup_low, fix.speedup_high = estimate.low, estimate.high
    fix.before_j_per_step, fix.after_j_per_step = _energy_per_step(a), _energy_per_step(b)
    numerics = "precision" if any(REMEDIES[n].numerics == "precision" for n in names) else "exact"
    fix.equivalence, fix.loss_gap, fix.loss_floor = equivalence(
        baseline_losses, _losses(a), _losses(b), numerics)
    return fix


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
    stage.ms_per_iter = statistics.median(stage.iter_ms)
    energies = [e for e in (_energy_per_step(a), _energy_per_step(b)) if e is not None]
    stage.telemetry = dataclasses.replace(
        stage.telemetry, energy_j=statistics.fmean(energies) * len(stage.iter_ms)
        if len(energies) == 2 else None)
    return merged


def equivalence(baseline: list[float], repeat: list[float], fixed: list[float],
                numerics: str) -> tuple[str, float | None, float | None]:
    """(verdict, gap, floor): the largest relative difference of the fixed run's first losses
    from the baseline's, and of a second run without the fix (the floor)."""
    gap = _largest_difference(baseline, fixed)
    if gap is None:
        return "unchecked", None, None
    floor = _largest_difference(baseline, repeat) or 0.0
    if gap <= max(EXACT_MIN_TOLERANCE, EXACT_FLOOR_FACTOR * floor):
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
    and computing the same thing, or what mixed precision changes."""
    return [f.remedy for f in fixes
            if f.status == "measured" and f.remedy in REMEDIES and f.speedup is not None
            and (f.speedup_low if f.speedup_low is not None else f.speedup) > 1.0
            and f.equivalence in ("same", "mixed-precision")]


def ranked(fixes: list[MeasuredFix]) -> list[MeasuredFix]:
    """Measured fixes fastest first, then failed ones, then findings with no remedy."""
    order = {"measured": 0, "failed": 1, "no-remedy": 2}
    return sorted(fixes, key=lambda f: (order[f.status], -(f.speedup or 0.0)))


def _main_stage(run: RunResult) -> StageResult | None:
    """The script's stage (the first rank's in a multi-process job)."""
    return min(run.stages, key=lambda s: s.name) if run.stages else None


def _step_samples(stage: StageResult) -> StageSamples:
    # Steps per second in blocks of steady steps: a profiled script may not say its batch.
    return stage_samples(dataclasses.replace(stage, samples_per_step=1, trials=[]))


def _energy_per_step(stage: StageResult) -> float | None:
    energy = stage.telemetry.energy_j
    return energy / len(stage.iter_ms) if energy is not None and stage.iter_ms else None


def _losses(stage: StageResult) -> list[float]:
    return list(stage.facts.script.losses) if stage.facts.script else []


def _on_gpu(run: RunResult) -> bool:
    return run.env.device.startswith("cuda")


def _location(run: RunResult, names: list[str]) -> str | None:
    """The line the permanent change goes to: the finding's own location, when it has one."""
    for finding in run.findings:
        if finding.location and any(finding.id in REMEDIES[n].findings for n in names):
            return finding.location
    return None


def _site_seen(evidence: dict[str, dict[str, object]]) -> str | None:
    """The script's line a remedy acted on (a DataLoader built, a torch.save called)."""
    for seen in evidence.values():
        loaders = seen.get("loaders")
        if isinstance(loaders, list) and loaders and isinstance(loaders[0], dict):
            return loaders[0].get("site")  # type: ignore[return-value]
        if isinstance(seen.get("site"), str):
            return seen["site"]  # type: ignore[return-value]
    return None


def _why_not_measured(after: RunResult, stage: StageResult | None) -> str:
    if stage is not None and stage.error:
        return f"the script with this fix: {stage.error}"
    if after.interrupted:
        return "interrupted"
    return "the script with this fix recorded no timed steps"

