"""The ddp stage: the fp16 training step under DistributedDataParallel, in its own processes.

launch.py starts the ranks with torch.distributed.run and merges their parts; worker.py is one
rank's program; probe.py measures the link's all-reduce bandwidth (also used by profile mode).
"""

from __future__ import annotations

from gpudiag.measure.stages.base import StageContext, launched_stage
from gpudiag.measure.stages.ddp.launch import run_ddp_stage
from gpudiag.model.results import StageResult

TITLE = "mixed-precision training under DDP, one process per device"


@launched_stage("ddp", TITLE)
def ddp(ctx: StageContext) -> StageResult:
    return run_ddp_stage(ctx.config, "ddp", TITLE)
