"""The peak stage: what this device can do, measured in a few seconds.

Dense square matmuls in fp32 (TF32 off), TF32, fp16 and bf16, and a large device-to-device copy
(bytes read plus written over time). These are the ceilings MFU is quoted against; the datasheet
figure, when the GPU is known, is recorded beside them. TF32 is switched for the fp32/tf32
measurements only and restored afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gpudiag.measure.stages.base import StageContext, launched_stage
from gpudiag.measure.timing import synchronize
from gpudiag.model.config import PEAK_STAGE
from gpudiag.model.facts import PeakFacts, StageFacts
from gpudiag.model.hardware import datasheet_tflops
from gpudiag.model.results import StageResult, TimingStats

TITLE = "device ceilings: dense matmul rate per dtype, copy bandwidth"
# On a CPU without native half-precision matmul (AVX2, AVX-512 without BF16/FP16) fp16 and
# bf16 run at ~1/50 of fp32: n=512 took 1.7 s a dtype for 1.2-1.3 GFLOPS, n=256 0.4 s for the
# same rate (fp32 65-69 GFLOPS at both; 2-core VM, one thread).
MATMUL_N = {"cuda": 8192, "cpu": 256}
COPY_BYTES = {"cuda": 2**30, "cpu": 2**26}
MIN_SECONDS = 0.3  # per measurement, after warm-up
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16}


def _timed(fn: Callable[[], object], device: torch.device) -> list[float]:
    """Milliseconds per call, over at least MIN_SECONDS after three warm-up calls."""
    for _ in range(3):
        fn()
    synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < MIN_SECONDS or len(times) < 5:
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def matmul_tflops(device: torch.device, name: str, n: int) -> tuple[float, list[float]]:
    a = torch.randn(n, n, device=device, dtype=DTYPES[name])
    b = torch.randn(n, n, device=device, dtype=DTYPES[name])
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
    try:
        times = _timed(lambda: torch.mm(a, b), device)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * n**3 / (TimingStats.of(times).median_ms / 1e3) / 1e12, times


def copy_gbps(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = _timed(lambda: dst.copy_(src), device)
    return 2 * nbytes / (TimingStats.of(times).median_ms / 1e3) / 1e9


@launched_stage(PEAK_STAGE, TITLE, role="ceiling")
def peak(ctx: StageContext) -> StageResult:
    device = ctx.device
    kind = "cuda" if device.type == "cuda" else "cpu"
    n = MATMUL_N[kind]
    rates, bf16_times = {}, []
    for name in DTYPES:
        rates[name], times = matmul_tflops(device, name, n)
        if name == "bf16":
            bf16_times = times
    gpu = torch.cuda.get_device_name(device) if kind == "cuda" else None
    facts = PeakFacts(
        matmul_n=n, matmul_tflops=rates, copy_gbps=copy_gbps(device, COPY_BYTES[kind]),
        copy_bytes=COPY_BYTES[kind],
        datasheet_tflops={name: datasheet_tflops(gpu, name) for name in DTYPES},
        # The matmul times stay in the facts: they are not training steps for rules to read.
        # The stage's time per iteration and its timing summary are of them
        # (StageResult.timed_ms).
        fastest_dtype=max(rates, key=rates.__getitem__), bf16_matmul_ms=bf16_times)
    if kind == "cuda":
        torch.cuda.empty_cache()
    return StageResult(
        name=PEAK_STAGE, status="ok", title=TITLE,
        workload=(f"{n}x{n} matmuls: " + ", ".join(f"{k} {v:,.1f}" for k, v in rates.items())
                  + f" TFLOP/s; copy {facts.copy_gbps:,.0f} GB/s"),
        timer="cuda-events" if kind == "cuda" else "host-clock", facts=StageFacts(peak=facts))
