"""DDP rules: scaling that falls short, with its measured cause, and gradient accumulation that
still all-reduces every micro-step (docs/field-cases.md#case-1: two GPUs slower than one)."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpudiag.diagnose.common import pct, pct_above_zero
from gpudiag.diagnose.ledger import NoPart, device_time
from gpudiag.diagnose.ranks import job_and_rank
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.facts import DdpFacts
from gpudiag.model.results import (
    SEVERITY_RANK,
    Evidence,
    RunResult,
    StageResult,
    bus_bandwidth_factor,
)

POOR_EFFICIENCY = 0.80
CRITICAL_EFFICIENCY = 0.50  # below this, N devices barely beat one (two: slower than one)
COMM_EXPLAINS = 0.5  # communication explains the loss when it is at least half the added time
NO_OVERLAP = 0.3  # NCCL time beside compute below this share: the all-reduce is not hidden
SMALL_STEP_MS = 25.0  # a single-device step this short is dominated by fixed per-step costs
STRAGGLER_RATIO = 1.10  # a rank whose own work takes this much longer than the fastest's
TARGET_EFFICIENCY = 0.9
UNPRICED_ROUND_SHARE = 0.1
COMM_BOUND_SHARE = 0.30
COMM_CRITICAL_SHARE = 0.50
WARNING_EXTRA_ROUNDS = 0.05  # a profiled job's extra rounds holding this share of the step
STRAGGLER_WARNING_LOST = 0.05
STRAGGLER_STEADY = 0.8  # CPU ranks: the waiting rank waits longer in this share of steps
CORES_PER_RANK = 2  # CPU ranks with fewer cores each than this compete for them
SYMPTOM_RANK = 0.99  # GD803's impact, of GD802's, when extra all-reduce rounds explain it
HOST_BOUND_IDLE = 0.5  # a GPU idle this much of the step: the host sets the pace
# A step with less than this share of it left beside its collectives: the rest is within the
# window's noise, too small a part to count accumulation micro-steps from.
COMPUTE_FLOOR = 0.05


def _ddp(stage: StageResult) -> DdpFacts | None:
    return stage.facts.ddp


def _faster_link(backend: str) -> str:
    """The interconnect advice that applies: NCCL's links on GPUs, the network under gloo."""
    if backend == "nccl":
        return ("use a faster interconnect (NVLink, InfiniBand; check NCCL_P2P_DISABLE, "
                "NCCL_SHM_DISABLE, NCCL_IB_DISABLE are unset).")
    return (f"the {backend or 'CPU'} backend moves gradients over the host's network stack: "
            "a faster network between nodes, or fewer, larger all-reduces.")


def accumulation_count(comm_share: float) -> int | None:
    """Micro-steps per optimizer step under no_sync() that reach TARGET_EFFICIENCY: k steps of
    compute c sharing one all-reduce t give k c / (k c + t). None where the step without its
    collectives is under COMPUTE_FLOOR of it (nothing sound to divide by)."""
    rest = 1.0 - comm_share
    if rest < COMPUTE_FLOOR:
        return None
    k = TARGET_EFFICIENCY / (1 - TARGET_EFFICIENCY) * comm_share / rest
    return max(2, math.ceil(round(k, 6)))  # 6.000000000000001 is 6


def accumulate_micro_steps(comm_share: float) -> str:
    """'accumulate >= k micro-steps', or why no count is given."""
    k = accumulation_count(comm_share)
    return (f"accumulate >= {k} micro-steps" if k is not None else
            "accumulate micro-steps (how many cannot be estimated: the step without its "
            "collectives is too small a part of it to measure)")


def megabytes(nbytes: float, digits: int = 0) -> str:
    """Bytes as decimal MB (KB below 1 MB), with `digits` after the point for MB."""
    return f"{nbytes / 1e6:,.{digits}f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:,.0f} KB"


def _sweep_line(info: DdpFacts) -> str:
    rows = [(r.name, r.scaling_efficiency) for r in info.sweep[1:]
            if r.scaling_efficiency is not None]
    if not rows:
        return ""
    best = max(rows, key=lambda r: r[1])
    measured = ", ".join(f"{name} {eff:.0%}" for name, eff in rows)
    return f" The sweep measured: {measured}; best: {best[0]}."


