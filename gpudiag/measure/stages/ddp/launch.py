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

import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gpudiag.measure.childexec import child_command
from gpudiag.measure.interrupts import stop_error, wait_child
from gpudiag.measure.stages.ddp.worker import PARTS_FILE
from gpudiag.measure.stages.ladder import precision_of
from gpudiag.measure.timed_window import Window, fill_timed
from gpudiag.model.atomic import fresh_stream, write_text_atomic
from gpudiag.model.config import RunConfig
from gpudiag.model.facts import (
    DdpFacts,
    DdpVariant,
    LinkProbe,
    RankFacts,
    SingleDevice,
    StageFacts,
    Straggler,
)
from gpudiag.model.results import Evidence, MemoryStats, StageResult, TelemetrySummary
from gpudiag.model.runfile import from_jsonable, to_jsonable

CPU_DEFAULT_NPROC = 2


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
    write_text_atomic(config_file, json.dumps(to_jsonable(config)))
    out = work / "parts"
    log_path = work / "launch.log"
    with fresh_stream(log_path) as log:
        process = subprocess.Popen(child_command(launch_command(config, config_file, out)),
                                   stdout=log,
                                   stderr=subprocess.STDOUT)
        # torchrun passes a SIGINT/SIGTERM on to its ranks and waits for them.
        code, stopped_by = wait_child(process)
        if stopped_by is not None:
            raise stop_error(stopped_by)
    parts_file = out / PARTS_FILE
    # Every rank of this node wrote its results before the one that failed went: a gloo pair
    # torn down under a peer aborted it on its way out (SIGABRT, rank 0 in a CPU CI run), and
    # nothing measured was lost.
    whole = len(list(out.glob("rank-*.json"))) >= default_nproc(config)
    if code != 0 and not parts_file.is_file() and not whole:
        log_text = log_path.read_text()
        tail = "\n".join(log_text.splitlines()[-40:])
        raise LaunchError(f"torch.distributed.run exited {code}: {_failure_line(log_text)}\n"
                          f"--- the launcher's output, last lines ---\n{tail}")
    if parts_file.is_file():
        # Rank 0 writes this only after every rank's results arrived: a rank that failed
        # later, on its way out, cost nothing measured.
        return list(json.loads(parts_file.read_text()))
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def _variant_summary(parts: list[dict[str, Any]], index: int,
                     single_sps: float | None) -> tuple[DdpVariant, list[float]]:
    """The job's result for one variant, and its step times: step by step the slowest rank's."""
    runs = [p["variants"][index] for p in parts]
    steps = [max(ts) for ts in zip(*(r["iter_ms"] for r in runs), strict=False)]
    ms = statistics.median(steps)
    world = parts[0]["world_size"]
    sps = runs[0]["samples_per_step"] * world / ms * 1e3
    variant = from_jsonable(DdpVariant, runs[0]["variant"])
    return dataclasses.replace(
        variant, ms_per_iter=ms, samples_per_s=sps,
        scaling_efficiency=sps / (world * single_sps) if single_sps else None), steps


def _straggler(parts: list[dict[str, Any]]) -> Straggler | None:
    """The rank whose own compute (forward + optimizer, no collective waits) is slowest; the
    rules decide whether it is slow enough to name."""
    compute = {}
    for p in parts:
        phases = p["variants"][0]["phases_ms"]
        if "forward" in phases:
            compute[p["rank"]] = phases["forward"] + phases.get("optimizer", 0.0)
    if len(compute) < 2:
        return None
    slow = max(compute, key=compute.__getitem__)
    fast = min(compute.values())
    return Straggler(rank=slow, compute_ms=compute[slow], fastest_compute_ms=fast,
                     ratio=compute[slow] / fast if fast > 0 else 1.0)


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


def _rank_facts(part: dict[str, Any]) -> RankFacts:
    run = part["variants"][0]
    telemetry = run["telemetry"]
    ev = run.get("evidence") or {}
    return RankFacts(
        rank=part["rank"], node_rank=part["node_rank"], host=part["host"],
        device=part["device"], gpu_name=part["gpu_name"], ms_per_iter=run["ms_per_iter"],
        phases_ms=run["phases_ms"], power_mean_w=telemetry.get("power_mean_w"),
        kernel_active_pct=telemetry.get("kernel_active_pct"),
        collective_kernel_ms_per_step=ev.get("collective_ms_per_step"),
        exposed_comm_share=ev.get("collective_share") if ev.get("backend") == "cuda" else None,
        collective_exposed_ms_per_step=ev.get("collective_exposed_ms_per_step"),
        compute_busy_ms_per_step=ev.get("compute_busy_ms_per_step"),
        collective_overlap_fraction=ev.get("collective_overlap_fraction"),
        peak_allocated_mib=run.get("peak_allocated_mib"),
        peak_reserved_mib=run.get("peak_reserved_mib"),
        peak_resident_mib=run.get("peak_resident_mib"))


