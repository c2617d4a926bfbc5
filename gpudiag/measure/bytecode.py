"""Compiled bytecode shared between the fresh processes of one job (issue 39).

A gate, a calibration, `run --trials N` and `--try-fixes` start the same interpreter on the
same code several times. Each process compiles every module whose bytecode is not cached: where
the environment says not to write it (PYTHONDONTWRITEBYTECODE, set in many container images)
and the packages were installed without it (uv's default, `pip --no-compile`), every trial
compiles torch again: 6.3 s of an 18 s calibration trial on an H100 host, `import torch` alone
4.3-4.6 s a process, 1.7 s with its bytecode kept
(reports/examples/benchmarks/h100-calibrate-cost.json).

Such a job's processes then write their bytecode into a folder of gpudiag's own, named by
PYTHONPYCACHEPREFIX (https://docs.python.org/3/using/cmdline.html#envvar-PYTHONPYCACHEPREFIX:
bytecode is read and written only beneath it, never beside the sources), removed when the job
ends (after a SIGKILL, by the next job: ownedtemp.py): the first compiles, the others read.
Where torch's bytecode is cached already or will be, nothing changes (a prefix would make the
first process compile everything again). That is judged by the interpreter gpudiag runs
under: a command run by another one, whose bytecode is kept, compiles once into the folder.
What a process measures is unaffected: imports are never
inside a timed step.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from gpudiag.measure.ownedtemp import owned_folder, remove_stale

PREFIX = "PYTHONPYCACHEPREFIX"
DONT_WRITE = "PYTHONDONTWRITEBYTECODE"
# The package every measured process imports, whose bytecode stands for all of them.
PROBE = "torch"
# The kind of gpudiag's owned temporary folders (ownedtemp.py) holding a job's bytecode.
BYTECODE_FOLDERS = "bytecode"


def bytecode_is_kept(environ: Mapping[str, str], package: str = PROBE) -> bool:
    """Whether a fresh interpreter with `environ` finds `package`'s bytecode cached, or caches
    it where the next one will find it. True where it cannot tell (no such package)."""
    if environ.get(PREFIX):  # the user keeps bytecode somewhere of their own
        return True
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return True
    cached = Path(importlib.util.cache_from_source(spec.origin))
    if cached.is_file():
        return True
    if environ.get(DONT_WRITE):
        return False
    folder = cached.parent if cached.parent.is_dir() else cached.parent.parent
    return os.access(folder, os.W_OK)


@contextlib.contextmanager
def shared_bytecode() -> Iterator[Path | None]:
    """While it lasts, the processes gpudiag starts keep their bytecode in a temporary folder
    (yielded; removed at the end) where they would compile it each time; None where they keep
    it already. Sets this process's environment, which children inherit; restores it."""
    remove_stale(BYTECODE_FOLDERS)  # a killed job's (~100 MB), whatever this one needs
    if bytecode_is_kept(os.environ):
        yield None
        return
    saved = {name: os.environ.get(name) for name in (PREFIX, DONT_WRITE)}
    with owned_folder(BYTECODE_FOLDERS) as folder:
        os.environ[PREFIX] = str(folder)
        os.environ.pop(DONT_WRITE, None)  # written beneath the prefix only, never beside sources
        try:
            yield folder
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