def scaling_cause(stage: StageResult, info: DdpFacts) -> tuple[str, str, dict[str, Any]]:
    """(cause, fix, evidence) for a stage whose scaling fell short, from what its ranks
    measured: a straggler, communication the link cannot hide, or a step too short for
    fixed per-step costs; otherwise the added time is reported as unexplained."""
    step = stage.ms_per_iter or 0.0
    single = info.single_device.ms_per_iter if info.single_device else 0.0
    added = max(0.0, step - single * (info.accum or 1))
    transfer, exposed = info.transfer_ms_per_step, info.exposed_comm_ms_per_step
    overlap = info.collective_overlap_fraction
    comm = exposed if exposed is not None else transfer
    probe = info.allreduce_probe
    grad = info.grad_bytes_per_round or 0
    evidence = {"step_ms": round(step, 2), "single_device_step_ms": round(single, 2),
                "added_ms_per_step": round(added, 2),
                "grad_bytes_per_round": grad,
                "transfer_ms_per_step": None if transfer is None else round(transfer, 2),
                "exposed_comm_ms_per_step": None if exposed is None else round(exposed, 2),
                "collective_overlap_fraction": None if overlap is None else round(overlap, 3),
                "busbw_gbps": None if probe is None else round(probe.busbw_gbps, 2),
                "exposed_comm_share": None if comm is None or not step
                else round(min(1.0, comm / step), 3)}
    straggler = info.straggler
    if straggler is not None and straggler.ratio >= STRAGGLER_RATIO:
        return ("a straggler", (
            f"rank {straggler.rank} computes {straggler.ratio:.2f}x slower than the "
            "fastest rank and every all-reduce waits for it: check that rank's GPU (clocks, "
            "throttling, another process on it), its data loading, and any work only it does "
            "(evaluation, logging, checkpoint saves on rank 0: move them off the step, or make "
            "the others do useful work meanwhile)."),
            {**evidence, "straggler": dataclasses.asdict(straggler)})
    if comm is not None and added > 0 and comm >= COMM_EXPLAINS * added:
        # Accumulating k micro-steps under no_sync shares one all-reduce among k batches.
        accumulate = accumulate_micro_steps(min(1.0, comm / step) if step else 1.0)
        link = (f"{megabytes(grad)} of gradients per step over a link measured at "
                f"{probe.busbw_gbps if probe else 0:.1f} GB/s bus bandwidth take {comm:.1f} ms")
        hidden = ("" if overlap is None or overlap >= NO_OVERLAP else
                  f"; only {overlap:.0%} of the all-reduce runs beside compute (bucket_cap_mb "
                  "smaller to start reducing earlier, or static_graph=True)")
        return ("communication", (
            f"{link} of a {step:.1f} ms step{hidden}. Move fewer bytes per sample: raise the "
            f"per-GPU batch, or {accumulate} per optimizer step with "
            "model.no_sync() around forward and backward of all but the last; compress "
            "gradients to fp16/bf16 with a DDP comm hook (register_comm_hook(None, "
            f"default_hooks.fp16_compress_hook)); {_faster_link(info.backend)}"
            + _sweep_line(info)), evidence)
    if single and single < SMALL_STEP_MS:
        return ("per-device batch too small", (
            f"a {single:.1f} ms single-device step at per-device batch "
            f"{info.per_device_batch} is too short for the fixed costs of each "
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
         "rank lags, adding devices adds little or even slows training "
         "(docs/field-cases.md#case-1: two GPUs at 1.5 it/s against one at 2.2)."),
    fix=("Fix the measured cause: fewer bytes per sample (larger per-device batch, "
         "accumulation under no_sync, fp16 gradient compression), a faster interconnect, or "
         "the straggler's problem."),
    prices=NoPart("the throughput DDP loses against one device, a comparison of two of "
                  "`gpudiag run`'s stages, not a part of one stage's time"),
    thresholds=(Threshold("poor_efficiency", POOR_EFFICIENCY, "scaling efficiency: warning"),
                Threshold("critical_efficiency", CRITICAL_EFFICIENCY,
                          "scaling efficiency: critical"),
                Threshold("comm_explains", COMM_EXPLAINS,
                          "communication's share of the added time that names it the cause"),
                Threshold("straggler_ratio", STRAGGLER_RATIO,
                          "a rank's compute phases over the fastest rank's that name it"),
                Threshold("small_step_ms", SMALL_STEP_MS,
                          "single-device step below which fixed costs dominate"),
                Threshold("no_overlap", NO_OVERLAP,
                          "all-reduce share beside compute below which the fix says it is not "
                          "hidden"),
                Threshold("target_efficiency", TARGET_EFFICIENCY,
                          "the efficiency the advised accumulation count aims for"),
                Threshold("compute_floor", COMPUTE_FLOOR,
                          "the step's share left beside its collectives below which no "
                          "accumulation count is given"),
                Threshold("no_sync_warning_share", WARNING_EXTRA_ROUNDS,
                          "GD802's: extra all-reduce rounds this share of the step explain it"),
                Threshold("symptom_rank", SYMPTOM_RANK,
                          "then it ranks just below GD802, which names the knob")),
    references=("https://pytorch.org/docs/stable/notes/ddp.html",
                "reports/examples/h200x2-ddp: two H200s, 90% over NVLink, 28% over sockets"),
)
def ddp_poor_scaling(run: RunResult) -> Iterator[Draft]:
    """Efficiency = throughput(N) / (N x single-device throughput), the baseline timed by rank
    0 alone at the same per-device batch. Under 80% it names the cause, in order: a rank
    whose own compute is >= 10% slower; communication (exposed NCCL time, or on CPUs the time
    the measured all-reduce bandwidth needs for the gradients) covering half the added time; a
    single-device step under 25 ms; else the overhead is reported as unexplained."""
    for stage in run.ok_stages():
        info = _ddp(stage)
        if info is None or info.world_size < 2:
            continue
        efficiency = info.scaling_efficiency
        if efficiency is None or efficiency >= POOR_EFFICIENCY:
            continue
        cause, fix, evidence = scaling_cause(stage, info)
        world = info.world_size
        single_sps = info.single_device.samples_per_s if info.single_device else 0.0
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
    prices=device_time("the extra all-reduce rounds' share of the collectives' time"),
    thresholds=(Threshold("max_rounds_per_update", 1, "all-reduce rounds per optimizer step"),
                Threshold("unpriced_share", UNPRICED_ROUND_SHARE,
                          "impact per extra round when the link was not probed (no transfer "
                          "time to price it)"),
                Threshold("warning_share", WARNING_EXTRA_ROUNDS,
                          "a profiled job's extra rounds holding this share of the step"),
                Threshold("critical_share", COMM_CRITICAL_SHARE, "... critical"),
                Threshold("host_bound_idle", HOST_BOUND_IDLE,
                          "a GPU idle this share of the step: the price is a lower bound and "
                          "the finding at least a warning")),
    references=("https://pytorch.org/docs/stable/generated/"
                "torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel."
                "DistributedDataParallel.no_sync",),
)
def ddp_no_sync_misuse(run: RunResult) -> Iterator[Draft]:
    """From the profiler window: accumulation micro-steps per optimizer step (ranges marked
    gpudiag.microstep: the ddp stage's forward and backward, a profiled script's backward()
    calls) and how many of them issued an all-reduce. More than one reducing micro-step per
    update is the misuse. Its price is the extra rounds' share of the collectives' time: the
    ddp stage's probed transfer time, a profiled job's exposed collective time (the rank that
    holds it least; gloo's work time on a CPU)."""
    for stage in run.ok_stages():
        if _ddp(stage) is not None:
            yield from _ladder_no_sync(stage)
    for job in profiled_jobs(run).values():
        lead = job.transfer
        ev = lead.evidence
        rounds = ev.microsteps_with_collectives_per_step
        if ev.microsteps_per_step <= 1 or rounds <= 1:
            continue
        share = no_sync_share(job)
        facts = lead.stage.facts.ddp_job
        at = facts.backward_at if facts is not None else None
        # On a host-bound GPU step each round costs the reducer's host work too (bucket
        # copies, launches: C++ on autograd's thread, in no range): the exposed time is a
        # lower bound (two H200s over NVLink: 1% priced, 13% saved by the script's timer).
        bound = ev.backend == "cuda" and (ev.idle_fraction or 0.0) >= HOST_BOUND_IDLE
        severity = severity_for(share, warning=WARNING_EXTRA_ROUNDS, critical=COMM_CRITICAL_SHARE)
        if bound:
            severity = max(severity, "warning", key=SEVERITY_RANK.__getitem__)
        yield Draft(
            severity=severity,
            stage=lead.stage.name, location=at,
            title=(f"Gradient accumulation all-reduces on {rounds:.0f} of "
                   f"{ev.microsteps_per_step:.0f} micro-steps per optimizer step"
                   + (f" (backward() at {at})" if at else "") + ": no_sync() is missing or "
                   "wraps only the backward; "
                   + ("the extra rounds' collectives are exposed "
                      f"{pct_above_zero(share)} of the step, and "
                      "on this host-bound step each round's reducer work costs the host more "
                      "(not priced: --try-fixes measures it)" if bound else
                      f"the extra rounds hold {pct(share)} of the step")),
            evidence={"microsteps_per_step": ev.microsteps_per_step,
                      "reducing_microsteps_per_step": rounds,
                      "collective_calls_per_step": ev.collective_calls_per_step,
                      "collective_calls_by_kind": ev.collective_calls_by_kind,
                      "exposed_ms_per_step": round(job.transfer_ms, 2),
                      "wasted_ms_per_step": round(job.transfer_ms * (rounds - 1) / rounds, 2),
                      "backward_at": at,
                      "ddp_built_at": facts.built_at if facts is not None else None,
                      "price": ("lower bound: the extra rounds' exposed collective time; the "
                                "GPU idles, so the reducer's host work per round adds to it; "
                                "--try-fixes measures it" if bound else
                                "the extra rounds' share of the exposed collective time")},
            impact=share,
            fix=(f"Wrap forward and backward of every micro-step but the last in "
                 f"model.no_sync(){f' (at {at})' if at else ''}: `ctx = model.no_sync() if "
                 "not last else contextlib.nullcontext(); with ctx: loss = model(x); "
                 "loss.backward()`. One all-reduce per optimizer step then carries the "
                 f"accumulated gradients ({pct(1 - 1 / rounds)} fewer rounds)."))


