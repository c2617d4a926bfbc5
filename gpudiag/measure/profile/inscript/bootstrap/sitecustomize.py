"""Loaded by every Python process `gpudiag profile` starts (this folder leads PYTHONPATH).

Installs gpudiag's recorder when GPUDIAG_PROFILE_OUT is set (in a re-run, first the watch on
writes outside its scratch copy), then runs the sitecustomize this one shadows, if there is one
further along the path."""

import importlib.machinery
import importlib.util
import os
import signal
import sys
from pathlib import Path


def _report_failure(exc: BaseException) -> None:
    """Tell the parent this interpreter could not load the recorder (it fails the profile with
    this line when no process recorded anything). Standard library only: file name as in
    protocol.py and keys as gpudiag.model.profilepart.BootstrapError's fields, spelled out
    here since gpudiag may be the very package that did not import."""
    import json  # noqa: PLC0415 (only on failure)

    out = Path(os.environ["GPUDIAG_PROFILE_OUT"])
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bootstrap-error-{os.getpid()}.json").write_text(json.dumps(
            {"python": sys.executable, "error": f"{type(exc).__name__}: {exc}"}))
    except OSError:
        pass


def _stop_as_python_does() -> None:
    """Ctrl-C while the interpreter starts (importing torch takes seconds): a KeyboardInterrupt
    out of sitecustomize ends the interpreter with "Fatal Python error: init_import_site" and a
    dump. End instead as Python ends on an uncaught KeyboardInterrupt: killed by SIGINT, quietly
    (exit 130 in a shell), before the script ran and with nothing recorded."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.raise_signal(signal.SIGINT)


if os.environ.get("GPUDIAG_PROFILE_OUT"):
    try:
        from gpudiag.measure.profile.inscript.install import install

        install()  # in a re-run the write watch first, then the recorder
    except KeyboardInterrupt:
        _stop_as_python_does()
    except Exception as exc:  # never break the user's program
        print(f"gpudiag profile: instrumentation not installed in {sys.executable} "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        _report_failure(exc)

_here = Path(__file__).resolve().parent
_rest = [p for p in sys.path if Path(p or ".").resolve() != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
