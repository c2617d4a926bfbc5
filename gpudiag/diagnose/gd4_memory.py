"""GD4xx, device memory: memory pressure and allocator churn."""

from __future__ import annotations

from collections.abc import Iterator

from gpudiag.diagnose.common import pct
from gpudiag.diagnose.ledger import NoPart
from gpudiag.diagnose.registry import Draft, Threshold, rule
from gpudiag.model.results import RunResult

RESERVED_WARNING, FRAGMENTATION = 0.90, 0.20
MIN_FREES = 0.5


@rule(
    "GD401", "memory-near-capacity", concern="memory",
    summary="Peak reserved device memory close to the GPU's capacity.",
    why=("Near capacity the caching allocator starts freeing and retrying, fragmentation turns "
         "into out-of-memory errors, and a slightly longer sequence fails."),
    fix=("Free large temporaries early (in-place ops where autograd allows, del), fuse the "
         "vocabulary-sized tensors, gradient checkpointing, or a smaller micro-batch with "
         "gradient accumulation; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against "
         "fragmentation."),
    prices=NoPart("a risk of running out of memory, not time"),
    thresholds=(Threshold("warning_reserved_share", RESERVED_WARNING,
                          "90% of device memory reserved"),
                Threshold("fragmentation_share", FRAGMENTATION,
                          "reserved exceeds allocated by 20% of the device")),
)
def memory_near_capacity(run: RunResult) -> Iterator[Draft]:
    """Peak reserved at least 90% of the device (warning); reserved exceeding allocated by 20%
    of the device (information: fragmentation)."""
    for stage in run.ok_stages():
        mem = stage.memory
        if mem is None or not mem.device_total_mib:
            continue
        reserved = mem.peak_reserved_mib / mem.device_total_mib
        slack = (mem.peak_reserved_mib - mem.peak_allocated_mib) / mem.device_total_mib
        evidence = {"peak_allocated_mib": round(mem.peak_allocated_mib),
                    "peak_reserved_mib": round(mem.peak_reserved_mib),
                    "device_total_mib": round(mem.device_total_mib)}
        if reserved >= RESERVED_WARNING:
            yield Draft(severity="warning", stage=stage.name,
                        title=f"Peak reserved memory is {pct(reserved)} of the GPU",
                        impact=0.0, evidence=evidence,
                        fix=("Shrink the largest temporaries or the micro-batch (gradient "
                             "accumulation keeps the effective batch)."))
        elif slack >= FRAGMENTATION:
            yield Draft(severity="info", stage=stage.name,
                        title=f"Allocator holds {pct(slack)} of the GPU more than it uses",
                        impact=0.0, evidence=evidence,
                        fix="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces "
                            "fragmentation from varying tensor sizes.")


@rule(
    "GD402", "empty-cache-in-loop", concern="memory",
    summary="torch.cuda.empty_cache() (memory handed back to the driver) every step.",
    why=("empty_cache frees the caching allocator's blocks with cudaFree, which synchronises "
         "the device; the next step allocates them again with cudaMalloc."),
    fix="Remove torch.cuda.empty_cache() from the training loop (keep it, at most, between "
        "phases such as training and evaluation).",
    prices=NoPart("a lower bound: cudaFree's own time as the profiler window saw it (the step's "
                  "host account has it among the torch calls, not apart); the next step's "
                  "cudaMalloc of the same blocks and the GPU's idle after each free's device "
                  "sync come on top, up to the step's idle time"),
    thresholds=(Threshold("min_frees_per_step", MIN_FREES,
                          "blocks freed in at least every other step"),),
    references=("docs/field-cases.md#case-3", "docs/field-cases.md#case-5",
                "https://pytorch.org/docs/stable/notes/cuda.html#memory-management"),
)
def empty_cache_in_loop(run: RunResult) -> Iterator[Draft]:
    """cudaFree calls in the profiled steps: at least one every other step. Priced at least
    the calls' own time (a lower bound: the blocks the next step allocates again with
    cudaMalloc, and the GPU idle while the host catches up after each free's device sync,
    are not timed apart), at most that plus the step's GPU idle share; --try-fixes measures
    it (issue 55: 9% priced this way, 32% measured)."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        if ev.empty_cache_per_step < MIN_FREES:
            continue
        share = (min(1.0, ev.empty_cache_ms_per_step / stage.ms_per_iter)
                 if stage.ms_per_iter else 0.0)
        most = min(1.0, share + (ev.idle_fraction or 0.0))
        yield Draft(
            severity="warning", stage=stage.name,
            title=(f"{ev.empty_cache_per_step:.1f} cudaFree calls per step: allocator churn, "
                   f"at least {pct(share)} of the step (the frees alone), up to {pct(most)}"),
            impact=share,
            evidence={"frees_per_step": round(ev.empty_cache_per_step, 2),
                      "free_ms_per_step": round(ev.empty_cache_ms_per_step, 2),
                      "at_most": round(most, 3),
                      "price": "lower bound: the cudaFree calls' own time; the next step's "
                               "cudaMalloc of the same blocks and the GPU's idle after each "
                               "free's device sync come on top (at most: with the step's GPU "
                               "idle share); --try-fixes measures it"},
            fix="Delete the torch.cuda.empty_cache() call from the step.",
        )
