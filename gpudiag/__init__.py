"""gpudiag: why is my GPU training slow? Measured answers, and a CI gate that keeps it fast.

The Python API, for notebooks and scripts:

    from gpudiag import build_config, run_stages, load_run
    config, notes = build_config(model="dgca", preset="tiny", device="cpu")
    output = run_stages(config, notes=notes)
    print(output.run.stage("full-loop").ms_per_iter)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gpudiag._version import __version__

if TYPE_CHECKING:
    from gpudiag.measure.models import ModelBundle, ModelOptions, ModelSpec, register_model
    from gpudiag.measure.plan import build_config
    from gpudiag.measure.runner import RunOutput, run_stages
    from gpudiag.model.config import RunConfig
    from gpudiag.model.results import Finding, RunResult, StageResult
    from gpudiag.model.runfile import load_run, save_run

# Names that pull in torch are imported on first use, so `import gpudiag` (and the CLI's
# --help) stays fast and reading a run.json works without torch. The results' too (pydantic, a
# second): `gpudiag`'s entry (launch.py) comes after this package's import, and sets how a
# SIGTERM or SIGHUP ends it first, before anything slow.
_LAZY = {
    "Finding": "gpudiag.model.results", "RunResult": "gpudiag.model.results",
    "StageResult": "gpudiag.model.results", "load_run": "gpudiag.model.runfile",
    "save_run": "gpudiag.model.runfile",
    "RunConfig": "gpudiag.measure.plan", "build_config": "gpudiag.measure.plan",
    "ModelBundle": "gpudiag.measure.models", "ModelOptions": "gpudiag.measure.models",
    "ModelSpec": "gpudiag.measure.models", "register_model": "gpudiag.measure.models",
    "RunOutput": "gpudiag.measure.runner", "run_stages": "gpudiag.measure.runner",
}


def step() -> None:
    """Mark the end of a training step for `gpudiag profile`, for loops without an optimizer
    (or with several). A no-op when the script is not being profiled."""
    # Installed by the profile bootstrap (gpudiag/measure/profile/inscript/install.py); looked
    # up, never imported: importing it would load torch into a script that is not profiled.
    installed = sys.modules.get("gpudiag.measure.profile.inscript.install")
    recorder = installed.recorder_for_a_step() if installed is not None else None
    if recorder is not None:
        recorder.manual_step()


@contextmanager
def watch() -> Iterator[None]:
    """`with gpudiag.watch():` around a loop body: the block's end is a step boundary."""
    yield
    step()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpudiag' has no attribute {name!r}")


__all__ = [
    "Finding", "ModelBundle", "ModelOptions", "ModelSpec", "RunConfig", "RunOutput",
    "RunResult", "StageResult", "__version__", "build_config", "load_run", "register_model",
    "run_stages", "save_run", "step", "watch",
]
