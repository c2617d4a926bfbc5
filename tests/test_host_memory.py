"""Host memory against the limit the script can use (issue 57): its cgroup's (v2 memory.max,
v1 memory.limit_in_bytes, an ancestor's), else the machine's, each branch forced with fake
files; a run the kernel's out-of-memory killer ended (GD406's critical report) told from a
SIGKILL of unknown cause; and a real out-of-memory kill in a cgroup where one can be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import script_run, script_stage

from gpudiag.diagnose import evaluate
from gpudiag.measure.hostmemory import CgroupUsage, host_limit, oom_kills
from gpudiag.measure.profile.inscript.watches.memory import MemoryWatch, worker_killed
from gpudiag.measure.profile.launching.session import Collected, Ended, _mark_failure
from gpudiag.model.facts import HostLimit, LoaderFacts, LoaderUse, MemoryTimeline, PrivateMemory
from gpudiag.model.results import Finding, RunResult

GIB = 1024 * 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent


def _machine(tmp_path: Path, gib: int = 64) -> Path:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {gib * 1024 * 1024} kB\nMemFree: 1 kB\n")
    return meminfo


def _limit(tmp_path: Path, cgroup_line: str, files: dict[str, str]) -> HostLimit | None:
    """host_limit() over fake /proc/self/cgroup (`cgroup_line`), a fake cgroup tree (`files`,
    relative to the cgroup root) and a 64 GiB machine."""
    proc = tmp_path / "cgroup"
    proc.write_text(cgroup_line + "\n")
    root = tmp_path / "sys"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("pgfault 9\noom_kill 3\n")
    return host_limit(proc, root, _machine(tmp_path), vmstat)


def test_a_v2_cgroups_memory_max_below_the_machine_is_the_limit(tmp_path: Path) -> None:
    limit = _limit(tmp_path, "0::/job", {"job/memory.max": str(16 * GIB),
                                         "job/memory.events": "oom 2\noom_kill 1\n"})
    assert limit is not None
    assert (limit.limit_mib, limit.source, limit.machine_mib) == (
        16384.0, "cgroup v2 memory.max", 65536.0)
    assert limit.oom_kill_file == str(tmp_path / "sys/job/memory.events")
    assert limit.oom_kills == 1


def test_an_ancestors_smaller_limit_applies(tmp_path: Path) -> None:
    """A Kubernetes pod's limit over its container's "max"."""
    limit = _limit(tmp_path, "0::/pod/ctr", {"pod/memory.max": str(8 * GIB),
                                             "pod/ctr/memory.max": "max\n"})
    assert limit is not None and limit.limit_mib == 8192.0
    assert limit.cgroup == str(tmp_path / "sys/pod")


def test_no_limit_is_the_machines_memory(tmp_path: Path) -> None:
    """"max" (v2), v1's page-counter maximum, a limit above the machine's, no cgroup file:
    the machine's memory, its kills counted in /proc/vmstat."""
    for line, files in (("0::/job", {"job/memory.max": "max"}),
                        ("4:memory:/job", {"memory/job/memory.limit_in_bytes":
                                           "9223372036854771712"}),
                        ("0::/job", {"job/memory.max": str(128 * GIB)}),
                        ("0::/job", {})):
        limit = _limit(tmp_path, line, files)
        assert limit is not None and (limit.limit_mib, limit.source) == (65536.0, "machine")
        assert limit.oom_kills == 3


def test_a_v1_memory_controller_limit(tmp_path: Path) -> None:
    """A hybrid system: the v1 memory controller's limit (a Slurm job's), not the v2
    hierarchy's, which has no memory controller."""
    limit = _limit(tmp_path, "12:memory:/slurm/job1\n0::/user.slice",
                   {"memory/slurm/job1/memory.limit_in_bytes": str(2 * GIB),
                    "memory/slurm/job1/memory.oom_control":
                        "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n"})
    assert limit is not None
    assert (limit.limit_mib, limit.source, limit.oom_kills) == (
        2048.0, "cgroup v1 memory.limit_in_bytes", 4)


