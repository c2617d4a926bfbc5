"""Evidence analysis: per-step counts charged to source lines, from Chrome-trace events.

Most tests build a handful of events by hand (times in microseconds), so every expected number
can be worked out on paper; the last ones profile a real CPU workload.
"""

from __future__ import annotations

import dataclasses
import gzip
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import gpudiag
from gpudiag.measure.evidence.annotation import annotation
from gpudiag.measure.evidence.kinds import kernel_kind, op_kind
from gpudiag.measure.evidence.profiler_window import capture_trace
from gpudiag.measure.evidence.source import (
    code_role,
    display_path,
    frame_role,
    is_library,
)
from gpudiag.measure.evidence.trace import analyze, memcpy_kind
from gpudiag.model.results import Evidence, SourceLine

Event = dict[str, Any]
HOST_TID = 1
STREAM_TID = 7


def op(name: str, ts: float, dur: float, *, tid: int = HOST_TID, seq: int | None = None,
       cat: str = "cpu_op", **args: Any) -> Event:
    """A host event; `seq` is the autograd "Sequence number" the profiler records."""
    if seq is not None:
        args["Sequence number"] = seq
    return {"ph": "X", "cat": cat, "name": name, "pid": 100, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def ann(location: str, function: str, ts: float, dur: float, *, direct: bool = True,
        dtype: str = "", tid: int = HOST_TID) -> Event:
    """The range the source annotator opens around one torch call."""
    return op(annotation(location, function, direct, dtype), ts, dur, tid=tid,
              cat="user_annotation")


def launch(name: str, ts: float, corr: int, *, dur: float = 2.0, tid: int = HOST_TID) -> Event:
    """A CUDA runtime call (cudaLaunchKernel, cudaMemcpyAsync, cudaStreamSynchronize...)."""
    return op(name, ts, dur, tid=tid, cat="cuda_runtime", correlation=corr)


def kernel(name: str, ts: float, dur: float, corr: int, *, cat: str = "kernel") -> Event:
    """A device event (kernel, gpu_memcpy, gpu_memset) tied to its launch by correlation."""
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": STREAM_TID, "ts": ts,
            "dur": dur, "args": {"correlation": corr}}


def copy(name: str, ts: float, dur: float, corr: int) -> Event:
    return kernel(name, ts, dur, corr, cat="gpu_memcpy")


def run(events: list[Event], *, steps: int = 1, step_ms: float = 1.0, backend: str = "cuda",
        timed_step_ms: float | None = None) -> Evidence:
    return analyze(events, steps=steps, step_ms=step_ms, backend=backend,
                   timed_step_ms=timed_step_ms)


def line(ev: Evidence, location: str) -> SourceLine:
    found = [s for s in ev.source_lines if s.location == location]
    assert len(found) == 1, [s.location for s in ev.source_lines]
    return found[0]


def test_forward_op_and_its_kernels_are_charged_to_the_enclosing_line() -> None:
    events = [
        ann("model.py:10", "forward", 0, 100),
        op("aten::mul", 10, 50),
        launch("cudaLaunchKernel", 20, corr=1),
        launch("cudaLaunchKernel", 40, corr=2),
        kernel("mul_kernel", 200, 4.0, corr=1),
        kernel("mul_kernel", 210, 8.0, corr=2),
        # A kernel launched outside every annotation is counted for the step, not for the line.
        launch("cudaLaunchKernel", 150, corr=3),
        kernel("other", 220, 10.0, corr=3),
        ann("model.py:11", "forward", 300, 20, direct=False),
    ]
    ev = run(events)
    ten = line(ev, "model.py:10")
    assert ten.function == "forward"
    assert ten.calls_per_step == 1 and ten.direct_calls_per_step == 1
    assert ten.ops_per_step == 1
    assert ten.kernels_per_step == 2
    assert ten.device_ms_per_step == pytest.approx(0.012)
    assert ten.median_kernel_us == pytest.approx(6.0)
    assert ten.host_ms_per_step == pytest.approx(0.1)
    assert ten.share_of_step_time == pytest.approx(0.1)  # 100 us of a 1 ms step
    assert not ten.in_loop  # model.py does not exist: no loop can be seen
    eleven = line(ev, "model.py:11")
    assert eleven.calls_per_step == 1 and eleven.direct_calls_per_step == 0
    assert eleven.kernels_per_step == 0 and eleven.median_kernel_us is None
    assert ev.kernels_per_step == 3 and ev.launches_per_step == 3
    assert ev.device_ms_per_step == pytest.approx(0.022)
    assert ev.short_kernels_per_step == 2  # 4 and 8 us are under 10 us; 10 us is not
    assert ev.hottest_source_line() is ten
    assert ev.top_ops_by_time == [
        {"name": "mul_kernel", "ms_per_step": pytest.approx(0.012)},
        {"name": "other", "ms_per_step": pytest.approx(0.010)},
    ]


def test_a_call_on_another_thread_is_not_charged_to_an_annotation() -> None:
    events = [ann("model.py:10", "forward", 0, 100),
              op("aten::mul", 10, 50, tid=2),
              launch("cudaLaunchKernel", 20, corr=1, tid=2),
              kernel("k", 200, 4.0, corr=1)]
    ev = run(events)
    ten = line(ev, "model.py:10")
    assert ten.ops_per_step == 0 and ten.kernels_per_step == 0
    assert ev.ops_per_step == 1 and ev.kernels_per_step == 1


