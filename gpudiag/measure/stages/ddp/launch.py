"""The ddp stage: launch its ranks with torch.distributed.run and merge their parts.

torch's own elastic launcher starts `--nproc` ranks on this node (`--standalone` on one node;
`--nnodes/--node-rank/--rdzv-endpoint` with the c10d rendezvous on several). Each rank writes
its part (worker.py); rank 0 gathers all of them, so node 0's run holds every rank and other
nodes' runs hold their own.

The merged stage: the step time of the job is, step by step, the slowest rank's; throughput
counts every rank's samples; scaling efficiency = throughput(N) / (N x single-device
throughput), the baseline measured by rank 0 alone at the same per-device batch.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gpudiag.measure.stages.ddp.worker import PARTS_FILE
from gpudiag.measure.stages.ladder import precision_of
from gpudiag.model.config import RunConfig
from gpudiag.model.results import (
    Evidence,
    StageResult,
    TelemetrySummary,
    TimingStats,
    from_jsonable,
)

CPU_DEFAULT_NPROC = 2
STRAGGLER_RATIO = 1.10  # a rank whose compute phases take this much longer than the fastest's


class LaunchError(RuntimeError):
    """The ranks failed; the message is the most telling line of their output."""


def default_nproc(config: RunConfig) -> int:
    if config.nproc:
        return config.nproc
    if config.is_cuda:
        return max(1, torch.cuda.device_count())
    return CPU_DEFAULT_NPROC


def launch_command(config: RunConfig, config_file: Path, out: Path) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run",
               "--nproc-per-node", str(default_nproc(config))]
    if config.nnodes > 1:
        command += ["--nnodes", str(config.nnodes), "--node-rank", str(config.node_rank),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", str(config.rdzv_endpoint)]
    else:
        command += ["--standalone", "--nnodes", "1"]
    return [*command, "-m", "gpudiag.measure.stages.ddp.worker", "--config", str(config_file),
            "--out", str(out)]


def _failure_line(log: str) -> str:
    """The exception line of the first rank that failed, else the log's last meaningful line."""
    lines = [re.sub(r"^\[(default)?\d+\]:", "", line).strip() for line in log.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("=", "*"))]
    for line in lines:
        if line.split(":")[0].endswith(("Error", "Exception")) and "ChildFailedError" not in line:
            return line
    return lines[-1] if lines else "the launcher exited without output"


def launch_ranks(config: RunConfig, work: Path) -> list[dict[str, Any]]:
    """Run the ranks; return every rank's part (this node's alone when not node 0)."""
    config_file = work / "config.json"
    config_file.write_text(json.dumps(config.to_dict()))
    out = work / "parts"
    log_path = work / "launch.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(launch_command(config, config_file, out), stdout=log,
                                   stderr=subprocess.STDOUT)
        try:
            code = process.wait()
        except KeyboardInterrupt:  # the ranks got Ctrl-C too; let them stop
            process.wait(timeout=60)
            raise
    parts_file = out / PARTS_FILE
    if code != 0 and not parts_file.is_file():
        log_text = log_path.read_text()
        tail = "\n".join(log_text.splitlines()[-40:])
        raise LaunchError(f"torch.distributed.run exited {code}: {_failure_line(log_text)}\n"
                          f"--- the launcher's output, last lines ---\n{tail}")
    if parts_file.is_file():
        # Rank 0 writes this only after every rank's results arrived: a rank that failed
        # later, on its way out, cost nothing measured.
        return list(json.loads(parts_file.read_text()))
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _variant_summary(parts: list[dict[str, Any]], index: int,
                     single_sps: float | None) -> dict[str, Any]:
    runs = [p["variants"][index] for p in parts]
    steps = [max(ts) for ts in zip(*(r["iter_ms"] for r in runs), strict=False)]
    ms = statistics.median(steps)
    world = parts[0]["world_size"]
    samples = runs[0]["samples_per_step"] * world
    sps = samples / ms * 1e3
    return {**runs[0]["variant"], "ms_per_iter": ms, "samples_per_s": sps,
            "scaling_efficiency": sps / (world * single_sps) if single_sps else None,
            "iter_ms": steps}