def no_sync_share(job: _Job) -> float:
    """The share of the step a profiled job's extra all-reduce rounds hold (0: none)."""
    ev = job.transfer.evidence
    rounds = ev.microsteps_with_collectives_per_step
    if ev.microsteps_per_step <= 1 or rounds <= 1:
        return 0.0
    return job.share * (rounds - 1) / rounds


def _knob_first(job: _Job) -> tuple[str, float] | None:
    """The framework setting that explains part of a job's collective time, as GD803 names it
    first (its rule names it at the script's line), and the share of the step it holds."""
    extra = no_sync_share(job)
    if extra > 0:  # every micro-step all-reduces
        facts = job.transfer.stage.facts.ddp_job
        at = facts.backward_at if facts is not None else None
        return ("put every micro-step but the last under model.no_sync() (GD802"
                + (f", backward() at {at}" if at else "") + "): their extra all-reduces hold",
                extra)
    again = regathers(job)
    if again is not None and again.share > 0:  # FSDP2 units gathered twice a step
        return (f"keep parameters gathered from forward to backward (GD805, fully_shard(..., "
                f"reshard_after_forward=False)): the {again.count:.0f} re-gathers in backward "
                "hold", again.share)
    return None


@dataclass
class Regathers:
    """FSDP2's all-gathers per step that gather again in backward what units freed after
    forward, and what they hold of the step: by the collectives' exposed time in proportion
    to their share of the calls, and by the host time of FSDP's pre-backward phase (where
    the re-gather is issued and waited for; on a GPU, only while the GPU idles). The price is
    the larger: the one that sets the step's pace."""

    count: float
    comm_share: float
    host_share: float

    @property
    def share(self) -> float:
        return max(self.comm_share, self.host_share)


