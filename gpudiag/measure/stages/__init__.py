"""Stages: registered by name (`@stage`, `@launched_stage`) in the modules of this package,
which are all imported here, as the rules are (gpudiag/diagnose/__init__.py): a new stage
module needs no list edited. The built-in ladder is the seed's diagnosis, in order."""

from __future__ import annotations

import importlib
import pkgutil

from gpudiag.measure.stages.base import (
    StageContext,
    StageDef,
    StageSkipped,
    Workload,
    registered_stages,
    stage,
)
from gpudiag.model.errors import BadInput

# The default `--stages`: the seed's ladder. Later stages (checkpoint, ddp, peak) are opt-in.
DEFAULT_LADDER: tuple[str, ...] = (
    "infer", "train", "train-fp16", "dataloader", "data-train", "full-loop", "full-vectorized",
)


def load_builtin_stages() -> None:
    """Import every stage module (and stage package, such as ddp/) of this package."""
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")


load_builtin_stages()


def stage_names() -> list[str]:
    """The ladder's stages in its order, then the opt-in ones."""
    names = [s.name for s in registered_stages()]
    return [*DEFAULT_LADDER, *(n for n in names if n not in DEFAULT_LADDER)]


def get_stage(name: str) -> StageDef:
    for definition in registered_stages():
        if definition.name == name:
            return definition
    raise BadInput(f"unknown stage {name!r} (known: {', '.join(stage_names())})")


__all__ = [
    "DEFAULT_LADDER", "StageContext", "StageDef", "StageSkipped", "Workload", "get_stage",
    "stage", "stage_names",
]
