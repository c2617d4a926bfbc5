"""A job's ranks in a recorded run, and each rank's memory at its peak, side by side.

A profiled multi-process job is a stage per process, named by its rank (`train.py[rank1]`:
the recorder's name, measure/profile/inscript/recorder.py); `gpudiag run`'s ddp stage is one
stage whose facts list its ranks (DdpFacts.ranks). Either way a rank's memory is its own: a
finding or a figure from rank 1's data says rank 1."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from gpudiag.model.facts import MemoryTimeline
from gpudiag.model.results import RunResult, StageResult

_RANK_NAME = re.compile(r"^(?P<job>.*)\[rank(?P<rank>\d+)\]$")


def job_and_rank(stage_name: str) -> tuple[str, int | None]:
    """(the job, the rank) a profiled process's stage is named for: `train.py[rank1]` is rank 1
    of `train.py`; a stage of no rank is its own job (rank None)."""
    match = _RANK_NAME.match(stage_name)
    return (match["job"], int(match["rank"])) if match else (stage_name, None)


def memory_rank(stage: StageResult) -> int | None:
    """The rank whose memory a stage's figures are: a profiled rank's own; a ddp stage's
    largest (its StageResult.memory is that rank's, the most reserved); None for a process of
    no rank."""
    ddp = stage.facts.ddp
    if ddp is not None:
        reserved = [r for r in ddp.ranks if r.peak_reserved_mib is not None]
        return max(reserved, key=lambda r: r.peak_reserved_mib or 0.0).rank \
            if len(ddp.ranks) >= 2 and reserved else None
    return job_and_rank(stage.name)[1]


def rank_prefix(stage: StageResult) -> str:
    """"Rank 1: " where a stage's memory is one rank's (a finding's title says whose data it
    read; a ddp stage's is its largest rank's); "" for a process of no rank."""
    rank = memory_rank(stage)
    if rank is None:
        return ""
    return f"Rank {rank} (the most reserved of {stage.name}'s ranks): " \
        if stage.facts.ddp is not None else f"Rank {rank}: "


@dataclass(frozen=True)
class RankPeak:
    """One rank's memory at its highest: on CUDA what tensors held (the allocator's peak) and
    what the allocator reserved; the process's resident set (a CPU's only measure); and the
    step at whose end the rank's measure (allocated on CUDA, resident on a CPU) peaked."""

    rank: int
    stage: str  # the stage its figures come from
    allocated_mib: float | None
    reserved_mib: float | None
    resident_mib: float | None
    step: int | None  # None: a ddp stage's rank, which keeps no step-by-step counters

    def measure(self, series: Literal["allocated", "resident"]) -> float | None:
        return self.allocated_mib if series == "allocated" else self.resident_mib


@dataclass(frozen=True)
class JobMemory:
    """A multi-rank job's ranks' peaks, side by side, compared by `series`: what tensors held
    on CUDA, the process's resident set on a CPU."""

    job: str  # the stage of a ddp run, or the script's name
    device: Literal["cuda", "cpu"]
    ranks: list[RankPeak]  # by rank

    @property
    def series(self) -> Literal["allocated", "resident"]:
        return "allocated" if self.device == "cuda" else "resident"

    def _measured(self) -> list[tuple[float, RankPeak]]:
        return [(value, r) for r in self.ranks if (value := r.measure(self.series)) is not None]

    @property
    def largest(self) -> RankPeak | None:
        measured = self._measured()
        return max(measured, key=lambda m: m[0])[1] if measured else None

    @property
    def smallest(self) -> RankPeak | None:
        measured = self._measured()
        return min(measured, key=lambda m: m[0])[1] if measured else None

    @property
    def spread(self) -> float | None:
        """The largest rank's peak over the smallest's (1.0: alike)."""
        high, low = self.largest, self.smallest
        high_mib = high.measure(self.series) if high else None
        low_mib = low.measure(self.series) if low else None
        return None if not high_mib or not low_mib else high_mib / low_mib


def _first_max(series: list[float]) -> int | None:
    return max(range(len(series)), key=series.__getitem__) if series else None


def timeline_peak(rank: int, stage: str, memory: MemoryTimeline) -> RankPeak:
    """A profiled rank's peaks from its counters at each step's end. The allocator's peak is
    never reset: its step is the first whose end shows the run's highest."""
    cuda = memory.device == "cuda"
    step = _first_max(memory.peak_mib if cuda else memory.resident_mib)
    return RankPeak(rank=rank, stage=stage,
                    allocated_mib=max(memory.peak_mib) if cuda and memory.peak_mib else None,
                    reserved_mib=max(memory.reserved_mib) if cuda and memory.reserved_mib
                    else None,
                    resident_mib=max(memory.resident_mib, default=None), step=step)


def _profiled_jobs(run: RunResult) -> list[JobMemory]:
    jobs: dict[str, list[tuple[RankPeak, MemoryTimeline]]] = defaultdict(list)
    for stage in run.stages:
        script = stage.facts.script
        job, rank = job_and_rank(stage.name)
        if rank is None or script is None or script.memory is None:
            continue
        jobs[job].append((timeline_peak(rank, stage.name, script.memory), script.memory))
    return [JobMemory(job=job, device="cuda" if any(m.device == "cuda" for _, m in found)
                      else "cpu", ranks=sorted((p for p, _ in found), key=lambda p: p.rank))
            for job, found in jobs.items() if len(found) >= 2]


def _ddp_stages(run: RunResult) -> list[JobMemory]:
    jobs = []
    for stage in run.stages:
        ddp = stage.facts.ddp
        if ddp is None or len(ddp.ranks) < 2:
            continue
        peaks = [RankPeak(rank=r.rank, stage=stage.name, allocated_mib=r.peak_allocated_mib,
                          reserved_mib=r.peak_reserved_mib, resident_mib=r.peak_resident_mib,
                          step=None) for r in sorted(ddp.ranks, key=lambda r: r.rank)]
        if any(p.allocated_mib is not None or p.resident_mib is not None for p in peaks):
            cuda = any(p.allocated_mib is not None for p in peaks)
            jobs.append(JobMemory(job=stage.name, device="cuda" if cuda else "cpu", ranks=peaks))
    return jobs


def job_memory(run: RunResult) -> list[JobMemory]:
    """Every job of two ranks or more whose memory was read: a profiled torchrun's (a stage per
    rank) and `gpudiag run`'s ddp stage's."""
    return _profiled_jobs(run) + _ddp_stages(run)