def regathers(job: _Job) -> Regathers | None:
    """A sharded job's re-gathers (None: none, or not a sharded job)."""
    lead = job.transfer
    ev = lead.evidence
    sharded = _sharded_calls(ev)
    if sharded is None:
        return None
    gathers, scatters = sharded
    script = lead.stage.facts.script
    fsdp = script.fsdp if script is not None else None
    if fsdp is not None:  # each micro-step's backward re-gathers the resharded units
        again = min(gathers, fsdp.resharding * max(1.0, ev.microsteps_per_step))
    elif ev.microsteps_per_step <= 1:  # a gather per unit in forward, a scatter in backward
        again = max(0.0, gathers - scatters)
    else:
        again = 0.0
    if again < 1 or gathers + scatters <= 0:
        return None
    host = ev.fsdp_host_ms_per_step.get("FSDP::pre_backward", 0.0) / ev.step_ms \
        if ev.step_ms else 0.0
    if ev.backend == "cuda":
        host = min(host, ev.idle_fraction or 0.0)
    return Regathers(again, job.share * again / (gathers + scatters), min(1.0, host))


def _ladder_no_sync(stage: StageResult) -> Iterator[Draft]:
    """The ddp stage's misuse, priced by its probed transfer time."""
    ev = stage.evidence
    if ev is None or ev.microsteps_per_step <= 1:
        return
    rounds = ev.microsteps_with_collectives_per_step
    if rounds <= 1:
        return
    info = _ddp(stage)
    transfer = None if info is None else info.transfer_ms_per_step
    step = stage.ms_per_iter or ev.step_ms
    wasted = transfer * (rounds - 1) / rounds if transfer else None
    share = (min(1.0, wasted / step) if wasted and step
             else (rounds - 1) / rounds * UNPRICED_ROUND_SHARE)
    yield Draft(
        severity=severity_for(share, warning=0.0), stage=stage.name,
        title=(f"Gradient accumulation all-reduces on {rounds:.0f} of "
               f"{ev.microsteps_per_step:.0f} micro-steps per optimizer step: no_sync is "
               "missing or wraps only the backward"),
        evidence={"microsteps_per_step": ev.microsteps_per_step,
                  "reducing_microsteps_per_step": rounds,
                  "collective_calls_per_step": ev.collective_calls_per_step,
                  "collective_calls_by_kind": ev.collective_calls_by_kind,
                  "wasted_transfer_ms_per_step": None if wasted is None
                  else round(wasted, 2),
                  "no_sync": None if info is None else info.no_sync},
        impact=share,
        fix=("Wrap forward and backward of all micro-steps but the last in "
             "model.no_sync(); one all-reduce per optimizer step then carries the "
             f"accumulated gradients ({pct(1 - 1 / rounds)} fewer rounds)."))


LINK_BOUND = 0.5  # effective bus bandwidth at least this share of the probe's: the link limits


@dataclass
class _Rank:
    rank: int
    stage: StageResult
    evidence: Evidence

    @property
    def held_ms(self) -> float:
        """Collective time per step with nothing else on the device (GPU), or gloo's work time
        (CPU): device-side, so the window's host instrumentation does not stretch it."""
        ev = self.evidence
        held = (ev.collective_exposed_ms_per_step if ev.backend == "cuda"
                else ev.collective_wall_ms_per_step)
        return held or 0.0