def test_a_container_that_sees_its_hosts_path_reads_its_mount(tmp_path: Path) -> None:
    limit = _limit(tmp_path, "4:memory:/docker/abc", {"memory/memory.limit_in_bytes": str(GIB)})
    assert limit is not None and limit.limit_mib == 1024.0


def test_an_unreadable_cgroup_file_is_the_machines_memory(tmp_path: Path) -> None:
    limit = host_limit(tmp_path / "absent", tmp_path, _machine(tmp_path, 32), tmp_path / "no")
    assert limit is not None and limit.source == "machine" and limit.limit_mib == 32768.0
    assert limit.oom_kills is None and oom_kills(tmp_path / "no") is None


def test_the_cgroups_anonymous_memory_each_step(tmp_path: Path) -> None:
    (tmp_path / "memory.stat").write_text("anon 1048576\nfile 99999999\n")
    v2 = CgroupUsage(HostLimit(16.0, "cgroup v2 memory.max", cgroup=str(tmp_path)))
    assert v2.mib() == 1.0
    (tmp_path / "memory.stat").write_text(f"cache 5\nrss 7\ntotal_cache 0\ntotal_rss {2 << 20}\n")
    v1 = CgroupUsage(HostLimit(16.0, "cgroup v1 memory.limit_in_bytes", cgroup=str(tmp_path)))
    assert v1.mib() == 2.0
    assert CgroupUsage(HostLimit(16.0, "machine")).mib() is None


def test_a_dataloader_workers_sigkill_is_read_from_torchs_error() -> None:
    cause = RuntimeError("DataLoader worker (pid 123) is killed by signal: Killed. ")
    try:
        try:
            raise cause
        except RuntimeError as exc:
            raise RuntimeError("DataLoader worker (pid(s) 123) exited unexpectedly") from exc
    except RuntimeError as raised:
        assert worker_killed(raised)
    assert not worker_killed(RuntimeError("DataLoader worker (pid 1) is killed by signal: "
                                          "Terminated."))


class _Clock:
    steps = 0
    host_marks = (0.0,)


def test_near_the_limit_the_part_is_written_as_the_processes_grow() -> None:
    """From half the limit, again at each 5% more of it: a kill loses only the steps since;
    each time, the processes' own pages are read (this process's, here)."""
    watch = MemoryWatch(_Clock())  # type: ignore[arg-type]
    watch.host_limit = HostLimit(1000.0, "cgroup v2 memory.max")
    asked = []
    for used in (100.0, 499.0, 500.0, 520.0, 549.0, 550.0, 551.0, 700.0):
        watch.resident.append(50.0)
        watch.used.append(used)
        asked.append(watch.keep_now())
    assert asked == [False, False, True, False, False, True, False, True]
    assert watch.private is not None and watch.private.step == 7
    assert watch.private.process_mib > 0


def _killed(*, counted: int | None, share: float, killed: str = "process",
            steps: int = 20) -> RunResult:
    """A script in a container limited to 1 GiB, its 4 workers growing, killed at the end;
    `counted` out-of-memory kills (None: not readable), its last step holding `share`."""
    limit = HostLimit(1024.0, "cgroup v1 memory.limit_in_bytes", machine_mib=65536.0,
                      oom_kill_file="/x", oom_kills=0 if counted is not None else None,
                      oom_kills_after=counted)
    used = [share * 1024 * (0.6 + 0.4 * i / (steps - 1)) for i in range(steps)]
    memory = MemoryTimeline(
        device="cpu", resident_mib=[450.0] * steps, children=[4] * steps,
        children_resident_mib=[1600.0] * steps, host_total_mib=65536.0, host_limit=limit,
        host_used_mib=used, killed=killed,  # type: ignore[arg-type]
        private=PrivateMemory(step=steps - 1, process_mib=40.0, children=4,
                              children_mib=share * 1024 - 440))
    loader = LoaderUse(site="train.py:30", settings=LoaderFacts(num_workers=4, pin_memory=True,
                                                                prefetch_factor=4),
                       batch_bytes=8 << 20, training=True)
    stage = script_stage([100.0] * 30, memory=memory, loaders=[loader])
    stage.status = "error"
    return script_run(stage)


