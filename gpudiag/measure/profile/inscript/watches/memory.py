"""The script's memory at each step's end: on CUDA the caching allocator's counters (bytes held
by tensors, bytes reserved from the driver, the highest held so far), on any device the
process's resident set. Cheap enough for every step (the allocator's counters as it keeps them
and one read of /proc/self/statm: ~20 us a step on an H200's host; where a cgroup limits the
host's memory, one read of its memory.stat, ~30 us), so growth shows over the whole run, not
only the profiler window. Never changes what the script can read: the
allocator's peak is not reset (a script or its framework may report it).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from gpudiag.measure.hostmemory import CgroupUsage, host_limit, oom_kills, private_mib
from gpudiag.measure.profile.inscript.outofmemory import out_of_memory
from gpudiag.measure.profile.inscript.timeline import TIMELINE_STEPS
from gpudiag.measure.profile.inscript.watches import StageDraft, StepClock, Watch
from gpudiag.model.facts import MemoryTimeline, OutOfMemory, PrivateMemory

_MIB = 1024 * 1024
# The memory reads of a step end (the allocator's counters, the resident sets' preads, a
# cgroup's memory.stat) take at most this share of the script's recent steps (issue 57: "the
# per-step counters within 1% of the plain step"); on shorter steps they are made every few
# steps (up to MAX_STRIDE), the steps between repeating the last read, said in the timeline's
# note. A read costs the step more than its own time: on the H200's host one pread of 2.8 us
# cost a 1.56 ms step 20-33 us, and all of them 55 us (each call into the kernel slows the
# Python that follows; benchmarks/memory_watch_overhead.py, reports/examples/h200-memory-fixes),
# so each read is taken to cost READ_COST_S at least: read every step from ~6 ms steps up.
READ_COST_S = 60e-6
READ_BUDGET, MAX_STRIDE, STRIDE_STEPS = 0.01, 32, 9
# Near the host's limit the part is written again at each step boundary where the processes
# hold this much more of it than at the last write: a kernel's out-of-memory kill (SIGKILL,
# no Python shutdown) then loses only the steps since (tens of ms a write, only there).
KEEP_FROM_SHARE, KEEP_EVERY_SHARE = 0.5, 0.05
_STATM = Path("/proc/self/statm")
CPU_NOTE = ("on a CPU torch's allocator keeps no count of its own: the process's resident set "
            "stands in (it holds Python's and every library's memory too)")


def _open_statm() -> int | None:
    try:
        return os.open(_STATM, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


_PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / _MIB if hasattr(os, "sysconf") else 4096 / _MIB


def resident_mib(statm: int | None) -> float:
    """The process's resident set now, from `statm` held open (Linux: a pread of a few
    microseconds), or its highest so far where only that is known (getrusage: KiB on Linux,
    bytes on macOS)."""
    if statm is not None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int(os.pread(statm, 128, 0).split()[1]) * _PAGE_MIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / _MIB if sys.platform == "darwin" else peak / 1024


def _children_file() -> Path | None:
    """The main thread's children (DataLoader workers fork from it), where the kernel lists
    them (CONFIG_PROC_CHILDREN)."""
    path = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return path if path.exists() else None


def _open(path: Path | str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class ChildrenReader:
    """The script's child processes and their resident sets, read at each step's end from
    files held open (a pread each: ~2 us, where opening them by path each step cost ~70 us
    with four workers on the 2-core VM): the children list, and each child's statm from the
    step it appears until it is gone."""

    def __init__(self, children: Path) -> None:
        self.children = children
        self.listing = _open(children)
        self.statm: dict[bytes, int | None] = {}  # pid -> its statm held open

    def pids(self) -> list[str]:
        if self.listing is None:
            return []
        try:
            return os.pread(self.listing, 65536, 0).decode().split()
        except OSError:
            return []

    def resident(self) -> tuple[int, float]:
        """(how many children, their resident sets' sum in MiB) now."""
        pids = [pid.encode() for pid in self.pids()]
        for gone in set(self.statm) - set(pids):
            fd = self.statm.pop(gone)
            if fd is not None:
                os.close(fd)
        total = 0.0
        for pid in pids:
            if pid not in self.statm:
                self.statm[pid] = _open(f"/proc/{pid.decode()}/statm")
            fd = self.statm[pid]
            if fd is not None:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int(os.pread(fd, 128, 0).split()[1]) * _PAGE_MIB
        return len(pids), total


def _pinned_host_mib() -> float | None:
    """Page-locked host memory at its highest (CUDA's host allocator: pinned batches, the
    DataLoader's pin_memory thread)."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    peak = stats.get("allocated_bytes.all.peak", stats.get("allocated_bytes.peak"))
    return round(peak / _MIB, 1) if isinstance(peak, (int, float)) else None


def _host_total_mib() -> float | None:
    try:
        return round(os.sysconf("SC_PHYS_PAGES") * _PAGE_MIB, 1)
    except (ValueError, OSError, AttributeError):
        return None


# torch's out-of-memory messages: CUDA's "Tried to allocate 2.00 GiB. GPU 0 has a total
# capacity of 79.11 GiB of which 1.38 GiB is free. ..." (c10/cuda/CUDACachingAllocator.cpp);
# the CPU allocator's "DefaultCPUAllocator: can't allocate memory: you tried to allocate
# 1125899906842624 bytes" (c10/core/impl/alloc_cpu.cpp).
WORKER_KILLED = "killed by signal: Killed"  # torch's DataLoader, a worker's SIGKILL


def worker_killed(exc: BaseException) -> bool:
    """Whether `exc` says a DataLoader worker died of SIGKILL: "DataLoader worker (pid 123) is
    killed by signal: Killed.", raised as it is or as the cause of "... exited unexpectedly"."""
    seen: BaseException | None = exc
    for _ in range(4):  # the error, and the few it was raised from
        if seen is None:
            return False
        if isinstance(seen, RuntimeError) and WORKER_KILLED in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class MemoryWatch(Watch):
    """Each step's memory, read at its boundary."""

    label = "memory"

    def __init__(self, clock: StepClock) -> None:
        super().__init__(clock)
        self.allocated: list[float] = []
        self.reserved: list[float] = []
        self.peak: list[float] = []
        self.mallocs: list[int] = []  # cudaMalloc calls so far, at each step's end
        self.blocks: list[int] = []  # live allocations at each step's end
        self.oom: OutOfMemory | None = None
        children = _children_file()
        self.child_reader = ChildrenReader(children) if children is not None else None
        self.children: list[int] = []  # child processes at each step's end
        self.children_held: list[float] = []  # their resident sets' sum, MiB
        self.resident: list[float] = []
        self.cuda = False
        self.statm = _open_statm()
        self.host_limit = host_limit()  # the cgroup's or the machine's, as the script starts
        self.kept_at_mib = 0.0  # what the processes held when a part was last asked for
        self.worker_killed = False  # a DataLoader worker died of SIGKILL (torch's error said)
        self.usage = CgroupUsage(self.host_limit) if self.host_limit is not None else None
        self.used: list[float] = []  # the limiting cgroup's anonymous memory, each step's end
        self.private: PrivateMemory | None = None  # near the limit: the processes' own pages
        self.read_s: list[float] = []  # what each costly read took, seconds
        self.read_every = 1  # the longest stride the costly reads took
        self.stride = 0  # the costly reads' stride now (0: not worked out yet)
        self.read_at: list[int] = []  # the steps read

    def step_ended(self) -> None:
        if len(self.resident) >= TIMELINE_STEPS:
            return
        # CUDA in use: the allocator has been initialised by the script (reading it otherwise
        # would initialise CUDA in a CPU script's process).
        if not self.cuda and torch.cuda.is_available() and torch.cuda.is_initialized() \
                and torch.cuda.memory_reserved() > 0:
            self._cuda_from_now()
        fresh = not self.resident or len(self.resident) % self._stride() == 0
        if not fresh:  # between reads: the last read again, no call into the kernel
            for series in (self.allocated, self.reserved, self.peak, self.mallocs, self.blocks,
                           self.used, self.resident, self.children, self.children_held):
                if series:
                    series.append(series[-1])  # type: ignore[arg-type]  # each its own type
            return
        started = time.perf_counter()
        self.read_at.append(len(self.resident))
        if self.cuda:
            self._read_allocator()
        used = self.usage.mib() if self.usage is not None else None
        if used is not None:
            self.used.append(used)
        self.resident.append(round(resident_mib(self.statm), 1))
        if self.child_reader is not None:
            count, held = self.child_reader.resident()
            self.children.append(count)
            self.children_held.append(round(held, 1))
        self.read_s.append(time.perf_counter() - started)

    def _read_allocator(self) -> None:
        """The allocator's counters as it keeps them (one call: 13-27 us on an H200's host;
        torch.cuda.memory_allocated() flattens them all first: 105 us each,
        reports/examples/h200-memory)."""
        stats = torch.cuda.memory_stats_as_nested_dict()
        self.allocated.append(round(stats["allocated_bytes"]["all"]["current"] / _MIB, 1))
        self.reserved.append(round(stats["reserved_bytes"]["all"]["current"] / _MIB, 1))
        self.peak.append(round(stats["allocated_bytes"]["all"]["peak"] / _MIB, 1))
        self.mallocs.append(int(stats.get("num_device_alloc", 0)))
        self.blocks.append(int(stats["allocation"]["all"]["current"]))

    def _stride(self) -> int:
        """Every how many steps the reads keep within READ_BUDGET of the script's recent steps
        (each costing what it took, at least READ_COST_S): worked out again every STRIDE_STEPS
        steps (two medians: a few us, not every step's)."""
        marks = self.clock.host_marks
        limit = self.host_limit.limit_mib if self.host_limit is not None else None
        if len(marks) < 3 or not self.read_s or (
                limit and self._host_held() >= KEEP_FROM_SHARE * limit):
            return 1  # near the host's limit every step is read: a kill loses the fewest
        if len(self.resident) % STRIDE_STEPS and self.stride:
            return self.stride
        recent = marks[-STRIDE_STEPS - 1:]
        step_s = statistics.median(b - a for a, b in itertools.pairwise(recent))
        cost = max(READ_COST_S, statistics.median(self.read_s[-STRIDE_STEPS:]))
        self.stride = max(1, min(MAX_STRIDE, math.ceil(cost / (READ_BUDGET * max(step_s, 1e-9)))))
        self.read_every = max(self.read_every, self.stride)
        return self.stride

    def keep_now(self) -> bool:
        held = self._host_held()
        limit = self.host_limit.limit_mib if self.host_limit is not None else None
        if not limit or held < KEEP_FROM_SHARE * limit \
                or held - self.kept_at_mib < KEEP_EVERY_SHARE * limit:
            return False
        self.kept_at_mib = held
        self._read_private()
        return True

    def _host_held(self) -> float:
        """What the processes held at the last step's end, MiB: the cgroup's anonymous memory
        where its limit applies, else the process's and its children's resident sets."""
        if self.used:
            return self.used[-1]
        own = self.resident[-1] if self.resident else 0.0
        return own + (self.children_held[-1] if self.children_held else 0.0)

    def _read_private(self) -> None:
        own = private_mib("self")
        if own is None:
            return
        pids = self.child_reader.pids() if self.child_reader is not None else []
        theirs = [mib for mib in map(private_mib, pids) if mib is not None]
        self.private = PrivateMemory(
            step=len(self.resident) - 1, process_mib=own[0], children=len(theirs),
            children_mib=round(sum(mib[0] for mib in theirs), 1),
            together_mib=round(own[1] + sum(mib[1] for mib in theirs), 1))

    def _cuda_from_now(self) -> None:
        """The script uses the device from this step on: the steps before held nothing there."""
        self.cuda = True
        zeros = [0.0] * len(self.resident)
        self.allocated, self.reserved, self.peak = zeros, list(zeros), list(zeros)
        self.mallocs = [0] * len(self.resident)
        self.blocks = [0] * len(self.resident)

    def crashed(self, exc: BaseException) -> None:
        self.oom = out_of_memory(exc, self.clock.steps)
        if self.oom is not None and self.oom.device == "cuda" and not self.cuda:
            self._cuda_from_now()  # it died in its first step on the device: a CUDA timeline
        if worker_killed(exc):
            self.worker_killed = True
            limit = self.host_limit
            if limit is not None and limit.oom_kill_file is not None:
                limit.oom_kills_after = oom_kills(Path(limit.oom_kill_file))

    def fill(self, draft: StageDraft) -> None:
        listed = len(draft.timeline.step_ms)
        if not self.resident and self.oom is None:
            return
        memory = MemoryTimeline(device="cuda" if self.cuda else "cpu",
                                allocated_mib=self.allocated[:listed],
                                reserved_mib=self.reserved[:listed],
                                peak_mib=self.peak[:listed],
                                device_allocs=self.mallocs[:listed],
                                live_blocks=self.blocks[:listed],
                                resident_mib=self.resident[:listed],
                                host_total_mib=_host_total_mib(), oom=self.oom,
                                host_limit=self.host_limit,
                                killed="worker" if self.worker_killed else None,
                                host_used_mib=self.used[:listed], private=self.private,
                                children=self.children[:listed],
                                children_resident_mib=self.children_held[:listed])
        if self.read_every > 1:
            memory.read_steps = [i for i in self.read_at if i < listed]
            memory.note = (f"memory read every {self.read_every} steps at most (a step end's "
                           f"reads cost ~{READ_COST_S * 1e6:,.0f} us or more, over "
                           f"{READ_BUDGET:.0%} of this script's steps); the steps between repeat "
                           "the last read")
        if self.cuda:
            stats = torch.cuda.memory_stats()
            memory.alloc_retries = int(stats.get("num_alloc_retries", 0))
            memory.ooms = int(stats.get("num_ooms", 0))
            memory.pinned_host_mib = _pinned_host_mib()
            memory.device_total_mib = round(
                torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
                / _MIB, 1)
            fraction = torch.cuda.get_per_process_memory_fraction()
            if fraction < 1.0:
                memory.cap_mib = round(fraction * memory.device_total_mib, 1)
        else:
            memory.note = "; ".join(filter(None, (
                CPU_NOTE + ("" if self.statm is not None else
                            "; on this system only its highest so far"), memory.note)))
        draft.script.memory = memory


WATCH = MemoryWatch
