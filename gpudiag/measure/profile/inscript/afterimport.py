"""Patches made once a module is imported, wherever the import comes from: torch itself (the
recorder starts as the script imports it, install.py), and a framework a script may never use,
which should not be imported for gpudiag's patch of it (FSDP2's modules take ~1.5 s:
watches/fsdp.py). A hand-written post-import hook, as wrapt's register_post_import_hook: not
worth a dependency in every profiled process."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: for a module waited for, the spec the other finders give, its
    loader made to call back once the module has run."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        callbacks = self.waiting.pop(name, None)
        if callbacks is None:
            return None
        spec = importlib.util.find_spec(name)  # the other finders' (this one waits no more)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            for callback in callbacks:
                callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_after_import = _AfterImport()


def when_imported(names: Sequence[str], callback: Callable[[ModuleType], None]) -> None:
    """`callback(module)` for each of `names` now if imported, else right after its import."""
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
        else:
            _after_import.waiting.setdefault(name, []).append(callback)