def test_backward_work_follows_the_forward_line_by_sequence_number() -> None:
    events = [
        ann("model.py:10", "forward", 0, 100),  # line A
        op("aten::mul", 10, 40, seq=7),
        ann("train.py:20", "step", 200, 200),  # line B: loss.backward()
        op("autograd::engine::evaluate_function: MulBackward0", 210, 50, seq=7),
        op("MulBackward0", 212, 40, seq=7),  # inside the node: the same number
        op("aten::mul", 215, 30),
        launch("cudaLaunchKernel", 220, corr=5),
        kernel("mul_backward_kernel", 500, 20.0, corr=5),
        # No forward op carries 99: the node stays on the line that called backward.
        op("autograd::engine::evaluate_function: ExpBackward0", 300, 30, seq=99),
        launch("cudaLaunchKernel", 310, corr=6),
        kernel("exp_backward_kernel", 530, 10.0, corr=6),
    ]
    ev = run(events)
    a, b = line(ev, "model.py:10"), line(ev, "train.py:20")
    # The forward mul and its backward node; the ops nested inside the node are not counted.
    assert a.ops_per_step == 2
    assert a.kernels_per_step == 1 and a.device_ms_per_step == pytest.approx(0.020)
    assert a.host_ms_per_step == pytest.approx(0.150)  # its call (100 us) + the node (50 us)
    assert b.ops_per_step == 1
    assert b.kernels_per_step == 1 and b.device_ms_per_step == pytest.approx(0.010)


def test_backward_on_the_autograd_thread_is_charged_to_its_forward_line() -> None:
    # On CUDA the engine runs backward on its own thread, outside every annotation.
    events = [ann("model.py:10", "forward", 0, 100),
              op("aten::addmm", 10, 40, seq=3),
              op("autograd::engine::evaluate_function: AddmmBackward0", 200, 50, seq=3, tid=9),
              launch("cudaLaunchKernel", 210, corr=1, tid=9),
              kernel("gemm", 300, 30.0, corr=1)]
    a = line(run(events), "model.py:10")
    assert a.ops_per_step == 2 and a.kernels_per_step == 1


def test_backward_node_left_on_the_backward_line_is_not_counted_twice() -> None:
    events = [ann("train.py:20", "step", 0, 100),
              op("autograd::engine::evaluate_function: AccumulateGrad", 10, 80)]
    b = line(run(events), "train.py:20")
    assert b.host_ms_per_step == pytest.approx(0.100)  # the call's 100 us, not 180


def one_step(t0: float, corr0: int) -> list[Event]:
    """A step with one line: an op, two kernels, a pinned HtoD copy and a sync."""
    return [
        ann("model.py:10", "forward", t0, 100),
        op("aten::add", t0 + 10, 50),
        launch("cudaLaunchKernel", t0 + 20, corr0),
        launch("cudaLaunchKernel", t0 + 30, corr0 + 1),
        launch("cudaMemcpyAsync", t0 + 40, corr0 + 2),
        launch("cudaStreamSynchronize", t0 + 70, corr0 + 3, dur=20.0),
        kernel("add", t0 + 25, 5.0, corr0),
        kernel("add", t0 + 35, 5.0, corr0 + 1),
        copy("Memcpy HtoD (Pinned -> Device)", t0 + 45, 10.0, corr0 + 2),
    ]


def test_counts_are_divided_by_the_number_of_steps() -> None:
    single = run(one_step(0, 1), steps=1)
    double = run(one_step(0, 1) + one_step(1000, 11), steps=2)
    assert single.kernels_per_step == 2 and double.kernels_per_step == 2
    for name in ("kernels_per_step", "launches_per_step", "ops_per_step", "syncs_per_step",
                 "sync_ms_per_step", "device_ms_per_step", "device_busy_ms_per_step",
                 "memcpy_per_step", "memcpy_ms_per_step"):
        assert getattr(double, name) == pytest.approx(getattr(single, name)), name
    assert double.top_ops_by_count == single.top_ops_by_count == [
        {"name": "aten::add", "per_step": 1.0}]
    one, two = line(single, "model.py:10"), line(double, "model.py:10")
    assert two.calls_per_step == 1 and two.kernels_per_step == 2 and two.memcpys_per_step == 1
    for name in ("calls_per_step", "ops_per_step", "kernels_per_step", "syncs_per_step",
                 "memcpys_per_step", "host_ms_per_step", "device_ms_per_step"):
        assert getattr(two, name) == pytest.approx(getattr(one, name)), name


def test_kernel_time_is_split_by_the_step_that_launched_it() -> None:
    """A kernel belongs to the step whose host range holds its launch, even when it runs after
    that range has closed (the device lags the host)."""
    late = kernel("add", 1005, 7.0, 99)  # runs inside step 2's span, launched in step 1
    events = [op("gpudiag.step", 0, 900, cat="user_annotation"),
              op("gpudiag.step", 1000, 900, cat="user_annotation"),
              *one_step(0, 1), *one_step(1000, 11), launch("cudaLaunchKernel", 80, 99), late]
    ev = run(events, steps=2)
    assert ev.device_ms_by_step == pytest.approx([0.017, 0.010])
    assert run(events, steps=2, backend="cpu").device_ms_by_step == []


def test_copy_bytes_and_every_line_are_counted_per_step() -> None:
    events = [*one_step(0, 1), *one_step(1000, 11),
              ann("loss.py:3", "check", 2000, 10), launch("cudaStreamSynchronize", 2001, 50)]
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            e["args"]["bytes"] = 4096
    ev = run(events, steps=2)
    assert ev.copy_bytes_per_step == {"HtoD": 4096}
    by_location = {c.location: c for c in ev.line_counts}
    assert list(by_location) == ["loss.py:3", "model.py:10"]
    assert by_location["loss.py:3"].syncs == 0.5 and by_location["loss.py:3"].ops == 0
    assert (by_location["model.py:10"].kernels, by_location["model.py:10"].copies) == (2, 1)


