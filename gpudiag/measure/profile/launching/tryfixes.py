"""`gpudiag profile --try-fixes`: the runs. Each remedy the diagnosis calls for is one more run
of the script with it applied (gpudiag/measure/profile/inscript/remedies.py), between two runs
without any; then, when more than one paid, the ones that paid together. Which remedies, and
which of them paid, are gpudiag.diagnose.tryfix's to say: the caller passes both in, so that
measuring never imports diagnosing (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpudiag.measure.bytecode import shared_bytecode
from gpudiag.measure.confine import ConfinementPolicy
from gpudiag.measure.interrupts import signal_of
from gpudiag.measure.profile.launching.scratch import SCRATCH_DIR, ScratchError
from gpudiag.measure.profile.launching.session import (
    ProfileOutput,
    ProfileRequest,
    profile_command,
)
from gpudiag.model.atomic import own_folder
from gpudiag.model.config import ProfileConfig
from gpudiag.model.remedies import BASELINE_RUNS, COMBINED_RUN
from gpudiag.model.results import Rerun, RunResult

FIXES_DIR = "fixes"  # each run is kept in <run dir>/fixes/<label>/, run in its cwd/ there
SCRATCH_PATTERN = f"{FIXES_DIR}/<label>/{SCRATCH_DIR}"  # where each run's writes go


@dataclass
class FixRuns:
    """The runs made, by label (BASELINE_RUNS, a remedy's name, COMBINED_RUN); a stop keeps
    those finished, the command's exit code, and the remedies (alone, or the combination once
    its run began) it left unmeasured. Where each run ran (a stopped one's too), and why the
    runs ended early when a scratch copy could not be made."""

    runs: dict[str, RunResult] = field(default_factory=dict)
    interrupted: bool = False
    exit_code: int = 0
    unmeasured: list[tuple[str, ...]] = field(default_factory=list)
    reruns: list[Rerun] = field(default_factory=list)
    error: str | None = None


@shared_bytecode()  # its processes compile their modules once, not each
def run_fixes(run_dir: Path, diagnosed: ProfileConfig, remedies: Sequence[str], *,
              policy: ConfinementPolicy,
              paid: Callable[[dict[str, RunResult]], Sequence[str]],
              on_start: Callable[[str], None],
              on_done: Callable[[Path, ProfileOutput], None]) -> FixRuns:
    """Run the script once per remedy, on the schedule the diagnosis ended with (a short
    script's fitted one) and never re-run; without fixes first and last, so a machine that
    drifts meanwhile shows in the baseline's spread, not as a fix's effect. Each runs in a
    scratch copy of the working directory (fixes/<label>/cwd), so every run starts from the
    files the diagnosis run left and none changes the user's. `paid(runs)` names the remedies
    worth combining; `on_done` hears each run's output and its folder. `policy`: how the
    runs may write (confine.ConfinementPolicy)."""
    done = FixRuns()

    def measure(names: tuple[str, ...], label: str) -> bool:
        on_start(label)
        # The diagnosis run could write the run folder: a link it left at fixes/ or
        # fixes/<label>/ is replaced by gpudiag's own folder, never followed.
        out_dir = own_folder(own_folder(run_dir / FIXES_DIR) / label)
        config = dataclasses.replace(diagnosed, remedies=names)
        try:
            output = profile_command(ProfileRequest(config, out_dir, rerun=False, isolate=label,
                                                   policy=policy))
        except ScratchError as exc:
            done.error = str(exc)
            return False
        done.reruns += output.run.reruns
        on_done(out_dir, output)
        if output.run.interrupted:
            done.interrupted, done.exit_code = True, output.exit_code
            return False
        done.runs[label] = output.run
        return True

    plan: list[tuple[tuple[str, ...], str]] = [
        ((), BASELINE_RUNS[0]), *(((name,), name) for name in remedies), ((), BASELINE_RUNS[1])]
    try:
        if all(measure(names, label) for names, label in plan):
            together = tuple(paid(done.runs))
            if len(together) > 1:
                plan.append((together, COMBINED_RUN))
                measure(together, COMBINED_RUN)
    except KeyboardInterrupt as exc:  # between runs, where no child holds the signal
        done.interrupted, done.exit_code = True, 128 + signal_of(exc)
    if done.interrupted:
        done.unmeasured = [names for names, label in plan if names and label not in done.runs]
    return done
