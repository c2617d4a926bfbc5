"""Memory as evidence (issue 57): each step's memory read at its end by the in-script watch
(gpudiag/measure/profile/inscript/watches/memory.py) on a CPU and, forced, on CUDA; what the
profiled stage's peak, the plot and trace.json make of it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from conftest import script_run, script_stage

from gpudiag.measure.profile.inscript import recorder as recorder_module
from gpudiag.measure.profile.inscript.watches import StageDraft
from gpudiag.measure.profile.inscript.watches import memory as watch_module
from gpudiag.measure.profile.inscript.watches.memory import MemoryWatch
from gpudiag.model.facts import MemoryTimeline, ScriptFacts, StageFacts, StepTimeline
from gpudiag.model.results import RunResult
from gpudiag.present.plots import memory_plot
from gpudiag.present.trace import build_trace

MIB = 1024 * 1024


class _Clock:
    steps = 0
    host_marks = (0.0,)


def _filled(watch: MemoryWatch, steps: int) -> ScriptFacts:
    timeline = StepTimeline(step_ms=[10.0] * steps)
    script = ScriptFacts(steps=steps, warmup=2, timed=4, step_clock="optimizer.step()",
                         timeline=timeline)
    watch.fill(StageDraft(StageFacts(script=script), script, timeline, timed=range(2, 6)))
    return script


def _vm_rss_mib() -> float | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    line = next(x for x in status.read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_a_cpu_scripts_steps_are_its_resident_set_said_so() -> None:
    """Each step's entry is the process's resident set as the kernel counts it (VmRSS); a
    long-lived test process reuses freed memory, so what one test allocates need not grow
    it: growth is the rules' to judge (tests/test_rules.py, gd403)."""
    watch = MemoryWatch(_Clock())
    for _ in range(6):
        watch.step_ended()
    memory = _filled(watch, 6).memory
    assert memory is not None and memory.device == "cpu"
    assert len(memory.resident_mib) == 6 and not memory.allocated_mib
    kernel = _vm_rss_mib()
    if kernel is not None:
        assert memory.resident_mib[-1] == pytest.approx(kernel, abs=16.0)
    assert "resident set stands in" in memory.note
    assert memory.host_total_mib and memory.host_total_mib > memory.resident_mib[-1]


def test_without_proc_the_highest_so_far_is_read_and_said() -> None:
    watch = MemoryWatch(_Clock())
    watch.statm = None  # a system without /proc/self/statm (macOS)
    watch.step_ended()
    memory = _filled(watch, 1).memory
    assert memory is not None and memory.resident_mib[0] > 10
    assert "only its highest so far" in memory.note


def test_steps_past_the_timeline_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch_module, "TIMELINE_STEPS", 3)
    watch = MemoryWatch(_Clock())
    for _ in range(5):
        watch.step_ended()
    assert len(watch.resident) == 3


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, used: list[int], fraction: float = 1.0,
               ) -> None:
    """A CUDA device whose allocator holds what `used` says (the script initialises it at
    its third step), the process capped at `fraction` of it."""
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda *a: fraction)
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: bool(used))
    monkeypatch.setattr(cuda, "memory_reserved", lambda *a: (used[-1] + 512) * MIB if used
                        else 0)
    monkeypatch.setattr(cuda, "memory_stats_as_nested_dict", lambda *a: {
        "allocated_bytes": {"all": {"current": used[-1] * MIB, "peak": max(used) * MIB}},
        "reserved_bytes": {"all": {"current": (used[-1] + 512) * MIB}},
        "allocation": {"all": {"current": 10 * len(used)}},
        "num_device_alloc": len(used)})
    monkeypatch.setattr(cuda, "memory_stats", lambda *a: {"num_alloc_retries": 2,
                                                          "num_ooms": 0})
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda *a: SimpleNamespace(total_memory=80 * 1024 * MIB))


