"""The ddp stage: the fp16 training step under DistributedDataParallel, in its own processes."""

from __future__ import annotations

from gpudiag.results import StageResult
from gpudiag.stages.base import StageContext, launched_stage

TITLE = "mixed-precision training under DDP, one process per device"


@launched_stage("ddp", TITLE)
def ddp(ctx: StageContext) -> StageResult:
    from gpudiag.distributed.launch import run_ddp_stage

    return run_ddp_stage(ctx.config, "ddp", TITLE)