@dataclass
class _Job:
    """The ranks of one profiled DDP job. A collective ends when the last rank arrives, so a
    rank's time in it is waiting for the last rank plus the transfer; call by call, the rank
    that held it least (the last to arrive, who waits nothing) shows the transfer. Where ranks
    take turns arriving last (two ranks on a loaded CPU, each descheduled in turn), even that
    holds waits: on a CPU the job's own probe, an all-reduce of the gradients' size timed
    after a barrier, bounds what the transfer takes."""

    ranks: list[_Rank]

    @property
    def transfer(self) -> _Rank:
        return min(self.ranks, key=lambda r: r.held_ms)

    @property
    def step_ms(self) -> float:
        return max(r.stage.ms_per_iter or 0.0 for r in self.ranks)

    @property
    def window_ms(self) -> float:
        """The profiled window's step: what CPU collectives, stretched with it, are a part of."""
        return max(r.evidence.window_step_ms for r in self.ranks)

    def _matched_calls(self) -> list[list[float]] | None:
        """Each rank's collective times call by call, where every rank timed the same calls
        over the same number of steps (else None)."""
        calls = [r.evidence.collective_ms_by_call for r in self.ranks]
        if (len({r.evidence.steps for r in self.ranks}) != 1 or not calls[0]
                or len({len(c) for c in calls}) != 1):
            return None
        return calls

    @property
    def link_ms(self) -> float:
        """The time the link moved the bytes per step in the window: the transfer's rank's
        collectives' union, beside compute or not, call by call no more than the least any
        rank held them."""
        wall = self.transfer.evidence.collective_wall_ms_per_step
        calls = self._matched_calls()
        if calls is None:
            return wall
        least = sum(min(times) for times in zip(*calls, strict=True))
        return min(wall, least / self.ranks[0].evidence.steps)

    @property
    def comm_ms(self) -> float:
        """The transfer per step: the least any rank held the collectives call by call
        (least_held_ms), on a CPU no more than the job's probe says the step's all-reduces
        take (probed_ms)."""
        bound = self.probed_ms
        return self.least_held_ms if bound is None else min(self.least_held_ms, bound)

    @property
    def least_held_ms(self) -> float:
        """The transfer per step, as measured in the window: call by call the least any rank
        held it (a rank that waits for a late peer in one step and is late itself in the
        next waits in neither sum), never more than the least a rank held its collectives
        in all (their union: calls that overlap count once)."""
        held = self.transfer.held_ms
        calls = self._matched_calls()
        if calls is None:
            return held
        steps = self.ranks[0].evidence.steps
        return min(held, sum(min(times) for times in zip(*calls, strict=True)) / steps)

    @property
    def probed_ms(self) -> float | None:
        """What the step's all-reduces take by the probe (the slowest rank's): the gradients'
        bytes at its time per byte where it was capped below them, once per bucket (each
        bucket at most the whole), once per round (micro-steps that all-reduced). None
        without a probe (FSDP; a job the watch did not see built), and on GPUs: there the
        held time is NCCL's kernels alone on the device, and a round in the step costs more
        than the probe's lone all-reduce (reports/examples/h200x2-ddp-no-sync/nvlink: 0.8 ms
        a round saved by no_sync(), 0.37 ms probed). On a CPU it is gloo's wall time, waits
        included."""
        if self.transfer.evidence.backend == "cuda":
            return None
        known = [r.stage.facts.ddp_job for r in self.ranks]
        probes = [(k, k.allreduce_probe) for k in known
                  if k is not None and k.allreduce_probe is not None and k.grad_bytes]
        if not probes:
            return None
        job, _ = probes[0]
        whole = max(p.ms * max(1.0, job.grad_bytes / max(p.bytes, 1)) for _, p in probes)
        cap = job.bucket_mb * 2**20 if job.bucket_mb else None
        buckets = math.ceil(job.grad_bytes / cap) if cap else 1
        rounds = max(1.0, self.transfer.evidence.microsteps_with_collectives_per_step)
        return whole * buckets * rounds

    @property
    def share(self) -> float:
        """The transfer's share of the step, in [0, 1]: GPU device time over the timed step
        (the window's slower host does not stretch it); gloo's CPU work over the window's step
        (the profiler stretches both alike)."""
        base = self._base_ms
        return min(1.0, self.comm_ms / base) if base > 0 else 0.0

    @property
    def _base_ms(self) -> float:
        return self.step_ms if self.transfer.evidence.backend == "cuda" else self.window_ms

    @property
    def transfer_ms(self) -> float:
        """The transfer in the timed step's milliseconds: never more than the step."""
        return self.share * self.step_ms

    def waits_first(self, waiter: int, other: int) -> float | None:
        """The share of steps in which rank `waiter` waited longer than rank `other` (by
        ranks' places in the job), call by call; None without call-by-call times."""
        calls = self._matched_calls()
        steps = self.ranks[0].evidence.steps if self.ranks else 0
        if calls is None or not steps or len(calls[0]) % steps:
            return None
        per_step = len(calls[0]) // steps
        least = [min(times) for times in zip(*calls, strict=True)]

        def longest(times: list[float], i: int) -> float:
            return max(t - low for t, low in zip(times[i:i + per_step], least[i:i + per_step],
                                                 strict=True))

        first = [longest(calls[waiter], i) > longest(calls[other], i)
                 for i in range(0, len(least), per_step)]
        return sum(first) / len(first)

    def waits(self) -> dict[int, float]:
        """Each rank's wait per step for a later rank, in the timed step's milliseconds. Call
        by call a rank's time above the least any rank held that call is its wait; a step's
        calls wait for the same late rank at once, so a step loses its longest call's wait,
        not their sum (steps told apart where the calls divide evenly among them). Without
        call-by-call times: a rank's collective time above the transfer."""
        base = self._base_ms
        scale = self.step_ms / base if base > 0 else 0.0
        calls = self._matched_calls()
        if calls is None:
            return {r.rank: round(max(0.0, r.held_ms - self.comm_ms) * scale, 2)
                    for r in self.ranks}
        least = [min(times) for times in zip(*calls, strict=True)]
        steps = self.ranks[0].evidence.steps
        per_step = len(least) // steps if steps and len(least) % steps == 0 else len(least)
        waited: dict[int, float] = {}
        for rank, times in zip(self.ranks, calls, strict=True):
            extra = [t - low for t, low in zip(times, least, strict=True)]
            longest = [max(extra[i:i + per_step]) for i in range(0, len(extra), per_step)]
            wait = sum(longest) / steps if per_step != len(least) else longest[0]
            waited[rank.rank] = round(min(wait, max(0.0, rank.held_ms - self.comm_ms)) * scale,
                                      2)
        return waited


def _buckets(facts: dict[str, Any]) -> str:
    """bucket_cap_mb's advice, where it can help: gradients that fill several buckets."""
    cap, grad = facts.get("bucket_mb"), facts.get("grad_bytes_per_step")
    if cap and grad is not None and grad <= cap * 2**20:
        return (f"its {megabytes(grad)} of gradients fit one bucket already (bucket_cap_mb "
                f"{cap:g}), so bucket size cannot help; ")
    now = f"{cap:g} MB" if cap else "unknown"
    return f"fewer, larger buckets (raise bucket_cap_mb, now {now}); "


def _sharded_calls(ev: Evidence) -> tuple[float, float] | None:
    """(all-gathers, reduce-scatters) per step when they outnumber all-reduces: a sharded
    job (FSDP, ZeRO), whose remedies are not DDP's."""
    by_kind = ev.collective_calls_by_kind
    gathers, scatters = by_kind.get("all_gather", 0.0), by_kind.get("reduce_scatter", 0.0)
    return (gathers, scatters) if gathers + scatters > by_kind.get("all_reduce", 0.0) else None


def profiled_jobs(run: RunResult) -> dict[str, _Job]:
    """Profiled processes that issued collectives, grouped by job (`train.py[rank1]` is rank 1
    of `train.py`); ddp-stage results are GD801's."""
    jobs: dict[str, list[_Rank]] = defaultdict(list)
    for stage in run.ok_stages():
        ev = stage.evidence
        if ev is None or _ddp(stage) is not None or not ev.collective_calls_per_step:
            continue
        job, rank = job_and_rank(stage.name)
        jobs[job].append(_Rank(rank or 0, stage, ev))
    return {job: _Job(sorted(ranks, key=lambda r: r.rank)) for job, ranks in jobs.items()}