def test_synchronising_runtime_calls_are_counted_per_line() -> None:
    events = [
        ann("model.py:10", "forward", 0, 100),
        launch("cudaStreamSynchronize", 10, corr=1, dur=30.0),
        launch("cudaMemcpy", 50, corr=2, dur=10.0),  # the synchronous copy blocks too
        launch("cudaMemcpyAsync", 70, corr=3, dur=5.0),  # ... the asynchronous one does not
        op("aten::_local_scalar_dense", 80, 5),  # on a GPU the runtime call above is the sync
        launch("cudaDeviceSynchronize", 200, corr=4, dur=20.0),  # outside every line
    ]
    ev = run(events, steps=2)
    assert ev.syncs_per_step == 1.5
    assert ev.sync_ms_per_step == pytest.approx(0.030)  # (30 + 10 + 20) us over 2 steps
    assert line(ev, "model.py:10").syncs_per_step == 1.0


def test_a_sync_inside_a_library_is_counted_at_the_library_line_it_went_through() -> None:
    """HF Trainer's NaN check: `trainer.train()` is the user's line, the bool() of
    `torch.isnan(loss)` at transformers/trainer.py's line is where the host waits; on a GPU
    (a runtime sync) and on a CPU (a syncing operator) alike."""
    nan_check = "transformers/trainer.py:1847"
    through = op(annotation("train.py:38", "main", False, via=nan_check), 0, 100,
                 cat="user_annotation")
    events = [through, launch("cudaMemcpyAsync", 10, corr=1, dur=5.0),
              launch("cudaStreamSynchronize", 20, corr=2, dur=30.0),
              ann("train.py:38", "main", 200, 50),  # the model's own calls, no library line
              launch("cudaStreamSynchronize", 210, corr=3, dur=5.0)]
    (count,) = run(events, steps=2).line_counts
    assert count.syncs == 1.0 and count.sync_vias == {nan_check: 0.5}
    cpu = [through, op("aten::is_nonzero", 10, 20), op("aten::_local_scalar_dense", 12, 10)]
    assert run(cpu, backend="cpu").line_counts[0].sync_vias == {nan_check: 1.0}


def test_sync_idle_is_the_device_gap_after_each_sync() -> None:
    events = [
        kernel("a", 0, 50.0, corr=1),
        launch("cudaStreamSynchronize", 10, corr=2, dur=50.0),  # ends at 60, idle until 100
        kernel("b", 100, 50.0, corr=3),
        launch("cudaStreamSynchronize", 110, corr=4, dur=20.0),  # ends at 130: "b" still runs
        copy("Memcpy DtoH (Device -> Pinned)", 200, 10.0, corr=5),
        launch("cudaStreamSynchronize", 215, corr=6, dur=5.0),  # ends at 220, idle until 260
        kernel("c", 260, 10.0, corr=7),
        launch("cudaDeviceSynchronize", 300, corr=8, dur=5.0),  # after all device work
    ]
    ev = run(events, steps=2)
    assert ev.syncs_per_step == 2
    assert ev.sync_ms_per_step == pytest.approx(0.040)  # host time blocked: (50+20+5+5)/2
    assert ev.sync_idle_ms_per_step == pytest.approx(0.040)  # device idle: (40 + 40)/2
    assert run([launch("cudaStreamSynchronize", 0, corr=1)]).sync_idle_ms_per_step == 0


def test_sync_idle_counts_one_idle_gap_once() -> None:
    events = [kernel("a", 0, 10.0, corr=1),
              launch("cudaStreamSynchronize", 5, corr=2, dur=15.0),  # ends at 20
              launch("cudaDeviceSynchronize", 25, corr=3, dur=5.0),  # ends at 30
              kernel("b", 100, 10.0, corr=4)]
    ev = run(events, step_ms=0.110)
    assert ev.idle_fraction is not None
    idle_ms = ev.idle_fraction * 0.110  # 90 us between the kernels
    assert ev.sync_idle_ms_per_step <= idle_ms + 1e-9  # 80 + 70 us are counted


def test_syncing_operators_count_as_syncs_on_the_cpu() -> None:
    events = [
        ann("model.py:10", "forward", 0, 100),
        op("aten::item", 10, 20),
        op("aten::_local_scalar_dense", 12, 10),
        op("aten::nonzero", 40, 20),
        ann("model.py:11", "forward", 200, 20),
        op("aten::add", 205, 10),
    ]
    ev = run(events, backend="cpu")
    assert ev.syncs_per_step == 2 and ev.sync_ms_per_step == 0
    assert line(ev, "model.py:10").syncs_per_step == 2
    assert line(ev, "model.py:11").syncs_per_step == 0
    assert run(events, backend="cuda").syncs_per_step == 0


@pytest.mark.parametrize(("name", "kind"), [
    ("Memcpy HtoD (Pageable -> Device)", "HtoD-pageable"),
    ("Memcpy HtoD (Pinned -> Device)", "HtoD"),
    ("Memcpy DtoH (Device -> Pageable)", "DtoH-pageable"),
    ("Memcpy DtoH (Device -> Pinned)", "DtoH"),
    ("Memcpy DtoD (Device -> Device)", "DtoD"),
    ("Memcpy PtoP (Device -> Device)", "PtoP"),
    ("Memcpy HtoD", "HtoD"),
    ("Memset (Device)", "other"),
])
def test_memcpy_kind(name: str, kind: str) -> None:
    assert memcpy_kind(name) == kind