def _gd406(run: RunResult) -> Finding:
    (found,) = [f for f in evaluate(run) if f.id == "GD406"]
    return found


def test_an_out_of_memory_kill_is_named_with_what_held_the_host_and_the_knobs() -> None:
    f = _gd406(_killed(counted=1, share=0.97))
    assert f.severity == "critical"
    assert f.title.startswith("The script's process was killed by the kernel's out-of-memory "
                              "killer (SIGKILL, no Python traceback) (recorded up to step 19")
    assert "the kernel counted 1 out-of-memory kill under the container's 1.00 GiB limit " \
           "(cgroup memory.limit_in_bytes; the machine has 64.00 GiB)" in f.title
    # 993 MiB at the last step: the process 40 of its own, the workers 553 (~138 each), the
    # rest shared; from 596 MiB at step 0.
    assert "the process 40 MiB of its own, its 4 child processes 553 MiB of their own " \
           "(~138 MiB each), 400 MiB shared between them" in f.title
    assert "+397 MiB since step 0 (20.9 MiB a step)" in f.title
    assert f.evidence["oom_kills_counted"] == 1
    assert "num_workers=2 instead of 4 frees ~277 MiB" in f.fix
    # 4 workers x 3 more batches of 8 MiB than one each: 96 MiB.
    assert "prefetch_factor=1 frees ~96 MiB" in f.fix
    assert "pin_memory=False" in f.fix and "memory-mapped" in f.fix


def test_a_kill_near_the_limit_without_a_readable_count_is_the_killers() -> None:
    f = _gd406(_killed(counted=None, share=0.9))
    assert f.severity == "critical" and "its last recorded step held 90% of" in f.title


def test_a_sigkill_far_from_the_limit_with_no_kill_counted_is_of_unknown_cause() -> None:
    """Never guessed to be memory: a scheduler's preemption, a `kill -9`."""
    f = _gd406(_killed(counted=0, share=0.5))
    assert f.severity == "warning"
    assert "out-of-memory killer" not in f.title and "the cause is unknown" in f.title
    assert "no out-of-memory kill counted" in f.title


def test_on_a_machine_without_a_limit_its_kill_count_is_anyones() -> None:
    """/proc/vmstat counts every process's out-of-memory kill, in any cgroup: said beside a
    kill of unknown cause, never taken for this one's; held near the machine's, the killer's."""
    run = _killed(counted=1, share=0.5)
    memory = run.stages[0].facts.script.memory  # type: ignore[union-attr]
    assert memory is not None and memory.host_limit is not None
    memory.host_limit.source, memory.host_used_mib = "machine", []
    memory.resident_mib = [400.0] * 20
    memory.children_resident_mib = [112.0] * 20
    memory.host_limit.limit_mib = 1024.0
    f = _gd406(run)
    assert f.severity == "warning" and "the cause is unknown" in f.title
    assert "the kernel counted 1 out-of-memory kill on the machine over the run (of any " \
           "process" in f.title
    memory.children_resident_mib = [600.0] * 20
    g = _gd406(run)
    assert g.severity == "critical" and "out-of-memory killer" in g.title


def test_forks_sharing_the_scripts_pages_are_counted_once_where_read() -> None:
    """Eight workers' resident sets each count the 3 GiB they share with the script: 27 GiB of
    the machine's 32 by their sum, 5 GiB by their proportional sets, read at that step: no
    finding, and a SIGKILL then is of unknown cause."""
    steps = 10
    memory = MemoryTimeline(
        device="cpu", resident_mib=[3072.0] * steps, children=[8] * steps,
        children_resident_mib=[8 * 3072.0] * steps, host_total_mib=32768.0,
        host_limit=HostLimit(32768.0, "machine", machine_mib=32768.0),
        private=PrivateMemory(step=steps - 1, process_mib=100.0, children=8,
                              children_mib=1900.0, together_mib=5120.0))
    run = script_run(script_stage([100.0] * 30, memory=memory))
    assert not [f for f in evaluate(run) if f.id == "GD406"]
    memory.killed = "process"
    assert "the cause is unknown" in _gd406(run).title
    memory.private = None  # not read: the resident sets' sum stands
    assert _gd406(run).severity == "critical"


