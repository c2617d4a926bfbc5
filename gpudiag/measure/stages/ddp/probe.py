"""The link's all-reduce bandwidth, measured: what the gradients' transfer is held against."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from gpudiag.measure.timing import synchronize
from gpudiag.model.results import bus_bandwidth_factor

ALLREDUCE_MAX_BYTES = 256 * 2**20  # the probe's buffer: the gradients, at most this
PROBE_REPEATS = 5


def allreduce_probe(nbytes: int, device: torch.device) -> dict[str, Any] | None:
    """Bus bandwidth of an all-reduce of the gradients' size (capped): algorithm bandwidth
    bytes/time, times 2(n-1)/n for a ring, as nccl-tests report it."""
    world = dist.get_world_size()
    if world < 2:
        return None
    nbytes = max(4, min(nbytes, ALLREDUCE_MAX_BYTES))
    buffer = torch.ones(nbytes // 4, device=device)
    for _ in range(2):
        dist.all_reduce(buffer)
    synchronize(device)
    times = []
    for _ in range(PROBE_REPEATS):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    algbw = nbytes / seconds / 1e9
    return {"bytes": nbytes, "ms": seconds * 1e3, "algbw_gbps": algbw,
            "busbw_gbps": algbw * bus_bandwidth_factor(world)}

