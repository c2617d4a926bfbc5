"""DDP rules: scaling that falls short, with its measured cause, and gradient accumulation that
still all-reduces every micro-step (SEEDS.md section 1: two GPUs slower than one)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from gpudiag.results import RunResult, StageResult
from gpudiag.rules.common import pct
from gpudiag.rules.registry import Draft, Threshold, rule, severity_for

POOR_EFFICIENCY = 0.80
CRITICAL_EFFICIENCY = 0.50  # below this, N devices barely beat one (two: slower than one)
COMM_EXPLAINS = 0.5  # communication explains the loss when it is at least half the added time
NO_OVERLAP = 0.3  # NCCL time beside compute below this share: the all-reduce is not hidden
SMALL_STEP_MS = 25.0  # a single-device step this short is dominated by fixed per-step costs
TARGET_EFFICIENCY = 0.9


def _ddp(stage: StageResult) -> dict[str, Any] | None:
    info = stage.details.get("ddp")
    return info if isinstance(info, dict) else None


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.0f} KB"


def _sweep_line(info: dict[str, Any]) -> str:
    rows = [r for r in info.get("sweep", [])[1:] if r.get("scaling_efficiency") is not None]
    if not rows:
        return ""
    best = max(rows, key=lambda r: r["scaling_efficiency"])
    measured = ", ".join(f"{r['name']} {r['scaling_efficiency']:.0%}" for r in rows)
    return f" The sweep measured: {measured}; best: {best['name']}."


def scaling_cause(stage: StageResult, info: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(cause, fix, evidence) for a stage whose scaling fell short, from what its ranks
    measured: a straggler, communication the link cannot hide, or a step too short for
    fixed per-step costs; otherwise the added time is reported as unexplained."""
    step = stage.ms_per_iter or 0.0
    single = (info.get("single_device") or {}).get("ms_per_iter") or 0.0
    accum = info.get("accum") or 1
    added = max(0.0, step - single * accum)
    transfer = info.get("transfer_ms_per_step")
    exposed = info.get("collective_exposed_ms_per_step")
    overlap = info.get("collective_overlap_fraction")
    comm = exposed if exposed is not None else transfer
    probe = info.get("allreduce_probe") or {}
    grad = info.get("grad_bytes_per_round") or 0
    evidence = {"step_ms": round(step, 2), "single_device_step_ms": round(single, 2),
                "added_ms_per_step": round(added, 2),
                "grad_bytes_per_round": grad,
                "transfer_ms_per_step": None if transfer is None else round(transfer, 2),
                "collective_exposed_ms_per_step": None if exposed is None else round(exposed, 2),
                "collective_overlap_fraction": None if overlap is None else round(overlap, 3),
                "busbw_gbps": None if not probe else round(probe["busbw_gbps"], 2),
                "comm_share": None if comm is None or not step else round(comm / step, 3)}
    straggler = info.get("straggler") or {}
    if straggler.get("is_straggler"):
        return ("a straggler", (
            f"rank {straggler['rank']} computes {straggler['ratio']:.2f}x slower than the "
            "fastest rank and every all-reduce waits for it: check that rank's GPU (clocks, "
            "throttling, another process on it), its data loading, and any work only it does "
            "(evaluation, logging, checkpoint saves on rank 0: move them off the step, or make "
            "the others do useful work meanwhile)."), {**evidence, "straggler": straggler})
    if comm is not None and added > 0 and comm >= COMM_EXPLAINS * added:
        compute = max(step - comm, 1e-6)
        # Accumulating k micro-steps under no_sync shares one all-reduce among k batches.
        k = max(2, math.ceil(TARGET_EFFICIENCY / (1 - TARGET_EFFICIENCY) * comm / compute))
        link = (f"{_mb(grad)} of gradients per step over a link measured at "
                f"{probe.get('busbw_gbps', 0):.1f} GB/s bus bandwidth take {comm:.1f} ms")
        hidden = ("" if overlap is None or overlap >= NO_OVERLAP else
                  f"; only {overlap:.0%} of the all-reduce runs beside compute (bucket_cap_mb "
                  "smaller to start reducing earlier, or static_graph=True)")
        return ("communication", (
            f"{link} of a {step:.1f} ms step{hidden}. Move fewer bytes per sample: raise the "
            f"per-GPU batch, or accumulate >= {k} micro-steps per optimizer step with "
            "model.no_sync() around forward and backward of all but the last; compress "
            "gradients to fp16/bf16 with a DDP comm hook (register_comm_hook(None, "
            "default_hooks.fp16_compress_hook)); use a faster interconnect (NVLink, "
            "InfiniBand; check NCCL_P2P_DISABLE, NCCL_SHM_DISABLE, NCCL_IB_DISABLE are unset)."
            + _sweep_line(info)), evidence)
    if single and single < SMALL_STEP_MS:
        return ("per-device batch too small", (
            f"a {single:.1f} ms single-device step at per-device batch "
            f"{info.get('per_device_batch')} is too short for the fixed costs of each "
            f"distributed step ({added:.1f} ms added: all-reduce latency, synchronisation, "
            "host work): raise the per-device batch, or accumulate micro-steps under "
            "model.no_sync() (forward and backward inside)." + _sweep_line(info)), evidence)
    return ("unexplained overhead", (
        f"{added:.1f} ms per step are added by going distributed and neither communication "
        "nor a straggler explains them: look at host contention (ranks sharing CPU cores, "
        "OMP_NUM_THREADS), find_unused_parameters=True (a graph walk every step), and "
        "whether the ranks' GPUs share a PCIe switch." + _sweep_line(info)), evidence)