def test_copies_are_counted_and_timed_by_kind() -> None:
    events = [
        ann("data.py:5", "load", 0, 100),
        launch("cudaMemcpyAsync", 10, corr=1),
        launch("cudaMemcpyAsync", 20, corr=2),
        launch("cudaMemcpyAsync", 30, corr=3),
        copy("Memcpy HtoD (Pageable -> Device)", 100, 30.0, corr=1),
        copy("Memcpy HtoD (Pageable -> Device)", 140, 10.0, corr=2),
        copy("Memcpy DtoH (Device -> Pinned)", 160, 4.0, corr=3),
        kernel("memset", 170, 1.0, corr=4, cat="gpu_memset"),
    ]
    ev = run(events, steps=2)
    assert ev.memcpy_per_step == {"DtoH": 0.5, "HtoD-pageable": 1.0}
    assert ev.memcpy_ms_per_step == pytest.approx({"DtoH": 0.002, "HtoD-pageable": 0.020})
    assert ev.memset_per_step == 0.5
    assert ev.kernels_per_step == 0
    assert line(ev, "data.py:5").memcpys_per_step == 1.5
    assert ev.htod_overlap_fraction == 0.0  # no kernel ran during them


def test_htod_overlap_is_the_share_of_copy_time_under_a_kernel() -> None:
    events = [copy("Memcpy HtoD (Pinned -> Device)", 0, 20.0, corr=1),
              kernel("gemm", 10, 40.0, corr=2),
              copy("Memcpy DtoH (Device -> Pinned)", 100, 50.0, corr=3)]  # not an HtoD copy
    assert run(events).htod_overlap_fraction == pytest.approx(0.5)
    two = [*events, copy("Memcpy HtoD (Pinned -> Device)", 20, 20.0, corr=4)]  # all covered
    assert run(two).htod_overlap_fraction == pytest.approx(0.75)
    assert run([kernel("gemm", 10, 40.0, corr=2)]).htod_overlap_fraction is None


def test_idle_fraction_is_judged_against_the_timed_step() -> None:
    overlapping = [kernel("a", 0, 20.0, corr=1), kernel("b", 10, 20.0, corr=2)]
    ev = run(overlapping, step_ms=1.0, timed_step_ms=0.1)
    assert ev.device_ms_per_step == pytest.approx(0.040)  # kernel time: summed
    assert ev.device_busy_ms_per_step == pytest.approx(0.030)  # busy time: their union
    assert ev.idle_fraction == pytest.approx(0.7)
    assert ev.window_overhead == pytest.approx(10.0)
    # Without a timed step, the profiled step is the measure.
    assert run(overlapping, step_ms=1.0).idle_fraction == pytest.approx(0.97)
    # Copies keep the device busy too; a gap between them is idle.
    with_copy = [*overlapping, copy("Memcpy HtoD (Pinned -> Device)", 50, 10.0, corr=3)]
    assert run(with_copy, timed_step_ms=0.1).idle_fraction == pytest.approx(0.6)
    # Busier than the timed step (the window is slower): not idle, never negative.
    assert run(overlapping, timed_step_ms=0.02).idle_fraction == 0.0
    assert run([op("aten::add", 0, 10)]).idle_fraction is None


def test_nested_operators_are_counted_once() -> None:
    events = [
        op("aten::linear", 0, 50),
        op("aten::t", 1, 5),
        op("aten::transpose", 2, 3),
        op("aten::addmm", 10, 40),
        op("aten::linear", 60, 40),
        op("aten::addmm", 65, 30),
        op("aten::relu", 110, 10),
        op("aten::add", 0, 10, tid=2),  # another thread: top level there
    ]
    ev = run(events, backend="cpu")
    assert ev.ops_per_step == 4
    assert ev.top_ops_by_count[0] == {"name": "aten::linear", "per_step": 2}
    assert {o["name"] for o in ev.top_ops_by_count} == {"aten::linear", "aten::relu", "aten::add"}
    # Without kernels the top ops by time are operators by host time.
    assert ev.top_ops_by_time[0] == {"name": "aten::linear", "ms_per_step": pytest.approx(0.09)}


def test_matmul_time_is_split_by_the_dtype_the_line_computed_in() -> None:
    events = [
        ann("model.py:10", "forward", 0, 100, dtype="fp16"),
        op("aten::linear", 5, 90),
        op("aten::addmm", 10, 60),
        launch("cudaLaunchKernel", 20, corr=1),
        op("aten::relu", 75, 10),  # same line, not a matmul
        launch("cudaLaunchKernel", 80, corr=2),
        ann("model.py:20", "head", 200, 50, dtype="fp32"),
        op("aten::mm", 205, 40),
        launch("cudaLaunchKernel", 210, corr=3),
        op("aten::bmm", 300, 40),  # no annotation: the dtype is not known
        launch("cudaLaunchKernel", 310, corr=4),
    ]
    events += [kernel("gemm_fp16", 500, 50.0, corr=1), kernel("relu", 560, 5.0, corr=2),
               kernel("gemm_fp32", 600, 20.0, corr=3), kernel("gemm", 700, 8.0, corr=4)]
    ev = run(events)
    assert ev.matmul_ms_by_dtype == pytest.approx({"fp16": 0.050, "fp32": 0.020,
                                                   "unknown": 0.008})


def test_matmul_time_on_the_cpu_is_host_time_of_the_outermost_matmul() -> None:
    events = [ann("model.py:10", "forward", 0, 100, dtype="bf16"),
              op("aten::addmm", 10, 60),
              op("aten::mm", 20, 30),  # inside addmm: not counted again
              op("aten::relu", 75, 10)]
    assert run(events, backend="cpu").matmul_ms_by_dtype == pytest.approx({"bf16": 0.060})


def test_empty_cache_counts_cuda_free_calls() -> None:
    events = [launch("cudaFree", 0, corr=1, dur=10.0),
              launch("cudaFree", 100, corr=2, dur=20.0),
              launch("cudaFree", 1000, corr=3, dur=30.0),
              launch("cudaMalloc", 1100, corr=4, dur=30.0)]
    ev = run(events, steps=2)
    assert ev.empty_cache_per_step == 1.5
    assert ev.empty_cache_ms_per_step == pytest.approx(0.030)
    assert ev.syncs_per_step == 0 and ev.launches_per_step == 0


