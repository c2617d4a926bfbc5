"""What an allocation that failed says: which allocator ran out (CUDA's caching allocator,
the CPU's), what was asked, what the device had, where the process was capped, and the
script's line that asked; read as the script dies of it (the memory watch's record, the
recorder's reason to write its stage even before a first step)."""

from __future__ import annotations

import re
from typing import Literal

import torch

from gpudiag.measure.evidence.source import call_site
from gpudiag.model.facts import OutOfMemory

_MIB = 1024 * 1024
_UNIT_MIB = {"GiB": 1024.0, "MiB": 1.0, "KiB": 1 / 1024, "B": 1 / _MIB, "bytes": 1 / _MIB}
_SIZE = r"([\d.]+) ?(GiB|MiB|KiB|bytes|B)\b"
_REQUESTED = re.compile(r"[Tt]ried to allocate " + _SIZE)
_FREE = re.compile(r"of which " + _SIZE + " is free")
_TOTAL = re.compile(r"total capacity of " + _SIZE)
CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"


def oom_device(exc: BaseException) -> Literal["cuda", "cpu"] | None:
    """Which allocator `exc` says ran out, or None for another error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return "cuda"
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError)
                                        and CPU_ALLOCATOR in str(exc)):
        return "cpu"
    return None


def _mib(pattern: re.Pattern[str], text: str) -> float | None:
    found = pattern.search(text)
    return float(found[1]) * _UNIT_MIB[found[2]] if found else None


def _raising_line(exc: BaseException) -> str | None:
    """The script's line whose call failed: from the innermost frame out, the first of the
    user's code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    site = call_site(tb.tb_frame) if tb is not None else None
    return site.location if site is not None else None


def out_of_memory(exc: BaseException, step: int) -> OutOfMemory | None:
    """What `exc` says of the allocation that failed, beside the allocator's own counters."""
    device = oom_device(exc)
    if device is None:
        return None
    text = str(exc)
    first = " ".join(re.split(r"(?<=\.) ", text.split("\n", maxsplit=1)[0])[:2])[:400]
    oom = OutOfMemory(device=device, step=step, message=first, line=_raising_line(exc),
                      requested_mib=_mib(_REQUESTED, text),
                      device_free_mib=_mib(_FREE, text), device_total_mib=_mib(_TOTAL, text))
    if device == "cuda" and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats_as_nested_dict()
        oom.allocated_mib = round(stats["allocated_bytes"]["all"]["current"] / _MIB, 1)
        oom.reserved_mib = round(stats["reserved_bytes"]["all"]["current"] / _MIB, 1)
        fraction = torch.cuda.get_per_process_memory_fraction()
        if fraction < 1.0 and oom.device_total_mib:
            oom.cap_mib = round(fraction * oom.device_total_mib, 1)
    return oom