@dataclass
class _Straggler:
    """A rank the others wait for in their collectives, and what that costs them."""

    slow: _Rank
    fast: _Rank
    lost: float  # the share of the step the waiting rank loses
    said: str  # what was measured, for the title
    evidence: dict[str, Any]


def _straggler_of(job: _Job) -> _Straggler | None:
    return _slow_device_work(job) or _long_wait(job)


def _slow_device_work(job: _Job) -> _Straggler | None:
    """GPU ranks: one rank's own device work >= 10% longer than the fastest's, the difference
    at least half of the fastest rank's exposed communication (its all-reduce is waiting, not
    transferring)."""
    timed = [r for r in job.ranks if r.evidence.compute_busy_ms_per_step]
    if len(timed) < 2:
        return None
    slow = max(timed, key=lambda r: r.evidence.compute_busy_ms_per_step or 0.0)
    fast = min(timed, key=lambda r: r.evidence.compute_busy_ms_per_step or 0.0)
    slow_ms = slow.evidence.compute_busy_ms_per_step or 0.0
    fast_ms = fast.evidence.compute_busy_ms_per_step or 0.0
    ratio = slow_ms / fast_ms if fast_ms > 0 else 1.0
    waited = (fast.evidence.collective_exposed_ms_per_step or 0.0)
    if ratio < STRAGGLER_RATIO or slow_ms - fast_ms < COMM_EXPLAINS * waited or waited <= 0:
        return None
    step = job.step_ms or slow.evidence.window_step_ms
    return _Straggler(
        slow, fast, lost=min(1.0, (slow_ms - fast_ms) / step),
        said=(f"its own device work takes {ratio:.2f}x rank {fast.rank}'s ({slow_ms:.1f} vs "
              f"{fast_ms:.1f} ms per step), and rank {fast.rank} waits for it inside the "
              "all-reduce"),
        evidence={"compute_ratio": round(ratio, 3),
                  "slow_compute_ms_per_step": round(slow_ms, 2),
                  "fast_compute_ms_per_step": round(fast_ms, 2)})


def _long_wait(job: _Job) -> _Straggler | None:
    """Ranks with no device work to compare (gloo on CPUs): the rank that waits most in its
    collectives, for the rank that waits least, when waiting is at least half of its time in
    them (the rest is the transfer, which every rank pays)."""
    if len(job.ranks) < 2 or any(r.evidence.backend == "cuda" for r in job.ranks):
        return None
    waits = job.waits()
    fast = max(job.ranks, key=lambda r: waits[r.rank])
    slow = min(job.ranks, key=lambda r: waits[r.rank])
    wait, transfer = waits[fast.rank], job.transfer_ms
    if wait <= 0 or wait < COMM_EXPLAINS * (wait + transfer) or not job.step_ms:
        return None
    # A straggler is late step after step; ranks a loaded CPU deschedules in turn take turns
    # being late (Lightning's 2 ranks on a 2-core CI machine), which is no rank's extra work.
    places = {id(r): i for i, r in enumerate(job.ranks)}
    first = job.waits_first(places[id(fast)], places[id(slow)])
    if first is None or first < STRAGGLER_STEADY:
        return None
    return _Straggler(
        slow, fast, lost=min(1.0, wait / job.step_ms),
        said=(f"rank {fast.rank} waits {wait:.1f} ms per step inside the all-reduce for it to "
              f"arrive (the transfer itself takes {transfer:.1f} ms)"),
        evidence={"transfer_ms_per_step": round(transfer, 2)})


@rule(
    "GD804", "ddp-straggler", concern="ddp",
    summary="One rank's own work is slower and every other rank waits for it in the all-reduce.",
    why=("A collective finishes when the last rank arrives. A rank whose own compute is slower "
         "(another process on its GPU, throttling, extra work such as logging or evaluation "
         "on rank 0) makes every other rank spin inside the all-reduce: their profile shows "
         "communication, but the network is idle. Faster links do not help; the slow rank's "
         "problem does."),
    fix=("Find what the slow rank does more: rank-0-only work (logging, evaluation, checkpoint "
         "saves) moved off the step or spread over ranks, its GPU's clocks and neighbours "
         "(nvidia-smi), its data loading."),
    prices=device_time("the other ranks' wait in their collectives for the slow rank"),
    thresholds=(Threshold("straggler_ratio", STRAGGLER_RATIO,
                          "slowest rank's device work over the fastest's (GPU)"),
                Threshold("explains", COMM_EXPLAINS,
                          "share of the fastest rank's exposed collective time the difference "
                          "(GPU), or of the waiting rank's collective time its wait (CPU), "
                          "must explain"),
                Threshold("warning_lost", STRAGGLER_WARNING_LOST,
                          "the slow rank's extra work (the others' wait) over the step: "
                          "warning"),
                Threshold("critical_lost", COMM_CRITICAL_SHARE, "... critical"),
                Threshold("cores_per_rank", CORES_PER_RANK,
                          "CPU ranks with fewer cores each share them: a straggler there is "
                          "information (the OS may deschedule a rank)"),
                Threshold("steady_share", STRAGGLER_STEADY,
                          "CPU ranks: the waiting rank waits longer in 80% of the steps (ranks "
                          "a loaded CPU deschedules in turn take turns being late)")),
    references=("https://pytorch.org/docs/stable/notes/ddp.html",),
)
def ddp_straggler(run: RunResult) -> Iterator[Draft]:
    """Profiled ranks of one job. GPU: per rank, the union of its non-collective device work
    in the window; the slowest against the fastest: a ratio >= 1.10 whose difference covers at
    least half of the fastest rank's exposed collective time names the slow rank. CPU (gloo):
    call by call, a rank's collective time above the least any rank held it is its wait for
    the last to arrive, and a step loses its longest call's wait (its calls wait for the same
    late rank at once); the rank that waits most, when that is at least half of its
    collective time, names the rank it waits for."""
    for job in profiled_jobs(run).values():
        found = _straggler_of(job)
        if found is None:
            continue
        slow, fast = found.slow, found.fast
        severity = severity_for(found.lost, warning=STRAGGLER_WARNING_LOST,
                                critical=COMM_CRITICAL_SHARE)
        cores = run.env.cpu_count
        shared = slow.evidence.backend != "cuda" and cores is not None \
            and len(job.ranks) * CORES_PER_RANK > cores
        if shared:  # oversubscribed: the OS may deschedule a rank, not its work be slower
            severity = "info"
        yield Draft(
            severity=severity,
            stage=slow.stage.name,
            title=f"rank {slow.rank} is a straggler: {found.said}" + (
                f" (its {len(job.ranks)} ranks share {cores} CPU cores: a late rank may be "
                "descheduled, not slower)" if shared else ""),
            evidence={"slow_rank": slow.rank, "fast_rank": fast.rank, **found.evidence,
                      "fast_rank_waits_ms_per_step": job.waits()[fast.rank],
                      "share_of_step_lost": round(found.lost, 3)},
            impact=found.lost,
            fix=(f"Rank {fast.rank}'s communication time is waiting, not transfer: a faster "
                 f"link would not help. Find what rank {slow.rank} does more (work only it "
                 "does, such as logging, evaluation or saves; its GPU's clocks or another "
                 "process on it; its input pipeline) and even it out."))