def test_events_that_are_not_complete_or_not_annotations_are_ignored() -> None:
    events = [
        {"ph": "i", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 0},
        op("ProfilerStep#1", 0, 1000, cat="user_annotation"),
        op("aten::add", 10, 10),
    ]
    ev = run(events, backend="cpu")
    assert ev.ops_per_step == 1 and ev.source_lines == []


# A real trace: a per-element Python loop, its backward, and one line that calls backward.

ROWS = 24
CALLS_PER_ROW = 3  # values[i] (__getitem__), * 2.0 (__mul__), out[i] = ... (__setitem__)


def fill_rows(values: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    out = torch.zeros(rows, width)
    for i in range(rows):
        out[i] = values[i] * 2.0  # the loop line
    return out


def _loop_line() -> int:
    source, first = inspect.getsourcelines(fill_rows)
    return first + next(i for i, text in enumerate(source) if "# the loop line" in text)


def _captured(step: Any, steps: int = 2) -> Evidence:
    window, events = capture_trace(step, device=torch.device("cpu"), steps=steps)
    assert len(window.step_ms) == steps
    return analyze(events, steps=steps, step_ms=statistics.fmean(window.step_ms), backend="cpu")


def test_real_trace_names_the_python_loop_line() -> None:
    weights = torch.randn(ROWS, 8, requires_grad=True)

    def step() -> None:
        loss = fill_rows(weights, ROWS, 8).sum()
        loss.backward()

    ev = _captured(step)
    hottest = ev.hottest_source_line()
    assert hottest is not None
    assert hottest.location.endswith(f"test_trace.py:{_loop_line()}"), ev.source_lines
    assert hottest.function == "fill_rows"
    assert hottest.in_loop
    assert hottest.direct_calls_per_step == ROWS * CALLS_PER_ROW
    assert hottest.calls_per_step == ROWS * CALLS_PER_ROW
    # Forward: select, mul, select, copy_ per row; backward adds the nodes of select and mul.
    assert hottest.ops_per_step >= 6 * ROWS
    assert ev.ops_per_step >= hottest.ops_per_step
    others = [s for s in ev.source_lines if s is not hottest]
    assert others and not any(s.in_loop for s in others)


def test_real_trace_charges_in_place_write_backward_to_the_loop_line() -> None:
    weights = torch.randn(ROWS, 8, requires_grad=True)

    def step() -> None:
        loss = fill_rows(weights, ROWS, 8).sum()
        loss.backward()  # the backward line

    ev = _captured(step, steps=1)
    source, first = inspect.getsourcelines(step)
    backward = first + next(i for i, t in enumerate(source) if "# the backward line" in t)
    lines = [s for s in ev.source_lines if s.location.endswith(f"test_trace.py:{backward}")]
    # Its own work is a handful of ops (ones_like, SumBackward0, AccumulateGrad), not per row.
    assert lines and lines[0].ops_per_step < ROWS, lines


def _mask_then_multiply(labels: torch.Tensor, w: torch.Tensor,
                        x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = labels == 1  # the mask line: no autograd node
    y = w * x  # the multiply line: creates MulBackward0
    return mask, y


def test_real_trace_charges_backward_to_the_op_that_created_the_node() -> None:
    labels = torch.randint(0, 2, (64,))
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)

    def step() -> None:
        _, y = _mask_then_multiply(labels, w, x)
        y.sum().backward()

    ev = _captured(step, steps=1)
    source, first = inspect.getsourcelines(_mask_then_multiply)
    mask_at = first + next(i for i, t in enumerate(source) if "# the mask line" in t)
    multiply_at = first + next(i for i, t in enumerate(source) if "# the multiply line" in t)
    by_line = {s.location.rpartition(":")[2]: s for s in ev.source_lines}
    assert by_line[str(mask_at)].ops_per_step == 1  # aten::eq only
    assert by_line[str(multiply_at)].ops_per_step == 2  # aten::mul and its MulBackward0


def nccl(ts: float, dur: float, corr: int) -> Event:
    return kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ts, dur, corr)


def test_exposed_collective_time_is_the_nccl_union_without_other_device_work() -> None:
    # The optimizer kernel was queued at t=50, before the all-reduce ended: it waited 40 us.
    events = [nccl(0, 100.0, corr=1), kernel("gemm", 20, 40.0, corr=2),
              kernel("adam", 100, 10.0, corr=3), launch("cudaLaunchKernel", 50, corr=3),
              op("c10d::allreduce_", 0, 5)]
    ev = run(events, step_ms=0.11)
    assert ev.collective_ms_per_step == pytest.approx(0.100)
    assert ev.collective_wall_ms_per_step == pytest.approx(0.100)
    assert ev.collective_exposed_ms_per_step == pytest.approx(0.060)
    assert ev.collective_overlap_fraction == pytest.approx(0.4)
    assert ev.compute_busy_ms_per_step == pytest.approx(0.050)
    assert ev.collective_share == pytest.approx(0.060 / 0.110)


def test_a_gap_the_host_had_not_filled_is_not_blamed_on_the_all_reduce() -> None:
    """Under the profiler the host runs slower: the next kernel, launched at t=90, could not
    have run before then whatever the all-reduce did; only 90..100 waited on it."""
    events = [nccl(0, 100.0, corr=1), kernel("gemm", 0, 20.0, corr=2),
              kernel("adam", 100, 10.0, corr=3), launch("cudaLaunchKernel", 90, corr=3),
              op("c10d::allreduce_", 0, 5)]
    assert run(events, step_ms=0.11).collective_exposed_ms_per_step == pytest.approx(0.010)


