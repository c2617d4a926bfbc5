"""Patches made once a module is imported, wherever the import comes from: FSDP2's modules
take ~1.5 s to import, and a script that never shards should not pay for gpudiag's patch of
them (the recorder's, hooks.py, and a remedy's, remedies.py). A hand-written post-import hook,
as wrapt's register_post_import_hook: not worth a dependency in every profiled process."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

# FSDP2's parameter group, one per fully_shard(...) call (torch 2.6 moved it from _composable).
FSDP_PARAM_GROUP_MODULES = ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                            "torch.distributed._composable.fsdp._fsdp_param_group")


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


def when_fsdp_imported(callback: Callable[[type], None]) -> None:
    """`callback(FSDPParamGroup)` once FSDP2 is imported, under whichever name this torch has
    it (each class once, where both modules hold it)."""
    seen: set[int] = set()

    def found(module: ModuleType) -> None:
        group = getattr(module, "FSDPParamGroup", None)
        if isinstance(group, type) and id(group) not in seen:
            seen.add(id(group))
            callback(group)

    when_imported(FSDP_PARAM_GROUP_MODULES, found)