def test_a_cuda_scripts_allocator_is_read_from_the_step_it_starts_using_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[int] = []
    _fake_cuda(monkeypatch, used)
    watch = MemoryWatch(_Clock())
    for step in range(5):
        if step >= 2:
            used.append(1000 + 100 * step)
        watch.step_ended()
    memory = _filled(watch, 5).memory
    assert memory is not None and memory.device == "cuda" and not memory.note
    assert memory.allocated_mib == [0.0, 0.0, 1200.0, 1300.0, 1400.0]
    assert memory.reserved_mib == [0.0, 0.0, 1712.0, 1812.0, 1912.0]
    assert memory.peak_mib[-1] == 1400.0 and len(memory.resident_mib) == 5
    assert memory.device_allocs == [0, 0, 1, 2, 3]
    assert memory.live_blocks == [0, 0, 10, 20, 30]
    assert memory.device_total_mib == 80 * 1024 and memory.alloc_retries == 2
    assert memory.cap_mib is None and memory.device_capacity_mib == 80 * 1024
    peaks = recorder_module._device_peaks(memory)
    assert peaks is not None and peaks.peak_allocated_mib == 1400.0
    assert peaks.peak_reserved_mib == 1912.0 and peaks.device_total_mib == 80 * 1024
    assert recorder_module._device_peaks(MemoryTimeline(device="cpu",
                                                        resident_mib=[1.0])) is None


def test_on_steps_too_short_for_them_the_memory_reads_are_made_every_few_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """1 ms steps: a step end's reads, taken to cost 60 us at least (a call into the kernel
    slows the Python after it: benchmarks/memory_watch_overhead.py), are made every 6th step
    to stay within 1% of a step; the steps between repeat the last read (the resident set and
    the allocator's counters alike), and the note says so. On 10 ms steps every step is read."""
    used = [1000]
    _fake_cuda(monkeypatch, used)
    clock = SimpleNamespace(steps=0, host_marks=[0.0])
    watch = MemoryWatch(clock)  # type: ignore[arg-type]
    for step in range(40):
        clock.host_marks.append((step + 1) * 1e-3)
        used.append(1000 + step)
        watch.step_ended()
    memory = _filled(watch, 40).memory
    assert memory is not None and len(memory.allocated_mib) == len(memory.resident_mib) == 40
    assert watch.read_every == 6
    assert memory.allocated_mib[6] == 1006 and memory.allocated_mib[12] == 1012
    assert memory.allocated_mib[7:12] == [1006] * 5  # repeated between reads
    assert memory.resident_mib[7:12] == [memory.resident_mib[6]] * 5
    assert "memory read every 6 steps at most" in memory.note
    assert memory.read_steps[-3:] == [24, 30, 36]
    if watch.host_limit is not None:  # near the host's limit (here 1 MiB) every step is read
        watch.host_limit = dataclasses.replace(watch.host_limit, limit_mib=1.0)
        assert watch._stride() == 1

    slow = MemoryWatch(SimpleNamespace(steps=0, host_marks=[0.0]))  # type: ignore[arg-type]
    for step in range(20):
        slow.clock.host_marks.append((step + 1) * 10e-3)  # type: ignore[attr-defined]
        slow.step_ended()
    assert slow.read_every == 1


def test_a_process_capped_below_the_device_has_the_cap_for_capacity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.set_per_process_memory_fraction(0.25): what the process may use is a
    quarter of the device (GD401 and the headroom read it)."""
    used = [1000]
    _fake_cuda(monkeypatch, used, fraction=0.25)
    watch = MemoryWatch(_Clock())
    watch.step_ended()
    memory = _filled(watch, 1).memory
    assert memory is not None and memory.cap_mib == 20 * 1024
    assert memory.device_capacity_mib == 20 * 1024 and memory.device_total_mib == 80 * 1024


def test_a_cpu_script_in_a_cuda_machine_is_not_read_as_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA available, never initialised by the script: its allocator is not touched (that
    would start CUDA in a CPU script's process)."""
    _fake_cuda(monkeypatch, [])
    watch = MemoryWatch(_Clock())
    watch.step_ended()
    assert not watch.cuda and watch.allocated == []


def _run_with_memory() -> RunResult:
    memory = MemoryTimeline(device="cuda", allocated_mib=[1000.0 + 10 * i for i in range(20)],
                            reserved_mib=[1600.0] * 20, peak_mib=[1200.0 + 10 * i
                                                                   for i in range(20)],
                            resident_mib=[3000.0] * 20, device_total_mib=80_000.0)
    timeline = StepTimeline(step_ms=[1000.0] + [20.0] * 19, steps=20)
    stage = script_stage([20.0] * 5, timeline=timeline, memory=memory)
    return script_run(stage, device="cuda")