def ddp_facts(parts: list[dict[str, Any]], config: RunConfig, step_ms: float,
              evidence: Evidence | None) -> DdpFacts:
    """The job's facts from its ranks' parts (sorted by rank; rank 0 timed the baseline)."""
    lead = parts[0]
    default = lead["variants"][0]
    single = lead.get("single")
    single_sps = single["samples_per_s"] if single else None
    probe = None if lead.get("allreduce") is None else from_jsonable(LinkProbe,
                                                                       lead["allreduce"])
    exposed_ms = job_exposed_ms([p["variants"][0].get("evidence") for p in parts])
    rounds = (evidence.microsteps_with_collectives_per_step
              if evidence is not None and evidence.microsteps_per_step else None)
    sweep = ([_variant_summary(parts, i, single_sps)[0] for i in range(len(lead["variants"]))]
             if len(lead["variants"]) > 1 else [])
    return DdpFacts(
        world_size=lead["world_size"], nnodes=config.nnodes, backend=lead["backend"],
        per_device_batch=config.batch_size, accum=config.ddp_accum,
        no_sync=config.ddp_no_sync, bucket_mb=default["variant"]["bucket_mb"],
        grad_bytes_per_round=default["grad_bytes"],
        single_device=None if single is None else SingleDevice(single["ms_per_iter"],
                                                               single_sps or 0.0),
        scaling_efficiency=_variant_summary(parts, 0, single_sps)[0].scaling_efficiency,
        allreduce_probe=probe,
        collective_kernel_ms_per_step=None if evidence is None
        else evidence.collective_ms_per_step,
        collective_overlap_fraction=None if evidence is None
        else evidence.collective_overlap_fraction,
        exposed_comm_ms_per_step=exposed_ms,
        exposed_comm_share=None if exposed_ms is None or not step_ms
        else min(1.0, exposed_ms / step_ms),
        allreduce_rounds_per_step=rounds,
        # What the link needs to move one step's gradients at the probe's measured bandwidth:
        # unlike profiled collective time, it does not include waiting for a slower peer.
        transfer_ms_per_step=None if probe is None
        else default["grad_bytes"] * (rounds or 1) / (probe.algbw_gbps * 1e9) * 1e3,
        straggler=_straggler(parts), ranks=[_rank_facts(p) for p in parts], sweep=sweep)


def largest_rank_memory(parts: list[dict[str, Any]]) -> MemoryStats | None:
    """The stage's device memory: its largest rank's (the most reserved, with what its tensors
    held), the one that runs out first; each rank's is in DdpFacts.ranks. None on a CPU."""
    runs = [p["variants"][0] for p in parts]
    measured = [r for r in runs if r.get("peak_allocated_mib") is not None
                and r.get("peak_reserved_mib") is not None]
    if not measured:
        return None
    top = max(measured, key=lambda r: r["peak_reserved_mib"])
    return MemoryStats(peak_allocated_mib=top["peak_allocated_mib"],
                       peak_reserved_mib=top["peak_reserved_mib"],
                       device_total_mib=top.get("device_total_mib"))


def merge_parts(parts: list[dict[str, Any]], config: RunConfig, name: str,
                title: str) -> StageResult:
    parts = sorted(parts, key=lambda p: p["rank"])
    lead = parts[0]
    default = lead["variants"][0]
    _, steps = _variant_summary(parts, 0, None)
    evidence = (from_jsonable(Evidence, default["evidence"]) if default.get("evidence")
                else None)
    world = lead["world_size"]
    samples_per_step = default["samples_per_step"] * world
    facts = StageFacts(precision=precision_of(config.amp_dtype))
    result = fill_timed(
        StageResult(name=name, status="ok", title=title, facts=facts, evidence=evidence),
        Window(warmup_ms=default["warmup_ms"], iter_ms=steps, timer=default["timer"],
               telemetry=from_jsonable(TelemetrySummary, default["telemetry"])),
        samples_per_step=samples_per_step, tokens_per_step=samples_per_step * config.seq_len)
    facts.ddp = ddp_facts(parts, config, result.ms_per_iter or 0.0, evidence)
    result.memory = largest_rank_memory(parts)
    gpu = lead["gpu_name"] or "cpu"
    result.workload = (f"{config.model}, DDP {world} x {gpu} ({lead['backend']}), per-device "
                       f"batch {config.batch_size}" + (f" x {config.ddp_accum} micro-steps"
                                                       if config.ddp_accum > 1 else ""))
    return result


def run_ddp_stage(config: RunConfig, name: str, title: str) -> StageResult:
    with tempfile.TemporaryDirectory(prefix="gpudiag-ddp-") as tmp:
        parts = launch_ranks(config, Path(tmp))
    if not parts:
        raise LaunchError("no rank wrote its results")
    return merge_parts(parts, config, name, title)