@rule(
    "GD801", "ddp-poor-scaling", concern="ddp",
    summary="DDP throughput falls short of N x one device's, with the measured cause.",
    why=("Data parallelism pays when each device's compute hides the gradient all-reduce. "
         "When the link is slow for the gradient bytes, the per-device batch is small, or one "
         "rank lags, adding devices adds little or even slows training (SEEDS.md section 1: "
         "two GPUs at 1.5 it/s against one at 2.2)."),
    fix=("Fix the measured cause: fewer bytes per sample (larger per-device batch, "
         "accumulation under no_sync, fp16 gradient compression), a faster interconnect, or "
         "the straggler's problem."),
    thresholds=(Threshold("poor_efficiency", POOR_EFFICIENCY, "scaling efficiency: warning"),
                Threshold("critical_efficiency", CRITICAL_EFFICIENCY,
                          "scaling efficiency: critical"),
                Threshold("comm_explains", COMM_EXPLAINS,
                          "communication's share of the added time that names it the cause"),
                Threshold("small_step_ms", SMALL_STEP_MS,
                          "single-device step below which fixed costs dominate")),
    references=("https://pytorch.org/docs/stable/notes/ddp.html",
                "REFERENCE.md: BERT-base fp16 on two H200s, 91% over NVLink, 25% over sockets"),
)
def ddp_poor_scaling(run: RunResult) -> Iterator[Draft]:
    """Efficiency = throughput(N) / (N x single-device throughput), the baseline timed by rank
    0 alone at the same per-device batch. Under 80% it names the cause, in order: a rank
    whose own compute is >= 10% slower; communication (exposed NCCL time, or on CPUs the time
    the measured all-reduce bandwidth needs for the gradients) covering half the added time; a
    single-device step under 25 ms; else the overhead is reported as unexplained."""
    for stage in run.ok_stages():
        info = _ddp(stage)
        if info is None or info.get("world_size", 1) < 2:
            continue
        efficiency = info.get("scaling_efficiency")
        if efficiency is None or efficiency >= POOR_EFFICIENCY:
            continue
        cause, fix, evidence = scaling_cause(stage, info)
        world = info["world_size"]
        single_sps = (info.get("single_device") or {}).get("samples_per_s") or 0.0
        yield Draft(
            severity="critical" if efficiency < CRITICAL_EFFICIENCY else "warning",
            stage=stage.name,
            title=(f"{world} devices reach {efficiency:.0%} scaling efficiency "
                   f"({stage.samples_per_s or 0:,.0f} samples/s vs {world} x "
                   f"{single_sps:,.0f}): {cause}"),
            evidence={"scaling_efficiency": round(efficiency, 3), "world_size": world,
                      "cause": cause, **evidence},
            impact=min(1.0, 1 - efficiency), fix=fix)