def test_a_dataloader_worker_killed_is_named_as_such() -> None:
    f = _gd406(_killed(counted=1, share=0.97, killed="worker"))
    assert f.title.startswith("A DataLoader worker was killed by the kernel's out-of-memory "
                              "killer (SIGKILL, no Python traceback): ")


def test_near_a_containers_limit_is_said_of_that_limit() -> None:
    run = _killed(counted=None, share=0.85)
    memory = run.stages[0].facts.script.memory  # type: ignore[union-attr]
    assert memory is not None
    memory.killed = None
    f = _gd406(run)
    assert f.severity == "warning"
    assert f.title.startswith("The script and its child processes hold 870 MiB of the "
                              "container's 1.00 GiB limit (cgroup memory.limit_in_bytes; the "
                              "machine has 64.00 GiB) (85%) at step 19: the process 40 MiB of "
                              "its own")


def test_gpudiags_side_marks_a_sigkilled_process_and_reads_the_count_again(
        tmp_path: Path) -> None:
    counter = tmp_path / "memory.oom_control"
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    run = _killed(counted=None, share=0.5)
    stage = run.stages[0]
    memory = stage.facts.script.memory  # type: ignore[union-attr]
    assert memory is not None and memory.host_limit is not None
    memory.killed, memory.host_limit.oom_kill_file = None, str(counter)
    _mark_failure(run, Collected(stages=[stage], unfinished=[stage]), Ended(-9), ["python"])
    assert memory.killed == "process" and memory.host_limit.oom_kills_after == 2
    # A torchrun rank: its agent exits 1; the cgroup's count rose over the run (0 -> 2).
    rank = _killed(counted=None, share=0.5)
    rank_memory = rank.stages[0].facts.script.memory  # type: ignore[union-attr]
    assert rank_memory is not None and rank_memory.host_limit is not None
    rank_memory.killed, rank_memory.host_limit.oom_kill_file = None, str(counter)
    rank_memory.host_limit.oom_kills = 0
    _mark_failure(rank, Collected(stages=rank.stages, unfinished=rank.stages), Ended(1),
                  ["torchrun"])
    assert rank_memory.killed == "process"
    # os._exit(1) with no kill counted (2 -> 2), or only the machine's count risen: not killed.
    for source in ("cgroup v1 memory.limit_in_bytes", "machine"):
        other = _killed(counted=None, share=0.5)
        other_memory = other.stages[0].facts.script.memory  # type: ignore[union-attr]
        assert other_memory is not None and other_memory.host_limit is not None
        other_memory.killed, other_memory.host_limit.oom_kill_file = None, str(counter)
        other_memory.host_limit.source = source
        other_memory.host_limit.oom_kills = 2 if source != "machine" else 0
        _mark_failure(other, Collected(stages=other.stages, unfinished=other.stages),
                      Ended(1), ["python"])
        assert other_memory.killed is None


@pytest.mark.slow
def test_a_real_out_of_memory_kill_in_a_cgroup_gets_its_report(tmp_path: Path) -> None:
    """examples/host_oom.py under gpudiag in a memory cgroup of 600 MiB (benchmarks/host_oom.py
    makes it, as root): the kernel kills it, gpudiag passes 137 on and names the kill."""
    out = tmp_path / "run"
    env = {**os.environ, "HOST_OOM_ROWS": "100000", "HOST_OOM_WORKERS": "4"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/host_oom.py"), "--out",
                           str(out), "--limit-mib", "600"], capture_output=True, text=True,
                          env=env, check=False, timeout=300)
    if done.returncode == 3:  # NO_CGROUP
        pytest.skip(f"no memory cgroup can be made here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "host-oom.json").read_text())
    assert record["oom_kills_after"] > record["oom_kills_before"]
    assert record["exit_code"] in (137, 1), record  # the script, or a worker, killed
    assert "killed by the kernel's out-of-memory killer" in record["finding"], record
    assert "the container's 600 MiB limit" in record["finding"]
