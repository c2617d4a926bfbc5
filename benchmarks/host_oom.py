"""A real host out-of-memory kill, diagnosed: examples/host_oom.py (a dataset of Python objects
that six DataLoader workers copy page by page) profiled by gpudiag inside a memory cgroup of
its own with a small limit, as a container or a Slurm job would hold it, until the kernel's
out-of-memory killer ends it with SIGKILL. Writes the run (report.md, run.json), gpudiag's
output (gpudiag.log) and the cgroup's own record of it (host-oom.json: its limit, its peak,
its count of out-of-memory kills before and after, gpudiag's exit code), the independent
measurement the report's figures are checked against:

    sudo python benchmarks/host_oom.py --out reports/examples/host-oom

Linux, as root (a cgroup is made under this process's memory cgroup, v2 or v1, and removed
after). The script never runs without the limit: the limit is read back before it starts, and
the processes are in the cgroup before gpudiag's Python starts (each child of gpudiag stays in
its parent's cgroup). Exits NO_CGROUP (3) with one line where no cgroup can be made here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from gpudiag.measure.hostmemory import MemoryCgroup, memory_cgroup, oom_kills
from gpudiag.model.runfile import load_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "host_oom.py"
NO_CGROUP = 3
LIMIT_MIB = 900  # ~300 MiB above what the script and its six forks hold at their first step
# A short schedule: the kill comes some 15 steps in, each step after the window is kept.
SCHEDULE = ("--warmup", "1", "--timed", "2", "--steps", "0", "--no-rerun")


class NoCgroup(Exception):
    """No memory cgroup can be made and limited here (not Linux, not root, no controller)."""


@contextlib.contextmanager
def limited_cgroup(limit_mib: int) -> Iterator[tuple[MemoryCgroup, Path]]:
    """A child of this process's memory cgroup with `limit_mib` set (and no swap beyond it),
    read back; removed once its processes are gone."""
    parent = memory_cgroup()
    if parent is None:
        raise NoCgroup("no memory cgroup found in /proc/self/cgroup")
    folder = parent.folder / f"gpudiag-host-oom-{os.getpid()}"
    try:
        folder.mkdir()
    except OSError as exc:
        raise NoCgroup(f"cannot make a cgroup under {parent.folder}: {exc}") from exc
    try:
        _set_limit(folder, parent.version, limit_mib * 2**20)
        yield MemoryCgroup(folder, parent.mount, parent.version), folder
    finally:
        for _ in range(50):  # its last processes may take a moment to be reaped
            with contextlib.suppress(OSError):
                folder.rmdir()
                break
            time.sleep(0.1)


def _set_limit(folder: Path, version: int, limit: int) -> None:
    if version == 2:
        (folder / "memory.max").write_text(str(limit))
        with contextlib.suppress(OSError):  # no swap to escape to, where swap is configured
            (folder / "memory.swap.max").write_text("0")
        read = (folder / "memory.max").read_text().strip()
    else:
        (folder / "memory.limit_in_bytes").write_text(str(limit))
        with contextlib.suppress(OSError):  # memory + swap: the same, where accounted
            (folder / "memory.memsw.limit_in_bytes").write_text(str(limit))
        read = (folder / "memory.limit_in_bytes").read_text().strip()
    if not read.isdigit() or int(read) > limit:
        raise NoCgroup(f"the limit did not hold ({folder}: {read})")


def _peak_mib(cgroup: MemoryCgroup) -> float | None:
    name = "memory.peak" if cgroup.version == 2 else "memory.max_usage_in_bytes"
    with contextlib.suppress(OSError, ValueError):
        return round(int((cgroup.folder / name).read_text()) / 2**20, 1)
    return None


def run(out: Path, limit_mib: int) -> dict[str, object]:
    """gpudiag profile of the example inside the limited cgroup; the cgroup's record."""
    with limited_cgroup(limit_mib) as (cgroup, folder):
        counter = folder / ("memory.events" if cgroup.version == 2 else "memory.oom_control")
        before = oom_kills(counter)
        procs = folder / "cgroup.procs"
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "gpudiag", "profile", *SCHEDULE, "--no-plots", "--force",
             "--out", str(out), "--", sys.executable, str(EXAMPLE)],
            cwd=ROOT, capture_output=True, text=True, check=False, timeout=300,
            # Into the cgroup before gpudiag's Python starts: all it starts stays there.
            preexec_fn=lambda: procs.write_text(str(os.getpid())))
        record = {"limit_mib": limit_mib, "cgroup_version": cgroup.version,
                  "exit_code": done.returncode, "seconds": round(time.perf_counter() - started, 1),
                  "oom_kills_before": before, "oom_kills_after": oom_kills(counter),
                  "cgroup_peak_mib": _peak_mib(cgroup)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpudiag.log").write_text(done.stdout + done.stderr)
    if (out / "run.json").is_file():
        found = [f for f in load_run(out).findings if f.id == "GD406"]
        record["finding"] = found[0].title if found else None
        record["fix"] = found[0].fix if found else None
    (out / "host-oom.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reports/examples/host-oom")
    parser.add_argument("--limit-mib", type=int, default=LIMIT_MIB)
    args = parser.parse_args()
    try:
        record = run(args.out, args.limit_mib)
    except NoCgroup as exc:
        print(f"host_oom: {exc}", file=sys.stderr)
        raise SystemExit(NO_CGROUP) from None
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
