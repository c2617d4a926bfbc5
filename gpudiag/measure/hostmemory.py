"""The host memory a process may use: the machine's, or less where its memory cgroup (a
container's, a Slurm job's, a Kubernetes pod's) or one of that cgroup's ancestors sets a limit,
often far below the machine's; and where the kernel counts the out-of-memory kills that limit
causes. Linux only (elsewhere the machine's memory, no count). No torch: gpudiag's own process
reads the count again once the command has ended.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpudiag.model.facts import HostLimit

_MIB = 1024 * 1024
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
VMSTAT = Path("/proc/vmstat")  # the machine's own count of out-of-memory kills


@dataclass(frozen=True)
class MemoryCgroup:
    """The process's memory cgroup: its folder, the hierarchy's mount and version."""

    folder: Path
    mount: Path
    version: Literal[1, 2]


def memory_cgroup(proc_cgroup: Path = PROC_CGROUP,
                  root: Path = CGROUP_ROOT) -> MemoryCgroup | None:
    """From /proc/self/cgroup: a v1 hierarchy with the memory controller ("4:memory:/path",
    mounted at root/memory) is the one that limits where it exists (a hybrid system's v2
    hierarchy then has no memory controller); else the v2 one ("0::/path", mounted at root).
    A container that sees its host's path for its cgroup has that cgroup mounted as the
    hierarchy's top. None where neither is readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            found = _existing(root / controllers, path, "memory.limit_in_bytes")
            if found is not None:
                return MemoryCgroup(found, root / controllers, 1)
        elif not controllers:
            unified = _existing(root, path, "memory.max")
    return MemoryCgroup(unified, root, 2) if unified is not None else None


def _existing(mount: Path, path: str, limit_file: str) -> Path | None:
    for folder in (mount / path.lstrip("/"), mount):
        if (folder / limit_file).exists():
            return folder
    return None


def _limit_bytes(folder: Path, version: Literal[1, 2]) -> int | None:
    """The folder's own limit, None where it sets none ("max"; v1's page-counter maximum is a
    number far above any machine's memory, left to the comparison with the machine's)."""
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    try:
        text = (folder / name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _machine_mib(meminfo: Path) -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024, 1)
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / _MIB, 1)
    return None


def _limiting(cgroup: MemoryCgroup) -> tuple[Path, int] | None:
    """The cgroup, of the process's and its ancestors up to the hierarchy's mount, with the
    smallest limit: a limit set on a parent (a pod's over its containers') applies as well."""
    top = cgroup.mount
    best: tuple[Path, int] | None = None
    folder = cgroup.folder
    while True:
        limit = _limit_bytes(folder, cgroup.version)
        if limit is not None and (best is None or limit < best[1]):
            best = (folder, limit)
        if folder == top or top not in folder.parents:
            return best
        folder = folder.parent


def oom_kills(counter: Path) -> int | None:
    """The "oom_kill N" line of a cgroup's memory.events (v2), memory.oom_control (v1), or
    /proc/vmstat: the kernel's out-of-memory kills there so far."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in counter.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return None


def host_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT,
               meminfo: Path = MEMINFO, vmstat: Path = VMSTAT) -> HostLimit | None:
    """The smaller of the machine's memory and the cgroup's limit, which of the two, and the
    out-of-memory kills counted where it is enforced so far. None where neither is known."""
    machine = _machine_mib(meminfo)
    cgroup = memory_cgroup(proc_cgroup, root)
    limiting = _limiting(cgroup) if cgroup is not None else None
    if cgroup is not None and limiting is not None and (
            machine is None or limiting[1] / _MIB < machine):
        folder, limit = limiting
        counter = folder / ("memory.events" if cgroup.version == 2 else "memory.oom_control")
        source: Literal["cgroup v2 memory.max", "cgroup v1 memory.limit_in_bytes"] = (
            "cgroup v2 memory.max" if cgroup.version == 2
            else "cgroup v1 memory.limit_in_bytes")
        return HostLimit(limit_mib=round(limit / _MIB, 1), source=source, machine_mib=machine,
                         cgroup=str(folder), oom_kill_file=str(counter),
                         oom_kills=oom_kills(counter))
    if machine is None:
        return None
    return HostLimit(limit_mib=machine, source="machine", machine_mib=machine,
                     oom_kill_file=str(vmstat), oom_kills=oom_kills(vmstat))


class CgroupUsage:
    """The limiting cgroup's anonymous memory, read at each step's end from its memory.stat
    held open (v2 "anon", v1 "total_rss", its descendants included): what its processes hold,
    the page cache (reclaimed before any kill) apart. ~30 us a read."""

    def __init__(self, limit: HostLimit) -> None:
        self.key = b"\nanon " if limit.source == "cgroup v2 memory.max" else b"\ntotal_rss "
        self.fd: int | None = None
        if limit.cgroup is not None and limit.source != "machine":
            with contextlib.suppress(OSError):
                self.fd = os.open(Path(limit.cgroup) / "memory.stat", os.O_RDONLY | os.O_CLOEXEC)

    def mib(self) -> float | None:
        if self.fd is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            text = b"\n" + os.pread(self.fd, 16384, 0)
            start = text.find(self.key)
            if start >= 0:
                start += len(self.key)
                return round(int(text[start:text.index(b"\n", start)]) / _MIB, 1)
        return None


def private_mib(pid: int | str) -> tuple[float, float] | None:
    """A process's pages of its own (Private_Clean + Private_Dirty of its smaps_rollup) and its
    proportional set (Pss: each page it shares divided among its sharers), MiB: for a forked
    worker, the copies it made of the script's pages and what it allocated; the Pss of a
    group of processes sums to what they hold together."""
    own = pss = 0
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            own += int(line.split()[1])
        elif line.startswith("Pss:"):
            pss = int(line.split()[1])
    return round(own / 1024, 1), round(pss / 1024, 1)