def _straggler(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank whose own compute (forward + optimizer, no collective waits) is slowest."""
    compute = {}
    for p in parts:
        phases = p["variants"][0]["phases_ms"]
        if "forward" in phases:
            compute[p["rank"]] = phases["forward"] + phases.get("optimizer", 0.0)
    if len(compute) < 2:
        return None
    slow = max(compute, key=compute.__getitem__)
    fast = min(compute.values())
    ratio = compute[slow] / fast if fast > 0 else 1.0
    return {"rank": slow, "compute_ms": compute[slow], "fastest_compute_ms": fast,
            "ratio": ratio, "is_straggler": ratio >= STRAGGLER_RATIO}


def job_exposed_ms(rank_evidence: list[dict[str, Any] | None]) -> float | None:
    """Exposed collective time per step of the job: the least any rank saw. A collective ends
    when the last rank arrives, so the last rank's exposed time is the transfer itself and every
    other rank's extra is waiting for it (in the profiled window, where ranks drift apart).
    It is device time, which the window's host instrumentation does not stretch. On a CPU,
    gloo's work time cannot tell transfer from waiting: None (the probe's transfer estimate
    stands in)."""
    exposed = [e.get("collective_exposed_ms_per_step") for e in rank_evidence if e]
    if not exposed or any(x is None for x in exposed):
        return None
    return min(x for x in exposed if x is not None)


def merge_parts(parts: list[dict[str, Any]], config: RunConfig, name: str,
                title: str) -> StageResult:
    parts = sorted(parts, key=lambda p: p["rank"])
    lead = parts[0]
    default = lead["variants"][0]
    single = lead.get("single")
    single_sps = single["samples_per_s"] if single else None
    summary = _variant_summary(parts, 0, single_sps)
    steps = summary.pop("iter_ms")
    stats = TimingStats.of(steps)
    evidence = (from_jsonable(Evidence, default["evidence"]) if default.get("evidence")
                else None)
    world = lead["world_size"]
    exposed_ms = job_exposed_ms([p["variants"][0].get("evidence") for p in parts])
    probe = lead.get("allreduce")
    rounds = (evidence.microsteps_with_collectives_per_step
              if evidence is not None and evidence.microsteps_per_step else None)
    # What the link needs to move one step's gradients, at the probe's measured bandwidth:
    # unlike profiled collective time, it does not include waiting for a slower peer.
    transfer_ms = (default["grad_bytes"] * (rounds or 1) / (probe["algbw_gbps"] * 1e9) * 1e3
                   if probe else None)
    ranks = []
    for p in parts:
        run = p["variants"][0]
        telemetry = run["telemetry"]
        rank_ev = run.get("evidence") or {}
        ranks.append({
            "rank": p["rank"], "node_rank": p["node_rank"], "host": p["host"],
            "device": p["device"], "gpu_name": p["gpu_name"],
            "ms_per_iter": run["ms_per_iter"], "phases_ms": run["phases_ms"],
            "power_mean_w": telemetry.get("power_mean_w"),
            "kernel_active_pct": telemetry.get("kernel_active_pct"),
            "collective_kernel_ms_per_step": rank_ev.get("collective_ms_per_step"),
            "exposed_comm_share": rank_ev.get("collective_share")
            if rank_ev.get("backend") == "cuda" else None,
            "collective_exposed_ms_per_step": rank_ev.get("collective_exposed_ms_per_step"),
            "compute_busy_ms_per_step": rank_ev.get("compute_busy_ms_per_step"),
            "collective_overlap_fraction": rank_ev.get("collective_overlap_fraction"),
            "peak_allocated_mib": run.get("peak_allocated_mib"),
        })
    details: dict[str, Any] = {
        "precision": precision_of(config.amp_dtype),
        "ddp": {
            "world_size": world, "nnodes": config.nnodes, "backend": lead["backend"],
            "per_device_batch": config.batch_size, "accum": config.ddp_accum,
            "no_sync": config.ddp_no_sync, "bucket_mb": default["variant"]["bucket_mb"],
            "grad_bytes_per_round": default["grad_bytes"],
            "single_device": None if single is None else {
                "ms_per_iter": single["ms_per_iter"], "samples_per_s": single_sps},
            "scaling_efficiency": summary["scaling_efficiency"],
            "allreduce_probe": lead.get("allreduce"),
            "collective_kernel_ms_per_step": None if evidence is None
            else evidence.collective_ms_per_step,
            "collective_overlap_fraction": None if evidence is None
            else evidence.collective_overlap_fraction,
            "exposed_comm_ms_per_step": exposed_ms,
            "exposed_comm_share": None if exposed_ms is None or not stats.median_ms
            else min(1.0, exposed_ms / stats.median_ms),
            "allreduce_rounds_per_step": rounds,
            "transfer_ms_per_step": transfer_ms,
            "straggler": _straggler(parts),
            "ranks": ranks,
        },
    }
    if len(lead["variants"]) > 1:
        details["ddp"]["sweep"] = [_variant_summary(parts, i, single_sps)
                                   for i in range(len(lead["variants"]))]
        for row in details["ddp"]["sweep"]:
            row.pop("iter_ms")
    samples_per_step = default["samples_per_step"] * world
    gpu = lead["gpu_name"] or "cpu"
    return StageResult(
        name=name, status="ok", title=title,
        workload=(f"{config.model}, DDP {world} x {gpu} ({lead['backend']}), per-device batch "
                  f"{config.batch_size}" + (f" x {config.ddp_accum} micro-steps"
                                            if config.ddp_accum > 1 else "")),
        ms_per_iter=stats.median_ms, samples_per_s=samples_per_step / stats.median_ms * 1e3,
        tokens_per_s=samples_per_step * config.seq_len / stats.median_ms * 1e3,
        samples_per_step=samples_per_step, tokens_per_step=samples_per_step * config.seq_len,
        iter_ms=steps, warmup_ms=default["warmup_ms"], timing=stats, timer=default["timer"],
        telemetry=from_jsonable(TelemetrySummary, default["telemetry"]),
        details=details, evidence=evidence,
    )


def run_ddp_stage(config: RunConfig, name: str, title: str) -> StageResult:
    with tempfile.TemporaryDirectory(prefix="gpudiag-ddp-") as tmp:
        parts = launch_ranks(config, Path(tmp))
    if not parts:
        raise LaunchError("no rank wrote its results")
    return merge_parts(parts, config, name, title)
