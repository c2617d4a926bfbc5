"""One rank of the ddp stage. torch.distributed.run starts one per process (see launch.py).

Each rank: joins the process group (NCCL on GPUs, gloo on CPUs); rank 0 first times the plain
single-device step while the others wait (the scaling baseline, same per-device batch); then
every rank times the DDP step (and each sweep variant) under its own GPU's telemetry, profiles
a few steps for collective time and overlap, measures all-reduce bandwidth on a buffer of the
gradients' size, and writes its part. Rank 0 also gathers every rank's part, so a multi-node
run's node 0 holds the whole picture without a shared file system.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gc
import json
import math
import os
import socket
import statistics
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from gpudiag.measure.env import device_identity
from gpudiag.measure.evidence.profiler_window import collect_evidence
from gpudiag.measure.evidence.trace import MICROSTEP_RANGE
from gpudiag.measure.models import resolve_model
from gpudiag.measure.stages.base import StageContext
from gpudiag.measure.stages.ddp.probe import allreduce_probe
from gpudiag.measure.stages.ladder import LEARNING_RATE, WEIGHT_DECAY, train_step
from gpudiag.measure.telemetry import Sampler, open_sampler
from gpudiag.measure.timed_window import measure_window
from gpudiag.measure.timing import PhaseRecorder
from gpudiag.model.atomic import write_text_atomic
from gpudiag.model.config import RunConfig
from gpudiag.model.facts import DdpVariant
from gpudiag.model.results import TimingStats
from gpudiag.model.runfile import from_jsonable, to_jsonable

PARTS_FILE = "parts.json"
TIMEOUT = dt.timedelta(minutes=10)


def sweep_variants(base: DdpVariant) -> list[DdpVariant]:
    """The knobs that most often recover scaling, each changed alone from the base."""
    return [
        dataclasses.replace(base, name="bucket 100 MB", bucket_mb=100.0),
        dataclasses.replace(base, name="accumulate x4 (no_sync)", accum=4 * base.accum,
                            no_sync="correct"),
        dataclasses.replace(base, name="gradient_as_bucket_view", gradient_as_bucket_view=True),
        dataclasses.replace(base, name="static_graph", static_graph=True),
    ]


def ddp_step(ctx: StageContext, variant: DdpVariant) -> tuple[Callable[[], None], int]:
    """The fp16 training step under DDP, with `variant.accum` micro-steps per optimizer step;
    returns it with the gradient bytes all-reduced per round."""
    bundle = ctx.bundle()
    batch = ctx.batch(bundle)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    model = DistributedDataParallel(
        bundle.model, device_ids=device_ids, bucket_cap_mb=variant.bucket_mb,
        gradient_as_bucket_view=variant.gradient_as_bucket_view,
        static_graph=variant.static_graph)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=ctx.amp_dtype == torch.float16)
    phase = ctx.phases.phase
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def forward_backward() -> None:
        with phase("forward"), ctx.autocast():
            loss = bundle.loss(model(**batch)) / variant.accum
        with phase("backward"):
            scaler.scale(loss).backward()

    def micro_step(last: bool) -> None:
        skip_sync = nullcontext() if last else model.no_sync()
        with record_function(MICROSTEP_RANGE):
            if variant.no_sync == "correct":
                with skip_sync:
                    forward_backward()
                return
            # The seed's mistake: no_sync around the backward only. DDP decides at forward
            # time whether the coming backward reduces, so every micro-step still all-reduces.
            with phase("forward"), ctx.autocast():
                loss = bundle.loss(model(**batch)) / variant.accum
            with skip_sync, phase("backward"):
                scaler.scale(loss).backward()

    def step() -> None:
        for k in range(variant.accum):
            micro_step(last=k == variant.accum - 1)
        with phase("optimizer"):
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

    return step, grad_bytes


def _agreed_steps(config: RunConfig) -> Callable[[list[float]], int]:
    """Timed steps: at least --iters and --min-seconds, decided by rank 0 for every rank (all
    ranks must run the same number of collectives)."""

    def decide(warm_ms: list[float]) -> int:
        wanted = config.iters
        if warm_ms and config.min_seconds:
            wanted = max(wanted,
                         math.ceil(config.min_seconds * 1e3 / statistics.median(warm_ms)))
        decision = [wanted]
        dist.broadcast_object_list(decision, src=0)
        return int(decision[0])

    return decide


def _phase_medians(phases: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ms) for name, ms in phases.items() if ms}


def time_single(ctx: StageContext, sampler: Sampler) -> dict[str, Any]:
    """The plain fp16 step on this device alone: the scaling baseline."""
    bundle = ctx.bundle()
    batch = ctx.batch(bundle)
    step = train_step(ctx, bundle, lambda: batch, amp=True)
    window = measure_window(step, device=ctx.device, sampler=sampler, phases=ctx.phases,
                            label="single device", warmup=ctx.config.warmup,
                            iters=ctx.config.iters, min_seconds=ctx.config.min_seconds)
    ms = statistics.median(window.iter_ms)
    return {"iter_ms": window.iter_ms, "ms_per_iter": ms,
            "samples_per_s": ctx.config.batch_size / ms * 1e3}


def run_variant(ctx: StageContext, variant: DdpVariant, sampler: Sampler,
                evidence_steps: int) -> dict[str, Any]:
    _reset_peak_resident()
    step, grad_bytes = ddp_step(ctx, variant)
    window = measure_window(step, device=ctx.device, sampler=sampler, phases=ctx.phases,
                            label=f"ddp {variant.name}", warmup=max(1, ctx.config.warmup),
                            iters=_agreed_steps(ctx.config))
    part: dict[str, Any] = {
        "variant": dataclasses.asdict(variant), "iter_ms": window.iter_ms,
        "warmup_ms": window.warmup_ms, "timer": window.timer,
        "ms_per_iter": TimingStats.of(window.iter_ms).median_ms,
        "samples_per_step": ctx.config.batch_size * variant.accum,
        "phases_ms": _phase_medians(window.phases_ms), "telemetry": to_jsonable(window.telemetry),
        "grad_bytes": grad_bytes,
        "peak_allocated_mib": None if window.memory is None else window.memory.peak_allocated_mib,
        "peak_reserved_mib": None if window.memory is None else window.memory.peak_reserved_mib,
        "device_total_mib": None if window.memory is None else window.memory.device_total_mib,
        "peak_resident_mib": _peak_resident_mib(),
    }
    if evidence_steps:
        evidence = collect_evidence(step, device=ctx.device, steps=evidence_steps,
                                    timed_step_ms=TimingStats.of(window.iter_ms).p25_ms)
        part["evidence"] = to_jsonable(evidence)
    return part


_STATUS, _CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _reset_peak_resident() -> None:
    """Linux: the process's peak resident set (VmHWM) starts again from what it holds now
    (clear_refs' 5), so a rank's peak is its variant's steps', not rank 0's single-device
    baseline's nor its imports'. Elsewhere nothing to reset: the peak is not read."""
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")


def _peak_resident_mib() -> float | None:
    """The process's resident set at its highest since the last reset (Linux's VmHWM, in
    KiB); None where /proc does not say (a CPU rank's memory then goes unmeasured)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def _release(device: torch.device) -> None:
    gc.collect()
    gc.freeze()  # what survived is the rank's own (as in runner._collector_sees_only_the_stages)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_rank(config: RunConfig, out: Path) -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    # The rank's imports (torch, Dynamo: 400,000 objects) leave the cyclic collector's view:
    # each collection between variants then walks what the variants made (0.3 s otherwise).
    gc.freeze()
    cuda = config.device.startswith("cuda")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT,
                            device_id=device if cuda else None)
    config = dataclasses.replace(config, device=str(device))
    ctx = StageContext(config=config, device=device, spec=resolve_model(config.model),
                       phases=PhaseRecorder(device))
    uuid = None
    if cuda:
        uuid, _ = device_identity(device)
    sampler = open_sampler(device.type, uuid, local_rank, period_s=config.sample_period_s,
                           gpm_period_s=config.gpm_period_s)
    base = DdpVariant("default", accum=config.ddp_accum, no_sync=config.ddp_no_sync)
    variants = [base, *(sweep_variants(base) if config.ddp_sweep else [])]
    part: dict[str, Any] = {
        "rank": rank, "local_rank": local_rank, "node_rank": config.node_rank,
        "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "host": socket.gethostname(), "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if cuda else None,
    }
    with sampler:
        sampler.wait_ready()
        if rank == 0:
            part["single"] = time_single(ctx, sampler)
            _release(device)
        dist.barrier()
        part["variants"] = []
        for i, variant in enumerate(variants):
            steps = config.evidence_steps if i == 0 else 0
            part["variants"].append(run_variant(ctx, variant, sampler, steps))
            _release(device)  # the next variant builds its own model
    part["allreduce"] = allreduce_probe(part["variants"][0]["grad_bytes"], device)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"rank-{rank}.json", json.dumps(part))
    parts: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    if rank == 0:
        write_text_atomic(out / PARTS_FILE, json.dumps(parts))
    # Leave together: a rank that tears its gloo pairs down while a peer still talks to it
    # makes that peer abort (SIGABRT, seen on the CPU about one run in three).
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of gpudiag's ddp stage")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    config = from_jsonable(RunConfig, json.loads(args.config.read_text()))
    run_rank(config, args.out)
    # Everything is written: skip interpreter teardown, where the profiler's and the process
    # group's native threads have aborted a rank now and then (SIGABRT after a clean run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
