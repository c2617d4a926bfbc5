"""What bootstrap/sitecustomize.py calls in every Python process `gpudiag profile` starts: in a
re-run, the watch on writes outside its scratch copy first (standard library only, before torch
loads); then this interpreter's one Recorder (recorder.py), the patches that feed it (hooks.py)
and its exit, crash and signal handling (lifecycle.py). `gpudiag.step()` finds that Recorder
here, as RECORDER, without importing this module (a script that is not profiled never has it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from gpudiag.measure.profile.inscript import writewatch
from gpudiag.measure.profile.protocol import ENV_OUT, config_from_env

if TYPE_CHECKING:
    from gpudiag.measure.profile.inscript.recorder import Recorder

RECORDER: Recorder | None = None  # one per interpreter, found by gpudiag.step()


def install() -> Recorder:
    """Hook the running interpreter (idempotent)."""
    global RECORDER  # noqa: PLW0603  (one recorder per interpreter, found by gpudiag.step())
    if RECORDER is not None:
        return RECORDER
    writewatch.install()  # a re-run's only; before the recorder imports torch
    config = config_from_env(os.environ)
    # These import torch: after the write watch.
    from gpudiag.measure.profile.inscript import (  # noqa: PLC0415 (torch, after the watch)
        hooks,
        lifecycle,
        recorder,
        remedies,
    )

    if config.seed is not None:
        remedies.seed_everything(config.seed)
    made = RECORDER = recorder.Recorder(Path(os.environ[ENV_OUT]), config)
    hooks.install(made)
    lifecycle.install(made)
    return made
