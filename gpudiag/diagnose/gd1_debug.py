"""Debug settings left on while the script trains, each named at the line (or variable) that
turned it on (gpudiag/measure/profile/inscript/watches/debug.py): anomaly detection,
CUDA_LAUNCH_BLOCKING, a profiler or emit_nvtx the script runs itself (GD107), deterministic
algorithms (GD108). What one costs is not in the run that has it on: its price is what
`--try-fixes` measured turning it off, or none."""

from __future__ import annotations

from collections.abc import Iterator

from gpudiag.diagnose.common import measured_saving, on_gpu, pct
from gpudiag.diagnose.ledger import NoPart
from gpudiag.diagnose.registry import Draft, Threshold, rule
from gpudiag.model.facts import DebugKind, DebugSetting
from gpudiag.model.results import RunResult, Severity, StageResult

MIN_MEASURED_SAVING = 0.05
# Turning them off saved a third of the step or more: the step's largest cause, critical (a
# third is where the optimizer's and the loop's rules call a cost the step's largest too).
CRITICAL_MEASURED_SAVING = 0.30
# Settings that act only on CUDA: on a CPU run they cost nothing worth a warning.
CUDA_ONLY: frozenset[DebugKind] = frozenset(
    {"launch-blocking", "cudnn-deterministic", "emit-nvtx", "deterministic-algorithms"})
DEBUG_KINDS: tuple[DebugKind, ...] = ("anomaly-detection", "launch-blocking", "profiler",
                                      "emit-nvtx")
DETERMINISM_KINDS: tuple[DebugKind, ...] = ("deterministic-algorithms", "cudnn-deterministic")
WHAT = {
    "anomaly-detection": "anomaly detection records every operator's stack and checks each "
                         "backward for NaNs",
    "launch-blocking": "every kernel launch waits for the kernel to finish",
    "profiler": "a profiler records every operator",
    "emit-nvtx": "every operator opens and closes an NVTX range",
    "deterministic-algorithms": "deterministic kernels, slower where a faster one is not "
                                "bit-reproducible (scatter-add, index_add, some convolutions)",
    "cudnn-deterministic": "cuDNN picks only its deterministic convolution algorithms",
}
UNDO = {
    "anomaly-detection": "delete it (keep it for a run that hunts a NaN)",
    "launch-blocking": "unset the variable",
    "profiler": "profile a few steps (a schedule), or none",
    "emit-nvtx": "delete it outside an Nsight Systems session",
    "deterministic-algorithms": "delete it unless the run must repeat bit for bit",
    "cudnn-deterministic": "delete it unless the run must repeat bit for bit",
}

THRESHOLDS = (
    Threshold("min_measured_saving", MIN_MEASURED_SAVING,
              "turning the settings off measured to save less than this is information only"),
    Threshold("critical_measured_saving", CRITICAL_MEASURED_SAVING,
              "turning them off measured to save this much of the step or more: critical"),
)
PRICE = NoPart("a setting slows every part of the step it touches; what it costs is what "
               "--try-fixes measured turning it off, not a part of this run's accounts")


def _on(stage: StageResult, kinds: tuple[DebugKind, ...]) -> list[DebugSetting]:
    script = stage.facts.script
    if script is None:
        return []
    return [d for d in script.debug if d.kind in kinds
            and (d.timed_steps_on > 0 or (script.timed == 0 and d.steps_on > 0))]