def test_collective_kernels_waiting_on_a_peer_never_make_a_share_above_one() -> None:
    """NCCL kernels on two streams spin side by side while a peer is late: their summed time
    is twice the step, yet the exposed share is a part of the window."""
    events = [nccl(0, 100.0, corr=1), {**nccl(0, 100.0, corr=2), "tid": 8},
              kernel("adam", 100, 10.0, corr=3), launch("cudaLaunchKernel", 0, corr=3),
              op("c10d::allreduce_", 0, 5)]
    ev = run(events, step_ms=0.05)
    assert ev.collective_ms_per_step == pytest.approx(0.200)
    assert ev.collective_share == pytest.approx(100 / 110)  # of the device's 110 us span


def test_collective_share_is_in_zero_one_for_any_trace() -> None:
    import random

    rng = random.Random(7)
    for _ in range(200):
        events: list[Event] = [op("c10d::allreduce_", 0, 1)]
        for corr in range(rng.randint(1, 12)):
            start, dur = rng.uniform(-50, 500), rng.uniform(0, 300)
            maker = nccl if rng.random() < 0.5 else (lambda t, d, c: kernel("gemm", t, d, c))
            events.append({**maker(start, dur, corr), "tid": rng.choice([7, 8, 9])})
        for backend in ("cuda", "cpu"):
            share = run(events, steps=rng.randint(1, 3), step_ms=rng.uniform(0.01, 1.0),
                        backend=backend).collective_share
            assert share is None or 0.0 <= share <= 1.0


def test_gloo_work_time_is_clipped_to_the_profiled_steps() -> None:
    events = [op("gpudiag.step", 0, 100, cat="user_annotation"),
              op("c10d::allreduce_", 10, 2),
              op("gloo:all_reduce", 60, 80, tid=9, cat="user_annotation")]
    ev = run(events, step_ms=0.1, backend="cpu")
    assert ev.collective_ms_per_step == pytest.approx(0.080)  # raw: waits for peers included
    assert ev.collective_wall_ms_per_step == pytest.approx(0.040)  # inside the step
    assert ev.collective_exposed_ms_per_step is None  # a CPU cannot tell waiting from transfer
    assert ev.collective_share == pytest.approx(0.4)


def test_installed_code_is_library_code_wherever_it_is_installed(tmp_path: Path) -> None:
    """site-packages, a `pip install --target` folder (a *.dist-info beside the package) and
    the standard library are libraries; the user's project, gpudiag's own workloads are not."""
    target = tmp_path / "target"
    (target / "acc-1.0.dist-info").mkdir(parents=True)
    (target / "acc").mkdir()
    installed = target / "acc" / "accelerator.py"
    installed.write_text("")
    project = tmp_path / "project" / "train.py"
    project.parent.mkdir()
    project.write_text("")
    assert is_library(str(installed)) and display_path(str(installed)) == "acc/accelerator.py"
    assert is_library(str(Path(json.__file__)))
    assert is_library("/venv/lib/python3.11/site-packages/transformers/trainer.py")
    assert not is_library(str(project))
    assert not is_library(str(Path(gpudiag.__file__).parent / "measure" / "models" / "dgca.py"))


@pytest.mark.parametrize("filename", ["<eval_with_key>.7",
                                      "/tmp/torchinductor_ada/xk/cxk4abc.py"])
def test_code_torch_generates_is_torchs_not_the_users(filename: str) -> None:
    # Compiled code's frames (FX graph modules, Inductor's wrappers) are torch's: a sample
    # there is charged to the user's line that called the compiled function.
    assert frame_role(filename) == "torch"
    assert frame_role("/home/ada/project/train.py") == "user"


