"""FSDP2's resharding: units that free their gathered parameters after forward gather them
again in backward, one all-gather per unit per step, named at the script's fully_shard(...)
line (the knob: `reshard_after_forward=False`), or, for a model that fits one device, the
advice not to shard it."""

from __future__ import annotations

from collections.abc import Iterator

from gpudiag.diagnose.common import pct
from gpudiag.diagnose.gd8_ddp import (
    COMM_CRITICAL_SHARE,
    megabytes,
    profiled_jobs,
    regathers,
)
from gpudiag.diagnose.ledger import NoPart
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.facts import FsdpFacts, FsdpUnits
from gpudiag.model.results import RunResult

INFO_SHARE, WARNING_SHARE = 0.03, 0.10
# Parameters below this (with their gradients and two Adam states, 4x) fit any training GPU
# many times over: sharding them buys memory nobody needs, at a gather per unit and step.
SMALL_MODEL_BYTES = 2**30


def _knob_site(fsdp: FsdpFacts | None) -> FsdpUnits | None:
    """The fully_shard(...) line that made the most resharding units (a loop over layers)."""
    sites = [s for s in fsdp.sites if s.resharding] if fsdp is not None else []
    return max(sites, key=lambda s: s.resharding, default=None)


@rule(
    "GD805", "fsdp-reshard-after-forward", concern="ddp",
    summary="FSDP2 units gather their parameters twice a step: after forward they are freed.",
    why=("fully_shard's default, reshard_after_forward=True, frees each unit's gathered "
         "parameters after its forward and all-gathers them again for its backward: the least "
         "memory, for one more all-gather per unit and step. Where the collectives hold the "
         "step (a small per-device batch, a slow link, many small units), those re-gathers "
         "are time the GPU waits; keeping the parameters gathered from forward to backward "
         "costs their unsharded bytes at the peak. A model that fits one device need not be "
         "sharded at all: DDP reduces its gradients with one all-reduce a step."),
    fix=("fully_shard(module, reshard_after_forward=False) at the line that shards each unit "
         "(or module.set_reshard_after_forward(False)); for a model that fits one device, DDP "
         "instead of FSDP."),
    prices=NoPart("the larger of the re-gathers' exposed collective time (the device's) and "
                  "FSDP's pre-backward host time, no one part of either account"),
    thresholds=(Threshold("info_share", INFO_SHARE, "the re-gathers' share of the step"),
                Threshold("warning_share", WARNING_SHARE, "... warning"),
                Threshold("critical_share", COMM_CRITICAL_SHARE, "... critical"),
                Threshold("small_model_bytes", SMALL_MODEL_BYTES,
                          "parameters below this: DDP is advised as well")),
    references=("https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html",),
)
def fsdp_reshard_after_forward(run: RunResult) -> Iterator[Draft]:
    """Per profiled job of sharded collectives (all-gathers and reduce-scatters outnumber
    all-reduces): the all-gathers per step beyond one per unit (FSDP2's units that reshard
    after forward, read at the script's fully_shard(...) calls; without them, all-gathers
    minus reduce-scatters), priced as the larger of their share of the collective calls times
    the share of the step the collectives hold exposed (GD803's, on the rank that holds them
    least) and the host time of FSDP's pre-backward phase over the step (on a GPU at most its
    idle share: a host-bound step of small units pays the re-gathers in FSDP's Python): an
    estimate, which --try-fixes measures."""
    for job in profiled_jobs(run).values():
        again = regathers(job)
        if again is None or again.share < INFO_SHARE:
            continue
        share = again.share
        lead = job.transfer
        script = lead.stage.facts.script
        fsdp = script.fsdp if script is not None else None
        knob = _knob_site(fsdp)
        at = knob.site if knob is not None else None
        memory = ""
        if fsdp is not None and knob is not None:
            held = knob.resharding_bytes * (1 - 1 / fsdp.shard_size)
            memory = (f"; the cost: up to {megabytes(held, digits=1)} more memory per device "
                      "at the peak (the units' parameters held unsharded until their backward)")
        small = fsdp is not None and 0 < fsdp.param_bytes < SMALL_MODEL_BYTES
        yield Draft(
            severity=severity_for(share, warning=WARNING_SHARE, critical=COMM_CRITICAL_SHARE),
            stage=lead.stage.name, location=at,
            title=(f"FSDP gathers parameters again in backward: {again.count:.0f} all-gathers per "
                   "step re-gather units that reshard after forward"
                   + (f" (fully_shard at {at})" if at else "")
                   + f"; they hold about {pct(share)} of the step"),
            impact=share,
            evidence={"regathers_per_step": again.count,
                      "regathers_comm_share": round(again.comm_share, 4),
                      "pre_backward_host_share": round(again.host_share, 4),
                      "collective_calls_by_kind": lead.evidence.collective_calls_by_kind,
                      "exposed_share": round(job.share, 3),
                      "exposed_ms_per_step": round(job.transfer_ms, 2),
                      "step_ms": round(job.step_ms, 2),
                      "resharding_units": None if fsdp is None else fsdp.resharding,
                      "units": None if fsdp is None else sum(s.units for s in fsdp.sites),
                      "param_bytes": None if fsdp is None else fsdp.param_bytes,
                      "shard_size": None if fsdp is None else fsdp.shard_size,
                      "fully_shard_at": at,
                      "price": "estimate: the larger of the re-gathers' share of the "
                               "collectives' exposed time (by calls) and the host time of "
                               "FSDP's pre-backward phase (GPU: while it idles); --try-fixes "
                               "measures it"},
            fix=("fully_shard(..., reshard_after_forward=False)"
                 + (f" at {at}" if at else " where each unit is sharded")
                 + f": each unit's parameters stay gathered from forward to backward, "
                 f"{again.count:.0f} all-gathers fewer per step{memory}."
                 + (f" The model has only {megabytes(fsdp.param_bytes, digits=1)} of "
                    "parameters: unless memory requires sharding, DDP (DistributedDataParallel) "
                    "keeps a full copy per device and reduces gradients with one all-reduce per "
                    "step, with no gathers at all." if small and fsdp is not None else "")))