def _drafts(run: RunResult, kinds: tuple[DebugKind, ...], remedy: str) -> Iterator[Draft]:
    for stage in run.ok_stages():
        settings = _on(stage, kinds)
        if not settings:
            continue
        gpu = on_gpu(run, stage)
        acting = [d for d in settings if gpu or d.kind not in CUDA_ONLY]
        saving = measured_saving(run, remedy)
        severity: Severity = (
            "info" if not acting or (saving is not None and saving < MIN_MEASURED_SAVING)
            else "critical" if saving is not None and saving >= CRITICAL_MEASURED_SAVING
            else "warning")
        named = "; ".join(f"{d.set_by} at {d.site or 'the environment'}" for d in settings)
        price = (f"turning {'them' if len(settings) > 1 else 'it'} off measured "
                 f"{pct(saving)} faster (--try-fixes {remedy})" if saving is not None else
                 f"not priced: `gpudiag profile --try-fixes` measures turning it off ({remedy})"
                 if any(d.kind != "profiler" for d in settings) else
                 "not priced: no remedy turns the script's own profiler off for a run (the "
                 "script reads its results)")
        cpu_note = "" if acting == settings else \
            " (on a CPU run, a setting that acts on CUDA only costs nothing here)"
        yield Draft(
            severity=severity, stage=stage.name,
            location=next((d.site for d in settings if d.site), None),
            title=f"Left on while training: {named}; {price}{cpu_note}",
            impact=saving or 0.0,
            evidence={"settings": {d.kind: {"set_by": d.set_by, "site": d.site,
                                            "timed_steps_on": d.timed_steps_on,
                                            "steps_on": d.steps_on} for d in settings},
                      "measured_saving": saving,
                      # None: what it saw is the script's own profiler, which no remedy turns
                      # off (tryfix.plan_fixes then plans none).
                      "remedy": remedy if any(d.kind != "profiler" for d in settings) else None},
            fix=" ".join(f"{d.set_by} at {d.site or 'the environment'}: {WHAT[d.kind]}; "
                         f"{UNDO[d.kind]}." for d in settings))


@rule(
    "GD107", "debug-settings-left-on", concern="launch",
    summary="Anomaly detection, CUDA_LAUNCH_BLOCKING, a profiler or emit_nvtx left on while "
            "training.",
    why=("Debugging aids cost every step they are on for: anomaly detection records each "
         "operator's stack for backward and checks its outputs, CUDA_LAUNCH_BLOCKING=1 "
         "serialises host and device, a profiler or emit_nvtx records every operator. Left on "
         "after the bug is found, they slow training by tens of percent (torch's own docs: "
         "anomaly detection 'should be enabled only for debugging')."),
    fix=("Delete the line that turns the setting on (set_detect_anomaly(True), `with "
         "detect_anomaly()`, emit_nvtx(), a profiler around the whole loop), or unset "
         "CUDA_LAUNCH_BLOCKING; keep them for a debugging run."),
    prices=PRICE, thresholds=THRESHOLDS,
    references=("https://pytorch.org/docs/stable/autograd.html#anomaly-detection",
                "https://docs.pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution"),
)
def debug_settings_left_on(run: RunResult) -> Iterator[Draft]:
    """A profiled script's debug settings on during its timed steps, each at its line; a
    warning where one acts on the run's device, priced by --try-fixes' no-debug run."""
    yield from _drafts(run, DEBUG_KINDS, "no-debug")


@rule(
    "GD108", "deterministic-algorithms", concern="launch",
    summary="Deterministic algorithms are on while training.",
    why=("torch.use_deterministic_algorithms(True) and cudnn.deterministic = True make torch "
         "and cuDNN pick kernels that give the same bits every run: scatter-adds without "
         "atomics, the deterministic convolution algorithms; on a GPU these can be much "
         "slower. Reproducible runs need it; most training runs do not."),
    fix=("Delete torch.use_deterministic_algorithms(True) / torch.backends.cudnn.deterministic "
         "= True, or keep them only in a run that must repeat bit for bit."),
    prices=PRICE, thresholds=THRESHOLDS,
    references=("https://pytorch.org/docs/stable/notes/randomness.html",),
)
def deterministic_algorithms(run: RunResult) -> Iterator[Draft]:
    """A profiled script's deterministic algorithms on during its timed steps, at their line;
    a warning on a GPU only, priced by --try-fixes' nondeterministic run."""
    yield from _drafts(run, DETERMINISM_KINDS, "nondeterministic")