def test_code_from_a_string_is_the_users_unless_python_or_dynamo_generated_it() -> None:
    """"<string>" is the file of every exec'd code: Dynamo's guards (torch's), dataclasses'
    methods (the standard library's), and the user's own (`python -c`)."""
    made: dict[str, Any] = {}
    exec(compile("def ___make_guard_fn():\n    def guard(L):\n        return True\n"
                 "    return guard\n", "<string>", "exec"), made)
    assert code_role(made["___make_guard_fn"].__code__) == "torch"
    assert code_role(made["___make_guard_fn"]().__code__) == "torch"

    @dataclasses.dataclass
    class Point:
        x: int

    generated = Point.__init__.__code__
    if generated.co_filename == "<string>" and sys.version_info >= (3, 11):
        assert code_role(generated) == "library"
    users: dict[str, Any] = {}
    exec(compile("def step():\n    return 1\n", "<string>", "exec"), users)
    assert code_role(users["step"].__code__) == "user"
    assert code_role(test_kernel_kinds.__code__) == "user"


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, float>", "softmax"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "norm"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float>>>", "reduction"),
    ("triton_red_fused__to_copy_add_mean_pow_0", "reduction"),
    ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", "elementwise"),
    ("triton_poi_fused_add_gelu_1", "elementwise"),
    ("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>",
     "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("some_custom_kernel", "other"),
    # cuDNN's convolutions and the layout transposes around them on NCHW tensors (names as
    # profilers print them: apache/mxnet#14684, kblomdahl/dream-go#25).
    ("sm80_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nchw_tilesize128x128x32",
     "convolution"),
    ("sm90_xmma_dgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64",
     "convolution"),
    ("sm80_xmma_wgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "convolution"),
    ("cutlass_80_tensorop_bf16_s16816fprop_optimized_bf16_128x128_32x3_nhwc_align8",
     "convolution"),
    ("volta_s884cudnn_fp16_128x128_ldg8_relu_exp_interior_nhwc_tn_v1", "convolution"),
    ("maxwell_scudnn_winograd_128x128_ldg1_ldg4_relu_tile418n_nt", "convolution"),
    ("void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1>",
     "convolution"),
    ("void at::native::im2col_kernel<float>(long, float const*, long)", "convolution"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float>",
     "layout"),
    ("void nhwcToNchwKernel<float, float, float, true, false>(int, int, int, int)", "layout"),
    ("void cudnn::detail::cubeTransposeDeviceGeneric_kernel<float, float, float, 8>",
     "layout"),
    # cuDNN's batch norms say "cudnn" (a norm, not a matmul); Inductor's pointwise kernels
    # after a convolution say "convolution" (elementwise).
    ("void cudnn::detail::bn_fw_inf_1C11_kernel_new<float, float, true, 1>", "norm"),
    ("void cudnn::bn_bw_1C11_kernel_new<__half, float, float2, 512, true, 1>", "norm"),
    ("void cudnn::batchnorm_fwtr_nhwc_semiPersist<__half, float, 512, true>", "norm"),
    ("triton_poi_fused_convolution_relu_0", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<convert_to_float>", "elementwise"),
])
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kernel_kind(name) == kind


@pytest.mark.parametrize(("name", "kind"), [
    ("aten::addmm", "matmul"), ("autograd::engine::evaluate_function: MmBackward0", "matmul"),
    ("aten::_softmax", "softmax"), ("aten::native_layer_norm", "norm"), ("aten::sum", "reduction"),
    ("aten::gelu", "elementwise"), ("aten::_foreach_add_", "optimizer"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::mkldnn_convolution", "convolution"),
    ("autograd::engine::evaluate_function: ConvolutionBackward0", "convolution"),
])
def test_cpu_operator_kinds(name: str, kind: str) -> None:
    assert op_kind(name) == kind


def test_kernel_time_is_split_by_kind_and_line() -> None:
    events = [
        ann("attn.py:30", "forward", 0, 100),
        launch("cudaLaunchKernel", 10, corr=1),  # scores = q @ k.T
        launch("cudaLaunchKernel", 20, corr=2),  # softmax
        ann("attn.py:31", "forward", 120, 30),
        launch("cudaLaunchKernel", 125, corr=3),  # a cast
        # The optimizer's per-parameter update: elementwise kernels, the optimizer's work.
        op("Optimizer.step#AdamW.step", 200, 100, cat="user_annotation"),
        launch("cudaLaunchKernel", 210, corr=4),
        kernel("sm90_xmma_gemm_bf16bf16", 400, 30.0, corr=1),
        kernel("softmax_warp_forward", 440, 50.0, corr=2),
        kernel("vectorized_elementwise_kernel<4, copy>", 500, 20.0, corr=3),
        kernel("vectorized_elementwise_kernel<4, mul>", 530, 10.0, corr=4),
    ]
    ev = run(events)
    assert ev.device_ms_by_kind == pytest.approx(
        {"matmul": 0.030, "softmax": 0.050, "elementwise": 0.020, "optimizer": 0.010})
    by_line = {c.location: c.kind_ms for c in ev.line_counts}
    assert by_line["attn.py:30"] == pytest.approx({"matmul": 0.030, "softmax": 0.050})
    assert by_line["attn.py:31"] == pytest.approx({"elementwise": 0.020})


def test_collective_calls_are_counted_by_kind_fsdp_and_ddp_alike() -> None:
    events = [op("c10d::_allgather_base_", 0, 10), op("c10d::_allgather_base_", 20, 10),
              op("c10d::_reduce_scatter_base_", 40, 10), op("c10d::allreduce_", 60, 10),
              op("_c10d_functional::all_gather_into_tensor", 80, 10)]
    ev = run(events, backend="cpu")
    assert ev.collective_calls_per_step == 5
    assert ev.collective_calls_by_kind == {"all_gather": 3, "reduce_scatter": 1,
                                           "all_reduce": 1}


@pytest.mark.parametrize("lazy", [True, False], ids=["torch-offers-lazy-modules", "it-does-not"])
def test_the_window_withholds_inductor_only_while_it_starts(
        monkeypatch: pytest.MonkeyPatch, lazy: bool) -> None:
    """Inductor not loaded: torch's lazy import of it is withheld while the profiler starts,
    and offered again after; a torch without `_lazy_modules` is left as it is."""
    from gpudiag.measure.evidence.profiler_window import _inductor_left_unloaded

    monkeypatch.delitem(sys.modules, "torch._inductor", raising=False)
    if lazy:
        monkeypatch.setattr(torch, "_lazy_modules", {"_dynamo", "_inductor"}, raising=False)
    else:
        monkeypatch.delattr(torch, "_lazy_modules", raising=False)
    with _inductor_left_unloaded():  # (vars: torch's own __getattr__ reads _lazy_modules)
        assert "_inductor" not in vars(torch).get("_lazy_modules", set())
    assert vars(torch).get("_lazy_modules") == ({"_dynamo", "_inductor"} if lazy else None)


def test_a_window_with_a_budget_profiles_no_step_past_it() -> None:
    """Up to `steps` steps, none begun once the closed and running ones took the budget (at
    least one is profiled); without a budget every step asked for (a user's --evidence-steps).
    The per-step evidence is the same for one step as for several: the counts are means."""
    weights = torch.randn(ROWS, 8, requires_grad=True)

    def step(pause_s: float) -> Any:
        def run() -> None:
            fill_rows(weights, ROWS, 8).sum().backward()
            time.sleep(pause_s)
        return run

    long_step, short_step = step(0.3), step(0.0)
    cut, events = capture_trace(long_step, device=torch.device("cpu"), steps=4, budget_s=0.5)
    assert len(cut.step_ms) == 2  # 0.3 s: another; 0.6 s: no more
    one, _ = capture_trace(long_step, device=torch.device("cpu"), steps=3, budget_s=0.1)
    assert len(one.step_ms) == 1
    whole, _ = capture_trace(long_step, device=torch.device("cpu"), steps=3, budget_s=None)
    assert len(whole.step_ms) == 3
    short, _ = capture_trace(short_step, device=torch.device("cpu"), steps=3, budget_s=0.5)
    assert len(short.step_ms) == 3
    ev = analyze(events, steps=2, step_ms=statistics.fmean(cut.step_ms), backend="cpu")
    assert ev.steps == 2
    hottest = ev.hottest_source_line()
    assert hottest is not None and hottest.direct_calls_per_step == ROWS * CALLS_PER_ROW


def test_a_scripts_window_is_read_in_gpudiags_process(tmp_path: Path) -> None:
    """The recorder leaves its window's trace in the parts folder; gpudiag's own process
    (which loads no torch) analyses it to the evidence the script would have made, with the
    loop test made where the script found its files, keeps the trace gzipped and the evidence
    beside the part, and reads that back later."""
    from gpudiag.measure.profile.launching.windows import window_evidence
    from gpudiag.model.profilepart import WindowTrace

    weights = torch.randn(ROWS, 8, requires_grad=True)

    def step() -> None:
        fill_rows(weights, ROWS, 8).sum().backward()

    window, events = capture_trace(step, device=torch.device("cpu"), steps=2)
    here = analyze(events, steps=2, step_ms=statistics.fmean(window.step_ms), backend="cpu")
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "window-7.trace.json").write_bytes(window.trace_json)
    kept = tmp_path / "profile-train.py.json.gz"
    trace = WindowTrace(trace="window-7.trace.json", steps=2,
                        step_ms=statistics.fmean(window.step_ms), backend="cpu",
                        timed_step_ms=None, roots=[str(Path(__file__).parent)],
                        attribution_note="a note", save_as=str(kept))
    there, not_kept = window_evidence(parts, 7, trace)
    assert there.attribution_note == "a note" and not_kept is None
    there.attribution_note = None
    assert there == here
    assert not (parts / "window-7.trace.json").exists()
    with gzip.open(kept) as f:
        assert json.load(f)["traceEvents"]
    assert window_evidence(parts, 7, trace)[0].line_counts == here.line_counts  # read back
    # A trace that cannot be kept (a full disk) is said; the evidence stands, and is read again.
    (parts / "window-8.trace.json").write_bytes(window.trace_json)
    unwritable = dataclasses.replace(trace, trace="window-8.trace.json",
                                     save_as=str(tmp_path / "no-such-folder" / "t.json.gz"))
    evidence, not_kept = window_evidence(parts, 8, unwritable)
    assert evidence.line_counts == here.line_counts
    assert not_kept is not None and not_kept.startswith("t.json.gz not written")
    assert (window_evidence(parts, 8, unwritable)[1] or "").startswith("t.json.gz not written")


@pytest.mark.slow
def test_the_ladders_windows_are_read_in_a_process_beside_it(tmp_path: Path) -> None:
    """A large window's trace goes to the reader process and comes back as the evidence an
    analysis here makes (a small one is read here at once); where that process has died, what
    it did not answer is read here; a stop abandons what it has not answered, saying why."""
    import os
    import signal

    from gpudiag.measure.evidence.reader import WindowReader
    from gpudiag.model.profilepart import WindowTrace

    weights = torch.randn(ROWS, 8, requires_grad=True)

    def step() -> None:
        fill_rows(weights, ROWS, 8).sum().backward()

    window, events = capture_trace(step, device=torch.device("cpu"), steps=2)
    here = analyze(events, steps=2, step_ms=statistics.fmean(window.step_ms), backend="cpu")
    trace = WindowTrace(trace="w.trace.json", steps=2, step_ms=statistics.fmean(window.step_ms),
                        backend="cpu", timed_step_ms=None,
                        save_as=str(tmp_path / "profile-w.json.gz"))

    def exported(reader: WindowReader, name: str) -> Path:
        path = reader.folder / name
        path.write_bytes(window.trace_json)
        return path

    reader = WindowReader(read_here_bytes=0)
    first = reader.read(exported(reader, "a.json"), trace)
    second = reader.read(exported(reader, "b.json"), trace)
    assert reader._process is not None and reader._process.pid != os.getpid()
    assert first.result().evidence == here and second.result().evidence == here
    with gzip.open(tmp_path / "profile-w.json.gz") as f:
        assert json.load(f)["traceEvents"]
    reader._process.kill()  # it dies: the next window is read here
    reader._process.wait()
    assert reader.read(exported(reader, "c.json"), trace).result().evidence == here
    folder = reader.folder
    reader.close()
    assert not folder.exists()

    small = WindowReader()  # the default: a tiny trace is read here, no process started
    assert small.read(exported(small, "d.json"), trace).result().evidence == here
    assert small._process is None
    small.close()
    alone = WindowReader(read_here_bytes=0)  # the last window: nothing after it to overlap
    assert alone.read(exported(alone, "g.json"), trace, last=True).result().evidence == here
    assert alone._process is None  # a one-stage run starts no reader
    alone.close()

    stopped = WindowReader(read_here_bytes=0)
    stopped.read(exported(stopped, "e.json"), trace)  # starts it
    assert stopped._process is not None
    os.kill(stopped._process.pid, signal.SIGSTOP)  # busy elsewhere: this one is not answered
    waiting = stopped.read(exported(stopped, "f.json"), trace)
    stopped.abandon("the run was interrupted")
    read = waiting.result()
    assert read.evidence is None and read.error == "the run was interrupted"
    assert stopped._process.returncode is not None