def _link_line(job: _Job) -> tuple[str, dict[str, Any], bool]:
    """What the link did: gradient bytes, effective bus bandwidth of the rank that did not wait,
    against the probe's. The bool: the link is the limit (effective >= half the probe's)."""
    lead = job.transfer
    known = lead.stage.facts.ddp_job
    grad = None if known is None else known.grad_bytes
    world = known.world_size if known is not None else len(job.ranks)
    probe = (known.allreduce_probe.busbw_gbps
             if known is not None and known.allreduce_probe is not None else None)
    wall = job.link_ms
    rounds = lead.evidence.microsteps_with_collectives_per_step or 1.0
    effective = (grad * rounds * bus_bandwidth_factor(world) / (wall / 1e3) / 1e9
                 if grad and wall and world > 1 else None)
    facts = {"grad_bytes_per_step": grad, "bucket_mb": None if known is None else known.bucket_mb,
             "effective_busbw_gbps": None if effective is None else round(effective, 2),
             "probe_busbw_gbps": None if probe is None else round(probe, 2)}
    if not grad:
        return "", facts, True
    text = f"{megabytes(grad * rounds)} of gradients per step"
    if effective is not None:
        text += f" moved at {effective:.1f} GB/s bus bandwidth"
    if probe:
        text += f" (the link measured {probe:.1f} GB/s)"
    return text + ".", facts, effective is None or not probe or effective >= LINK_BOUND * probe


def _cure(job: _Job, facts: dict[str, Any], link_bound: bool) -> str:
    """GD803's remedies for what the job's collectives are: FSDP's gathers and scatters, or
    DDP's all-reduce near the link's bandwidth or well below it."""
    lead = job.transfer
    batch = lead.stage.samples_per_step
    now = f" (now {batch})" if batch else ""
    accumulate = accumulate_micro_steps(job.share)
    sharded = _sharded_calls(lead.evidence)
    if sharded is not None:
        gathers = sharded[0]
        return (f"Raise the per-device batch{now}; overlap each unit's all-gather with the "
                "previous unit's compute (model.layers[i].set_modules_to_forward_prefetch(["
                "model.layers[i + 1]]), and set_modules_to_backward_prefetch); shard fewer, "
                "larger units (fully_shard each transformer block, not each layer: "
                f"{gathers:.0f} all-gathers per step now)."
                + (" The link runs near its measured bandwidth: a faster interconnect "
                   "(NVLink, InfiniBand) or fewer bytes (bf16 parameters and gradients: "
                   "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype="
                   "torch.bfloat16, reduce_dtype=torch.bfloat16)))." if link_bound else ""))
    if link_bound:
        return (f"Move fewer bytes per sample: raise the per-device batch{now}, or "
                f"{accumulate} per optimizer step with model.no_sync() around forward and "
                "backward of all but the last; compress gradients with register_comm_hook("
                "None, default_hooks.fp16_compress_hook); "
                + _faster_link("nccl" if lead.evidence.backend == "cuda" else "gloo"))
    return ("The all-reduce runs well below the link's bandwidth: it is latency-bound: "
            f"{_buckets(facts)}give each all-reduce more work (a larger per-device batch, or "
            f"{accumulate} under no_sync()).")


def _what_holds(ev: Evidence) -> str:
    sharded = _sharded_calls(ev)
    if sharded is None:
        return "the all-reduce's transfer holds"
    return (f"FSDP's all-gathers and reduce-scatters ({sharded[0]:.0f} and {sharded[1]:.0f} "
            "per step) hold")


def _overlap_bound(job: _Job) -> str:
    """What perfect overlap would leave of the step, where the rest is a measurable part."""
    if 1.0 - job.share < COMPUTE_FLOOR:
        return ("the step's other work is too small a part of it to bound what overlap would "
                "leave")
    rest = job.step_ms - job.transfer_ms
    return f"perfect overlap would bring the step to no less than {rest:.1f} ms"


