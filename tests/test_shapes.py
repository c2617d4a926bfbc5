"""What each operator computes and moves (gpudiag/measure/evidence/shapes.py), fp32 islands
by line on recorded events and on a real CPU profiler window, and the busiest lines against
the roofline (gpudiag/diagnose/roofline.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpudiag.diagnose.roofline import roofline
from gpudiag.measure.evidence.profiler_window import collect_evidence
from gpudiag.measure.evidence.shapes import bytes_moved, compute_dtype, flops
from gpudiag.measure.evidence.trace import analyze
from gpudiag.model.results import LineCount
from gpudiag.present.markdown import render_markdown
from tests.test_rules import make_evidence, make_run, make_stage
from tests.test_trace import ann, kernel, launch, op


def shaped(name: str, types: list[str], dims: list[list[int]], ts: float = 0.0,
           dur: float = 10.0) -> dict[str, Any]:
    return op(name, ts, dur, **{"Input type": types, "Input Dims": dims})


def test_an_operator_computes_in_its_widest_floating_input() -> None:
    # A bf16 activation plus an fp32 mask is promoted to fp32; a 0-dim fp32 scalar is not.
    assert compute_dtype(shaped("aten::add", ["c10::BFloat16", "float"],
                                [[8, 8], [8, 8]])) == "fp32"
    assert compute_dtype(shaped("aten::mul", ["c10::BFloat16", "float"], [[8, 8], []])) == "bf16"
    assert compute_dtype(shaped("aten::add", ["long int", "long int"], [[4], [4]])) == ""
    assert compute_dtype(op("aten::add", 0, 1)) == ""  # shapes not recorded


def test_matmul_flops_and_bytes_come_from_the_shapes() -> None:
    mm = shaped("aten::mm", ["c10::Half", "c10::Half"], [[64, 32], [32, 16]])
    assert flops(mm) == 2 * 64 * 32 * 16
    assert bytes_moved(mm) == (64 * 32 + 32 * 16 + 64 * 16) * 2
    addmm = shaped("aten::addmm", ["float", "float", "float", "Scalar", "Scalar"],
                   [[16], [64, 32], [32, 16], [], []])
    assert flops(addmm) == 2 * 64 * 32 * 16
    bmm = shaped("aten::bmm", ["c10::BFloat16"] * 2, [[4, 8, 16], [4, 16, 8]])
    assert flops(bmm) == 2 * 4 * 8 * 16 * 8
    # The profiler's own count, where it made one, wins.
    recorded = op("aten::conv2d", 0, 1, flops=1234)
    assert flops(recorded) == 1234
    # Elementwise: inputs once, one output the size of the largest; in place: the first
    # input read and written.
    add = shaped("aten::add", ["float", "float"], [[100], [100]])
    assert flops(add) == 0 and bytes_moved(add) == 3 * 400
    assert bytes_moved(shaped("aten::add_", ["float", "float"], [[100], [100]])) == 3 * 400


def test_fp32_islands_are_the_kernels_of_operators_computing_in_fp32() -> None:
    """On a GPU: a kernel's time is its launching operator's; a promoted add and an fp32
    softmax are islands, a cast and a bf16 matmul are not."""
    events = [
        ann("attn.py:11", "forward", 0, 100),
        shaped("aten::bmm", ["c10::BFloat16"] * 2, [[4, 8, 16], [4, 16, 8]], ts=1, dur=20),
        launch("cudaLaunchKernel", 5, corr=1),
        ann("attn.py:12", "forward", 100, 100),
        shaped("aten::add", ["c10::BFloat16", "float"], [[4, 8, 8], [8, 8]], ts=101, dur=20),
        launch("cudaLaunchKernel", 105, corr=2),
        ann("attn.py:13", "forward", 200, 100),
        shaped("aten::_softmax", ["float", "Scalar", "Scalar"], [[4, 8, 8], [], []], ts=201,
               dur=20),
        launch("cudaLaunchKernel", 205, corr=3),
        shaped("aten::copy_", ["c10::BFloat16", "float"], [[4, 8, 8], [4, 8, 8]], ts=230,
               dur=20),
        launch("cudaLaunchKernel", 235, corr=4),
        # Autocast's way into the softmax's fp32: a copy into fp32 (inside its aten::to).
        ann("attn.py:14", "forward", 300, 100),
        op("aten::to", 301, 40),
        shaped("aten::copy_", ["float", "c10::BFloat16"], [[4, 8, 8], [4, 8, 8]], ts=302,
               dur=30),
        launch("cudaLaunchKernel", 305, corr=5),
        # A clone's copy is the clone's work: its bytes are counted once.
        shaped("aten::clone", ["c10::BFloat16"], [[4, 8, 8]], ts=350, dur=30),
        shaped("aten::copy_", ["c10::BFloat16", "c10::BFloat16"], [[4, 8, 8], [4, 8, 8]],
               ts=351, dur=20),
        launch("cudaLaunchKernel", 355, corr=6),
        kernel("sm90_xmma_gemm_bf16bf16", 400, 30.0, corr=1),
        kernel("vectorized_elementwise_kernel<add>", 440, 20.0, corr=2),
        kernel("cunn_SoftMaxForward<float>", 470, 40.0, corr=3),
        kernel("vectorized_elementwise_kernel<copy>", 520, 10.0, corr=4),
        kernel("vectorized_elementwise_kernel<copy>", 540, 15.0, corr=5),
        kernel("vectorized_elementwise_kernel<copy>", 560, 5.0, corr=6),
    ]
    ev = analyze(events, steps=1, step_ms=1.0, backend="cuda")
    counts = {c.location: c for c in ev.line_counts}
    assert counts["attn.py:11"].fp32_memory_bound_ms == 0
    assert counts["attn.py:11"].flops == 2 * 4 * 8 * 16 * 8
    assert counts["attn.py:12"].fp32_memory_bound_ms == pytest.approx(0.020)
    assert counts["attn.py:13"].fp32_memory_bound_ms == pytest.approx(0.040)  # not the cast
    assert counts["attn.py:14"].fp32_ms_by_kind == {"cast": pytest.approx(0.015)}  # upcast
    assert counts["attn.py:13"].fp32_ms_by_kind == {"softmax": pytest.approx(0.040)}
    elements = 4 * 8 * 8
    assert counts["attn.py:14"].bytes == elements * (4 + 2) + elements * 2 * 2


def test_a_real_cpu_window_names_the_promoted_add_and_its_softmax() -> None:
    """bf16 autocast on the CPU: scores plus an fp32 mask run in fp32, and so does the
    softmax after them; the matmuls run in bf16 with their FLOPs counted."""
    b, h, t, d = 2, 2, 64, 16
    q, k = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    mask = torch.zeros(t, t)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = q @ k.transpose(-1, -2)
            scores = scores + mask
            scores.softmax(-1).sum()

    ev = collect_evidence(step, device=torch.device("cpu"), steps=2, timed_step_ms=None)
    by_code = {c.location.rpartition(":")[2]: c for c in ev.line_counts
               if c.location.startswith("tests/test_shapes.py")}
    first = min(by_code, key=int)
    matmul, add, softmax = (by_code[str(int(first) + i)] for i in range(3))
    assert matmul.flops == 2 * b * h * t * d * t and matmul.fp32_memory_bound_ms == 0
    assert add.fp32_memory_bound_ms > 0 and softmax.fp32_memory_bound_ms > 0
    assert ev.matmul_ms_by_dtype.get("bf16", 0) > 0


def test_consecutive_memory_bound_operators_fuse_into_one_per_pass() -> None:
    """A real CPU window: mul, add, relu and softmax of a 64 x 256 fp32 tensor (and the sum
    after them, on the next line) run in a row, as does their backward: fused, each pass moves
    its largest operator's bytes (forward: a read and a write, 2 x 64 KiB; backward: the
    softmax's gradient, its output and the result, 3 x 64 KiB), a fraction of what they move
    one by one."""
    x = torch.randn(64, 256, requires_grad=True)

    def step() -> None:
        y = ((x * 2.0 + 1.0).relu()).softmax(-1)
        y.sum().backward()

    ev = collect_evidence(step, device=torch.device("cpu"), steps=2, timed_step_ms=None)
    mine = [c for c in ev.line_counts if c.location.startswith("tests/test_shapes.py")]
    tensor = 64 * 256 * 4
    assert sum(c.fused_memory_bytes for c in mine) == pytest.approx((2 + 3) * tensor)
    assert sum(c.memory_bytes for c in mine) > 3 * sum(c.fused_memory_bytes for c in mine)
    assert all(c.memory_bytes == c.bytes for c in mine)  # no matmul here


def test_a_matmul_or_a_new_step_ends_a_fused_run() -> None:
    """Two elementwise operators on either side of a matmul do not fuse; nor do the same
    operator in two steps."""
    elems = [[1024]]
    events = [
        ann("m.py:1", "forward", 0, 100),
        shaped("aten::add", ["float"], elems, ts=1, dur=5),
        shaped("aten::mm", ["float", "float"], [[32, 32], [32, 32]], ts=10, dur=5),
        shaped("aten::mul", ["float"], elems, ts=20, dur=5),
        shaped("aten::relu", ["float"], elems, ts=30, dur=5),
    ]
    ev = analyze(events, steps=1, step_ms=1.0, backend="cpu")
    (line,) = ev.line_counts
    # add alone (2 x 4 KiB); mul and relu fused (one of them: 2 x 4 KiB of their 4 x 4 KiB).
    assert line.memory_bytes == 6 * 4096 and line.fused_memory_bytes == 4 * 4096


def test_the_busiest_lines_are_held_against_their_roof() -> None:
    """On an H100 (datasheet bf16 989 TFLOP/s, 3,350 GB/s): a matmul line at 494.5 TFLOP/s is
    compute-bound at half its roof; a softmax line moving 1 GB in 1 ms is memory-bound at 30%."""
    lines = [LineCount("attn.py:11", "forward", kind_ms={"matmul": 2.0}, flops=989e9,
                       bytes=1e9),
             LineCount("attn.py:13", "forward", kind_ms={"softmax": 1.0}, bytes=1e9),
             # A compiled kernel's line: its time (Inductor's provenance), no shapes.
             LineCount("model.py:88", "forward", kind_ms={"elementwise": 0.5})]
    ev = make_evidence(line_counts=lines, matmul_ms_by_dtype={"bf16": 2.0},
                       device_ms_by_kind={"matmul": 2.0, "softmax": 1.0})
    run = make_run(make_stage("train", evidence=ev))
    run.env.gpu_name = "NVIDIA H100 80GB HBM3"
    found = roofline(run, run.stages[0])
    assert found is not None and found.dtype == "bf16" and found.source == "datasheet"
    matmul, softmax, compiled = found.lines
    assert compiled.gbps is None and compiled.bound is None and compiled.device_ms == 0.5
    assert matmul.bound == "compute" and matmul.of_roof == pytest.approx(0.5)
    assert matmul.flops_per_byte == pytest.approx(989.0)
    assert softmax.bound == "memory" and softmax.of_roof == pytest.approx(1000 / 3350)
    assert softmax.tflops is None
    report = render_markdown(run)
    assert "### Lines against the roofline: train" in report
    assert "| `attn.py:13` | 1.00 | - | 1,000 | - | memory | 30% |" in report
    # A device without known peaks: achieved rates only, no bound.
    run.env.gpu_name = "Some GPU"
    unknown = roofline(run, run.stages[0])
    assert unknown is not None and unknown.lines[0].bound is None
    assert "no peaks known for this device" in render_markdown(run)


def test_a_compiled_models_lines_have_no_matmul_roof() -> None:
    """Under torch.compile the annotator is off: matmul dtypes are unknown, so no matmul peak
    is assumed (not fp32's); the lines keep their device time."""
    ev = make_evidence(line_counts=[LineCount("model.py:88", "forward",
                                              kind_ms={"elementwise": 0.31})],
                       matmul_ms_by_dtype={"unknown": 2.0})
    run = make_run(make_stage("train", evidence=ev))
    run.env.gpu_name = "NVIDIA H100 80GB HBM3"
    found = roofline(run, run.stages[0])
    assert found is not None and found.dtype is None and found.peak_tflops is None
    assert [line.location for line in found.lines] == ["model.py:88"]
    assert "matmuls' dtype not recorded (a compiled model's)" in render_markdown(run)
