"""What bootstrap/sitecustomize.py calls in every Python process `gpudiag profile` starts: in a
re-run, the watch on writes outside its scratch copy first (standard library only); then, once
the script imports torch, this interpreter's one Recorder (recorder.py), the patches of its
watches (watches/) and its exit, crash and signal handling (lifecycle.py). `gpudiag.step()`
finds that Recorder here, as RECORDER, without importing this module (a script not profiled
never has it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from gpudiag.measure.profile.inscript import writewatch
from gpudiag.measure.profile.inscript.afterimport import when_imported
from gpudiag.measure.profile.protocol import ENV_OUT, bootstrap_error_name, config_from_env
from gpudiag.model.atomic import write_text_atomic
from gpudiag.model.profilepart import BootstrapError

if TYPE_CHECKING:
    from gpudiag.measure.profile.inscript.recorder import Recorder

RECORDER: Recorder | None = None  # one per interpreter, found by gpudiag.step()
# The hook that records a crash before torch loads, and the one it shadowed.
_EARLY_HOOK: tuple[Callable[..., None], Callable[..., None]] | None = None
_STARTING = False  # a recorder is being started (its imports may load torch)
# When install() ran, where step 0 begins; None once a start failed (said once, not retried).
_STARTED: float | None = None


def install() -> None:
    """Hook the running interpreter: a re-run's write watch now, the recorder once the script
    imports torch. Not before: what the script sets before its own `import torch` (its
    OMP_NUM_THREADS, which torch's OpenMP reads as it loads; allocator and logging settings)
    must be in effect as it is without gpudiag. A process that never imports torch (a shell
    launcher, a tokenizer worker) starts none, unless it marks a step (gpudiag.step()) or
    crashes, which are recorded as ever."""
    global _STARTED  # noqa: PLW0603  (the interpreter's start, for step 0)
    _STARTED = time.perf_counter()
    writewatch.install()  # a re-run's only; standard library, before anything imports torch
    when_imported(("torch",), lambda _torch: _start_recorder())
    _record_an_early_crash()


def _record_an_early_crash() -> None:
    """A script that fails before it imports torch (a bad argument, a folder it may not make)
    is recorded as one that fails later is: its error, the machine. The recorder is started
    as the exception ends the script (torch loads then) and the exception handed to it. A
    Ctrl-C there stays a Ctrl-C: nothing is loaded for it."""
    shadowed = sys.excepthook

    def crashed(kind: type[BaseException], value: BaseException,
                trace: TracebackType | None) -> None:
        if RECORDER is not None or issubclass(kind, KeyboardInterrupt):
            shadowed(kind, value, trace)
            return
        _start_recorder()
        if RECORDER is None:  # it could not start (said): the traceback as Python prints it
            shadowed(kind, value, trace)
            return
        sys.excepthook(kind, value, trace)  # the recorder's, over the one this shadowed

    global _EARLY_HOOK  # noqa: PLW0603  (undone by the recorder's start, below)
    _EARLY_HOOK = (crashed, shadowed)
    sys.excepthook = crashed


def recorder_for_a_step() -> Recorder | None:
    """The recorder `gpudiag.step()` marks a step on: started now where the script marks steps
    before it has imported torch (a loop of its own, torch imported later or by a library)."""
    _start_recorder()
    return RECORDER


def _start_recorder() -> None:
    """This interpreter's one recorder, started as torch finishes loading: inside the script's
    own `import torch`, which a failure here must not break (it is said, as the bootstrap says
    one, and the script runs on unrecorded)."""
    global _STARTING, _STARTED  # noqa: PLW0603  (one start at a time; one try, said once)
    # Started already, or failed; or started from a crash, and this is torch's import within.
    if RECORDER is not None or _STARTED is None or _STARTING:
        return
    _STARTING = True
    try:
        _recorder(_STARTED)
    except Exception as exc:
        _STARTED = None  # gpudiag.step() does not try again every step
        print(f"gpudiag profile: instrumentation not installed in {sys.executable} "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        with contextlib.suppress(OSError):
            out = Path(os.environ[ENV_OUT])
            out.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out / bootstrap_error_name(os.getpid()), json.dumps(
                dataclasses.asdict(BootstrapError(python=sys.executable,
                                                  error=f"{type(exc).__name__}: {exc}"))))
    finally:
        _STARTING = False


def _recorder(started: float) -> None:
    global RECORDER  # noqa: PLW0603  (one recorder per interpreter, found by gpudiag.step())
    if _EARLY_HOOK is not None and sys.excepthook is _EARLY_HOOK[0]:
        # The recorder's own crash hook goes over the one the early hook shadowed, which it
        # tells apart (Python's own: a Ctrl-C in one line, lifecycle.py).
        sys.excepthook = _EARLY_HOOK[1]
    config = config_from_env(os.environ)
    # These import torch, which has just loaded.
    from gpudiag.measure.profile.inscript import (  # noqa: PLC0415 (torch: once the script loads it)
        lifecycle,
        recorder,
        remedies,
    )

    if config.seed is not None:
        remedies.seed_everything(config.seed)
    made = RECORDER = recorder.Recorder(Path(os.environ[ENV_OUT]), config, started)
    made.install()
    lifecycle.install(made)