def _wait_line(job: _Job) -> str:
    """The longest wait for a late rank, where it is a material part of the step: named, and
    left to GD804 (it is not transfer, and no link or bucket setting removes it). CPU jobs
    only: on a GPU the wait is mostly for the other rank's host, which the profiler slows
    more than the device (GD804 compares the ranks' device work instead)."""
    if job.transfer.evidence.backend == "cuda":
        return ""
    waits = job.waits()
    rank = max(waits, key=waits.__getitem__)
    wait = waits[rank]
    if not job.step_ms or wait < STRAGGLER_WARNING_LOST * job.step_ms:
        return ""
    return (f"; besides, rank {rank} waits {wait:.1f} ms per step in it for a later rank "
            "(not transfer, not priced here: see GD804)")


@rule(
    "GD803", "collective-bound-step", concern="ddp",
    summary="A profiled DDP or FSDP job whose steps wait on its collectives' transfer.",
    why=("Without a single-device baseline (a profiled script), the ranks' own profiler windows "
         "still show how long each collective holds the step. A rank's time in a collective "
         "is waiting for the last rank to arrive plus the transfer; the last to arrive waits "
         "nothing, so call by call the rank that holds it least shows the transfer. The "
         "transfer over the step, the step without it, and the bandwidth the link reached "
         "against its measured bandwidth say whether the job is communication-bound and "
         "which remedy fits; the wait is a straggler's (GD804)."),
    fix=("Raise the per-device batch or accumulate micro-steps under model.no_sync(); compress "
         "gradients (fp16_compress_hook); check the interconnect (NVLink/IB, NCCL_* variables). "
         "FSDP: prefetch all-gathers, reshard_after_forward=False, fewer larger units."),
    prices=device_time("the collectives' transfer (call by call the least time any rank held "
                       "each, exposed time on a GPU), never a rank's wait for a later rank"),
    thresholds=(Threshold("share", COMM_BOUND_SHARE,
                          "transfer time over the step: warning"),
                Threshold("critical_share", COMM_CRITICAL_SHARE, "... critical"),
                Threshold("link_bound", LINK_BOUND,
                          "effective over probed bus bandwidth above which the link is named"),
                Threshold("wait_named", STRAGGLER_WARNING_LOST,
                          "a rank's wait for a later rank over the step above which it is "
                          "named (not priced: GD804's)"),
                Threshold("target_efficiency", TARGET_EFFICIENCY,
                          "the efficiency the advised accumulation count aims for"),
                Threshold("compute_floor", COMPUTE_FLOOR,
                          "the step's share left beside its collectives below which no "
                          "accumulation count is given"),
                Threshold("no_sync_warning_share", WARNING_EXTRA_ROUNDS,
                          "GD802's: extra all-reduce rounds this share of the step explain it"),
                Threshold("symptom_rank", SYMPTOM_RANK,
                          "then it ranks just below GD802, which names the knob")),
    references=("https://pytorch.org/docs/stable/ddp_comm_hooks.html",
                "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md"),
)
def collective_bound_step(run: RunResult) -> Iterator[Draft]:
    """Per job: the collectives' transfer, call by call the least time any rank held each
    (GPU: NCCL kernels, capped by the least exposed union any rank saw; CPU: gloo's work
    ranges), over the step: GPU device time over the timed step, gloo's CPU time over the
    window's step (both stretched by the profiler alike), so the share is in [0, 1]; warning
    from 30%, critical from 50%. A rank's wait for a later rank is named, not priced."""
    for job in profiled_jobs(run).values():
        if job.share < COMM_BOUND_SHARE:
            continue
        lead, step = job.transfer, job.step_ms
        link, facts, link_bound = _link_line(job)
        cure = _cure(job, facts, link_bound)
        ev = lead.evidence
        measured = ("with nothing else on the GPU" if ev.backend == "cuda" else
                    "by gloo's work time, call by call on the rank that arrived last")
        if job.comm_ms < job.least_held_ms:
            measured = (f"by the job's all-reduce probe (the ranks hold it "
                        f"{job.least_held_ms:.1f} ms or more, the rest waiting for each other)")
        impact, severity = job.share, severity_for(job.share, warning=COMM_BOUND_SHARE,
                                                   critical=COMM_CRITICAL_SHARE)
        knob = _knob_first(job)
        if knob is not None:  # a framework setting explains part of it: its rule first
            first, share = knob
            cure = f"First {first} {pct(share)} of the step. Then: {cure}"
            impact = min(impact, share) * SYMPTOM_RANK
            severity = min(severity, severity_for(share, warning=WARNING_EXTRA_ROUNDS,
                                                  critical=COMM_CRITICAL_SHARE),
                           key=SEVERITY_RANK.__getitem__)
        yield Draft(
            severity=severity, stage=lead.stage.name,
            title=(f"Communication-bound: {_what_holds(ev)} {job.share:.0%} of each step "
                   f"({job.transfer_ms:.1f} of {step:.1f} ms) {measured}; "
                   + _overlap_bound(job) + _wait_line(job)),
            evidence={"exposed_share": round(job.share, 3),
                      "exposed_ms_per_step": round(job.transfer_ms, 2),
                      "step_ms": round(step, 2),
                      "step_without_exposed_ms": round(step - job.transfer_ms, 2),
                      "collective_kernel_ms_per_step": round(ev.collective_ms_per_step, 2),
                      "collective_overlap_fraction": None
                      if ev.collective_overlap_fraction is None
                      else round(ev.collective_overlap_fraction, 3),
                      "collective_calls_per_step": ev.collective_calls_per_step,
                      "collective_calls_by_kind": ev.collective_calls_by_kind,
                      "rank_waits_ms_per_step": job.waits(),
                      "probed_ms_per_step": None if job.probed_ms is None
                      else round(job.probed_ms, 2),
                      "samples_per_step": lead.stage.samples_per_step, **facts},
            impact=impact,
            fix=f"{link} {cure}".strip())
