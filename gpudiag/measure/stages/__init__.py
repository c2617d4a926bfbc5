"""Stages: registered by name; the built-in ladder is the seed's diagnosis, in order."""

from __future__ import annotations

from gpudiag.measure.stages import checkpoint as _checkpoint  # noqa: F401  (registers its stages)
from gpudiag.measure.stages import ddp as _ddp  # noqa: F401  (registers the ddp stage)
from gpudiag.measure.stages import ladder as _ladder  # noqa: F401  (registers the built-in stages)
from gpudiag.measure.stages import peak as _peak  # noqa: F401  (registers the peak stage)
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


def stage_names() -> list[str]:
    return [s.name for s in registered_stages()]


def get_stage(name: str) -> StageDef:
    for definition in registered_stages():
        if definition.name == name:
            return definition
    raise BadInput(f"unknown stage {name!r} (known: {', '.join(stage_names())})")


__all__ = [
    "DEFAULT_LADDER", "StageContext", "StageDef", "StageSkipped", "Workload", "get_stage",
    "stage", "stage_names",
]