@rule(
    "GD802", "ddp-no-sync-misuse", concern="ddp",
    summary="Gradient accumulation that all-reduces on every micro-step, not once per update.",
    why=("DDP decides in forward whether the coming backward all-reduces. `no_sync()` around "
         "the backward alone (or not at all) leaves every micro-step reducing the full "
         "gradients, multiplying communication by the accumulation factor; the seed's project "
         "did exactly this."),
    fix=("Put forward and backward of every micro-step but the last inside model.no_sync(): "
         "`ctx = model.no_sync() if not last else nullcontext(); with ctx: loss = ...; "
         "loss.backward()`."),
    thresholds=(Threshold("max_rounds_per_update", 1, "all-reduce rounds per optimizer step"),),
    references=("https://pytorch.org/docs/stable/generated/"
                "torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel."
                "DistributedDataParallel.no_sync",),
)
def ddp_no_sync_misuse(run: RunResult) -> Iterator[Draft]:
    """From the profiler window: accumulation micro-steps per optimizer step (ranges marked
    gpudiag.microstep) and how many of them issued a collective. More than one reducing
    micro-step per update is the misuse; its price is the extra rounds' transfer time."""
    for stage in run.ok_stages():
        ev = stage.evidence
        if ev is None or ev.microsteps_per_step <= 1:
            continue
        rounds = ev.microsteps_with_collectives_per_step
        if rounds <= 1:
            continue
        info = _ddp(stage) or {}
        transfer = info.get("transfer_ms_per_step")
        step = stage.ms_per_iter or ev.step_ms
        wasted = transfer * (rounds - 1) / rounds if transfer else None
        share = min(1.0, wasted / step) if wasted and step else (rounds - 1) / rounds * 0.1
        yield Draft(
            severity=severity_for(share, warning=0.0), stage=stage.name,
            title=(f"Gradient accumulation all-reduces on {rounds:.0f} of "
                   f"{ev.microsteps_per_step:.0f} micro-steps per optimizer step: no_sync is "
                   "missing or wraps only the backward"),
            evidence={"microsteps_per_step": ev.microsteps_per_step,
                      "reducing_microsteps_per_step": rounds,
                      "collective_calls_per_step": ev.collective_calls_per_step,
                      "wasted_transfer_ms_per_step": None if wasted is None
                      else round(wasted, 2),
                      "no_sync": info.get("no_sync")},
            impact=share,
            fix=("Wrap forward and backward of all micro-steps but the last in "
                 "model.no_sync(); one all-reduce per optimizer step then carries the "
                 f"accumulated gradients ({pct(1 - 1 / rounds)} fewer rounds)."))


COMM_BOUND_SHARE = 0.30


@rule(
    "GD803", "collective-bound-step", concern="ddp",
    summary="Collectives (DDP's all-reduce) take a large share of each step of a profiled run.",
    why=("Without a single-device baseline (a profiled script), the profiler window still shows "
         "how much of the step the gradient all-reduce holds the step: NCCL time with no "
         "compute beside it on a GPU, the process group's work time on a CPU. A large share "
         "means the per-device batch is too small for the link, or the link is slow."),
    fix=("Raise the per-device batch or accumulate micro-steps under model.no_sync(); compress "
         "gradients (fp16_compress_hook); check the interconnect (NVLink/IB, NCCL_* variables)."),
    thresholds=(Threshold("share", COMM_BOUND_SHARE, "collective time over the step"),),
    references=("https://pytorch.org/docs/stable/ddp_comm_hooks.html",),
)
def collective_bound_step(run: RunResult) -> Iterator[Draft]:
    """Stages with profiler evidence but no ddp-stage details (those get ddp-poor-scaling):
    exposed NCCL time (GPU) or gloo work time (CPU, which includes waiting for peers) over the
    timed step; warning from 30%."""
    for stage in run.ok_stages():
        ev = stage.evidence
        if ev is None or _ddp(stage) is not None or not ev.collective_calls_per_step:
            continue
        step = stage.ms_per_iter or ev.step_ms
        comm = (ev.collective_exposed_ms_per_step if ev.backend == "cuda"
                else ev.collective_ms_per_step)
        if not comm or not step or comm / step < COMM_BOUND_SHARE:
            continue
        share = min(1.0, comm / step)
        measured = ("NCCL time with no compute beside it" if ev.backend == "cuda" else
                    "the process group's work time, waits for peers included")
        yield Draft(
            severity="warning", stage=stage.name,
            title=(f"Collectives take {share:.0%} of each step ({comm:.1f} of {step:.1f} ms, "
                   f"{ev.collective_calls_per_step:.0f} calls per step): communication-bound"),
            evidence={"collective_ms_per_step": round(comm, 2), "step_ms": round(step, 2),
                      "share": round(share, 3),
                      "collective_calls_per_step": ev.collective_calls_per_step,
                      "measured_as": measured,
                      "samples_per_step": stage.samples_per_step},
            impact=share,
            fix=("Give each all-reduce more work: raise the per-device batch (now "
                 f"{stage.samples_per_step or 'unknown'}), or accumulate micro-steps with "
                 "model.no_sync() around forward and backward of all but the last; compress "
                 "gradients with register_comm_hook(None, default_hooks.fp16_compress_hook); "
                 "check the interconnect (NVLink/InfiniBand, NCCL_P2P_DISABLE/SHM_DISABLE)."))