def test_the_memory_plot_and_trace_counters(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run = _run_with_memory()
    assert memory_plot(run, tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:4] == b"\x89PNG"
    trace = build_trace(run, pd.DataFrame())
    counters = [e for e in trace["traceEvents"] if e.get("name") == "memory MiB"]
    assert len(counters) == 20
    # On the script's clock: step i's counter at its end (step 0 ends after 1 s).
    assert counters[0]["ts"] == 1000.0 * 1e3 and counters[1]["ts"] == 1020.0 * 1e3
    assert counters[-1]["args"] == {"allocated": 1190.0, "reserved": 1600.0, "peak": 1390.0,
                                    "resident": 3000.0}
    json.dumps(trace)  # it is JSON
    assert not memory_plot(script_run(script_stage([20.0] * 5)), tmp_path / "none.png")


def test_an_out_of_memory_error_is_read_for_its_request_the_device_and_a_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's message as c10 writes it, the allocator's counters at the failure and a
    per-process cap (set_per_process_memory_fraction); the CPU allocator's failure; any other
    error is no out-of-memory."""
    from gpudiag.measure.profile.inscript.outofmemory import out_of_memory

    _fake_cuda(monkeypatch, [3600])
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda *a: 0.05)
    message = ("CUDA out of memory. Tried to allocate 250.00 MiB. GPU 0 has a total capacity "
               "of 80.00 GiB of which 75.00 GiB is free. Including non-PyTorch memory, this "
               "process has 4.00 GiB memory in use.")
    oom = out_of_memory(torch.OutOfMemoryError(message), 22)
    assert oom is not None and oom.device == "cuda" and oom.step == 22
    assert (oom.requested_mib, oom.device_total_mib, oom.device_free_mib) == (
        250.0, 80 * 1024.0, 75 * 1024.0)
    assert oom.allocated_mib == 3600.0 and oom.cap_mib == 0.05 * 80 * 1024
    assert oom.message == "CUDA out of memory. Tried to allocate 250.00 MiB."
    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as error:
        cpu = out_of_memory(error, 3)
    assert cpu is not None and cpu.device == "cpu" and cpu.requested_mib == 2**30
    assert cpu.line is not None and cpu.line.startswith("tests/test_memory.py:")
    assert out_of_memory(ValueError("no"), 1) is None


def test_a_script_that_dies_of_cuda_out_of_memory_in_its_first_step_has_a_cuda_timeline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The commonest out-of-memory: the first step does not fit. No step ended, so the watch
    never saw the device in use; the failure is CUDA's: the timeline is the device's, with its
    memory, its cap and the failure (GD404 reads them), not a CPU's."""
    _fake_cuda(monkeypatch, [15_000], fraction=0.125)
    watch = MemoryWatch(_Clock())
    watch.crashed(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB."))
    memory = _filled(watch, 0).memory
    assert memory is not None and memory.device == "cuda" and memory.cap_mib == 10 * 1024
    assert memory.oom is not None and memory.oom.step == 0 and memory.oom.requested_mib == 512
    assert memory.allocated_mib == [] and memory.device_total_mib == 80 * 1024


def test_child_processes_are_counted_with_their_resident_sets(tmp_path: Path) -> None:
    """The main thread's children (DataLoader workers fork from it), read at each step's end
    from files held open: how many and their resident sets' sum (here a children file naming
    this process and one that is gone; then the list changes)."""
    from gpudiag.measure.profile.inscript.watches.memory import ChildrenReader

    listed = tmp_path / "children"
    listed.write_text(f"{os.getpid()} 999999999")
    reader = ChildrenReader(listed)
    count, held = reader.resident()
    assert count == 2 and held == pytest.approx(_vm_rss_mib() or held, abs=32.0)
    listed.write_text(f"{os.getpid()}")  # the list read again, the gone child's file closed
    assert reader.resident()[0] == 1 and set(reader.statm) == {str(os.getpid()).encode()}
    watch = MemoryWatch(_Clock())
    watch.child_reader = reader
    watch.step_ended()
    memory = _filled(watch, 1).memory
    assert memory is not None and memory.children == [1]
    assert memory.children_resident_mib[0] == pytest.approx(held, abs=32.0)
    assert ChildrenReader(tmp_path / "gone").resident() == (0, 0.0)
