"""GD4xx, memory: pressure, growth and allocator churn."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gpudiag.diagnose.common import duration, measured_fix, measured_saving, pct
from gpudiag.diagnose.ledger import NoPart
from gpudiag.diagnose.ranks import memory_rank, rank_prefix
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.facts import KeptTensors, MemoryTimeline
from gpudiag.model.results import RunResult, StageResult

RESERVED_WARNING, FRAGMENTATION = 0.90, 0.20
MIN_FREES = 0.5
# Growth: over at least GROWTH_MIN_STEPS steps' changes (gpudiag's window apart), at least
# GROWTH_MIN_MIB in all, in each half at least GROWTH_HALF of it (a leak, not one jump).
GROWTH_MIN_STEPS, GROWTH_MIN_MIB, GROWTH_HALF, GROWTH_SKIP = 10, 64.0, 0.25, 3
# Kept tensors add live allocations: at least one every 20 counted steps (and 2 in all); bytes
# that grow without them are tensors that grew (examples/growing_lengths.py on an H200: +4 MiB
# a step, the live allocations flat).
MORE_BLOCKS_PER_STEP, MIN_MORE_BLOCKS = 0.05, 2
KNOB_MIN_MIB = 64.0  # a knob that frees less than this is not worth listing

GROWTH_THRESHOLDS = (
    Threshold("min_growth_mib", GROWTH_MIN_MIB,
              "grown at least 64 MiB over the steps counted (or a kept container's bytes a "
              "step, over them)"),
    Threshold("min_steps", GROWTH_MIN_STEPS, "at least 10 step-to-step changes counted"),
    Threshold("half_share", GROWTH_HALF,
              "each half of the steps holds a quarter of the growth: it goes on"),
    Threshold("skipped_steps", GROWTH_SKIP,
              "the first steps make the optimizer's state: not counted"),
    Threshold("more_blocks_per_step", MORE_BLOCKS_PER_STEP,
              "CUDA: kept tensors add a live allocation every 20 steps or more; bytes that "
              "grow without them are tensors that grew (information)"),
    Threshold("min_more_blocks", MIN_MORE_BLOCKS, "... and at least 2 in all"))


def _ranked(stage: StageResult, draft: Draft) -> Draft:
    """A finding from one rank's memory says which rank (its title and evidence); a process of
    no rank's is left as it is."""
    rank = memory_rank(stage)
    if rank is None:
        return draft
    return dataclasses.replace(draft, title=rank_prefix(stage) + draft.title,
                               evidence={**draft.evidence, "rank": rank})


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
                          "reserved exceeds allocated by 20% of the device"),
                Threshold("min_knob_mib", KNOB_MIN_MIB,
                          "a knob freeing less than 64 MiB is not listed"),
                *GROWTH_THRESHOLDS),
)
def memory_near_capacity(run: RunResult) -> Iterator[Draft]:
    """Peak reserved at least 90% of what the process may use (the device, or the cap the
    script set) (warning, with the knobs that would free memory, in bytes); reserved exceeding
    allocated by 20% of it (information: fragmentation)."""
    for stage in run.ok_stages():
        mem = stage.memory
        script = stage.facts.script
        timeline = script.memory if script is not None else None
        cap = timeline.cap_mib if timeline is not None else None
        capacity = cap or (mem.device_total_mib if mem is not None else None)
        if mem is None or not capacity:
            continue
        reserved = mem.peak_reserved_mib / capacity
        slack = (mem.peak_reserved_mib - mem.peak_allocated_mib) / capacity
        evidence: dict[str, object] = {"peak_allocated_mib": round(mem.peak_allocated_mib),
                    "peak_reserved_mib": round(mem.peak_reserved_mib),
                    "device_total_mib": round(mem.device_total_mib or 0), "cap_mib": cap}
        of = (f"the {_gib(cap)} the process may use (its set_per_process_memory_fraction)"
              if cap else "the GPU")
        if reserved >= RESERVED_WARNING:
            knobs = _fit_knobs(stage, timeline, script.warmup if script else 0,
                               cached_mib=mem.peak_reserved_mib - mem.peak_allocated_mib) \
                if timeline is not None else []
            evidence["knobs"] = knobs
            yield _ranked(stage, Draft(
                severity="warning", stage=stage.name,
                title=f"Peak reserved memory is {pct(reserved)} of {of}",
                impact=0.0, evidence=evidence,
                fix=("; ".join(f"({i}) {k}" for i, k in enumerate(knobs, 1)) + "."
                     if knobs else "Shrink the largest temporaries or the micro-batch "
                     "(gradient accumulation keeps the effective batch).")))
        elif slack >= FRAGMENTATION:
            yield _ranked(stage, Draft(
                severity="info", stage=stage.name,
                title=f"Allocator holds {pct(slack)} of {of} more than it uses",
                impact=0.0, evidence=evidence,
                fix="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces "
                    "fragmentation from varying tensor sizes."))


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
    """cudaFree calls in the profiled steps: at least one every other step, where the
    allocator did not retry (its own frees then: GD405 names them). Priced at least
    the calls' own time (a lower bound: the blocks the next step allocates again with
    cudaMalloc, and the GPU idle while the host catches up after each free's device sync,
    are not timed apart), at most that plus the step's GPU idle share; --try-fixes measures
    it (issue 55: 9% priced this way, 32% measured)."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        if ev.empty_cache_per_step < MIN_FREES or _retried(stage):
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


def _retried(stage: StageResult) -> bool:
    """The CUDA allocator freed its whole cache to retry an allocation during the run: the
    cudaFree calls the profiler saw are its own (GD405 names them), not the script's
    empty_cache (a capped run of examples/growing_lengths.py on the H200 read as GD402, the
    script calling none)."""
    script = stage.facts.script
    memory = script.memory if script is not None else None
    return memory is not None and bool(memory.alloc_retries)


@dataclass(frozen=True)
class Growth:
    """Memory that grows step after step."""

    series: str  # "allocated" (CUDA's tensors) or "resident" (the process, on a CPU)
    mib: float  # grown over the counted steps
    steps: int  # step changes counted
    first: int  # the first step counted
    now_mib: float  # at the last step listed
    limit_mib: float | None  # what it runs into: the device, or the host's memory
    # CUDA: whether the live allocations grew with the bytes (kept tensors) or not (tensors
    # that grew: larger inputs each step); None where not counted
    more_blocks: bool | None = None
    # The rate is a kept container's (KeptTensors: its bytes a step), not the counters': a
    # CPU's resident set, blurred by the allocator's reuse and trimming, may hide it.
    from_kept: bool = False

    @property
    def mib_per_step(self) -> float:
        return self.mib / self.steps

    @property
    def steps_left(self) -> float | None:
        if self.limit_mib is None or self.mib <= 0:
            return None
        return max(0.0, self.limit_mib - self.now_mib) / self.mib_per_step


def _steady_changes(series: Sequence[float], first: int,
                    window: tuple[int | None, int | None], reads: Sequence[int] = (),
                    ) -> list[float]:
    """Step-to-step changes of a per-step counter from step `first` on, less those into and
    out of gpudiag's profiler window (its own buffers). Where the reads were spaced (`reads`:
    the steps read; those between repeat the last read), from the first read at or after
    `first` to the last read: a repeated read is no change of its own."""
    start, end = window
    skipped = set() if start is None else set(range(start, (end or start) + 2))
    stop = len(series)
    if reads:
        first = next((r for r in reads if r >= first), first)
        stop = min(stop, reads[-1] + 1)
    return [series[i] - series[i - 1] for i in range(first + 1, stop) if i not in skipped]


def growth(memory: MemoryTimeline, warmup: int,
           window: tuple[int | None, int | None]) -> Growth | None:
    """The step-to-step changes of what tensors hold (CUDA) or of the process (a CPU), from
    the end of gpudiag's warm-up (and at least GROWTH_SKIP steps: an optimizer creates its
    state at its first step) on, less those into and out of gpudiag's profiler window (its
    buffers); a leak when they add up to GROWTH_MIN_MIB and each half of them holds at least
    GROWTH_HALF of it (growth that goes on, not a cache filled once)."""
    cuda = memory.device == "cuda"
    series = memory.allocated_mib if cuda else memory.resident_mib
    first = max(warmup, GROWTH_SKIP)
    changes = _steady_changes(series, first, window, memory.read_steps)
    if len(changes) < GROWTH_MIN_STEPS:
        return None
    total = sum(changes)
    half = len(changes) // 2
    if total < GROWTH_MIN_MIB or min(sum(changes[:half]), sum(changes[half:])) \
            < GROWTH_HALF * total:
        return None
    blocks = memory.live_blocks if cuda and len(memory.live_blocks) == len(series) else []
    more = None if not blocks else \
        blocks[-1] - blocks[first] >= max(MIN_MORE_BLOCKS, MORE_BLOCKS_PER_STEP * len(changes))
    return Growth(series="allocated" if cuda else "resident", mib=total, steps=len(changes),
                  first=first, now_mib=series[-1], more_blocks=more,
                  limit_mib=memory.device_total_mib if cuda else memory.host_total_mib)


def kept_growth(kept: KeptTensors | None, memory: MemoryTimeline,
                warmup: int) -> Growth | None:
    """Growth the script's own namespaces show (a container gaining tensors' bytes every step,
    between two looks) over the steps the counters would count, where those counters do not
    show it step by step: held to the same GROWTH_MIN_MIB over GROWTH_MIN_STEPS steps."""
    if kept is None or kept.bytes_per_step <= 0:
        return None
    cuda = memory.device == "cuda" and kept.device == "cuda"  # else the process holds them
    series = memory.allocated_mib if cuda else memory.resident_mib
    first = max(warmup, GROWTH_SKIP)
    steps = len(series) - 1 - first
    mib = kept.bytes_per_step / 2**20 * steps
    if steps < GROWTH_MIN_STEPS or mib < GROWTH_MIN_MIB:
        return None
    return Growth(series="allocated" if cuda else "resident", mib=mib, steps=steps,
                  first=first, now_mib=series[-1], from_kept=True,
                  limit_mib=memory.device_total_mib if cuda else memory.host_total_mib)


def _runs_out(found: Growth, stage: StageResult, planned: int | None) -> str:
    left = found.steps_left
    if left is None:
        return "how much memory is left is unknown"
    when = f", ~{duration(left * stage.ms_per_iter)} at this pace" if stage.ms_per_iter else ""
    where = "the GPU" if found.series == "allocated" else "the machine"
    plan = f" (the run plans {planned:,} steps)" if planned else ""
    return f"{where} runs out in ~{left:,.0f} more steps{when}{plan}"


@rule(
    "GD403", "memory-growth", concern="memory",
    summary=("Memory that grows step after step: tensors kept from every step, named where "
             "the script keeps them."),
    why=("A training step's memory is the same every step once the optimizer has made its "
         "state: what grows is kept by the script, most often a list of each step's outputs or "
         "losses (with their autograd graphs, when not detached). It ends in an out-of-memory "
         "error hours into the run, or in a smaller batch than the GPU could hold."),
    fix=("Keep what you log as Python numbers or detached, reduced tensors (loss.detach(), or "
         ".item() every N steps); keep only what the end-of-run metric needs (a running sum, a "
         "slice), on the CPU if it must be kept whole."),
    prices=NoPart("a risk of running out of memory, not time"),
    thresholds=GROWTH_THRESHOLDS,
    references=("https://pytorch.org/docs/stable/torch_cuda_memory.html",
                "https://pytorch.org/docs/stable/notes/faq.html"
                "#my-model-reports-cuda-runtime-error-2-out-of-memory"),
)
def memory_growth(run: RunResult) -> Iterator[Draft]:
    """What tensors hold on the device (a CPU run: the process's resident set) grows step
    after step past the warm-up: a warning, critical where the device runs out before the
    steps the run plans. Where the script's namespaces showed what grew (ScriptFacts.kept: a
    list gaining a tensor a step, a total keeping its graph), the finding names it, at the
    line that adds to it, with a fix for that line."""
    for stage in run.ok_stages():
        script = stage.facts.script
        if script is None or script.memory is None:
            continue
        timeline = script.timeline
        window = (timeline.window_start, timeline.window_end) if timeline else (None, None)
        kept = _keeping(script.kept)
        found = growth(script.memory, script.warmup, window) or \
            kept_growth(kept, script.memory, script.warmup)
        if found is None:
            continue
        planned = timeline.planned_steps if timeline else None
        left = found.steps_left
        dies = left is not None and planned is not None and \
            len(script.memory.resident_mib) + left < planned
        grows = _grows(found, _runs_out(found, stage, planned))
        evidence = {"series": found.series, "mib_per_step": round(found.mib_per_step, 2),
                    "grown_mib": round(found.mib, 1), "steps_counted": found.steps,
                    "from_step": found.first, "now_mib": round(found.now_mib, 1),
                    "limit_mib": found.limit_mib,
                    "steps_left": None if left is None else round(left),
                    "rate_from": "a kept container" if found.from_kept else "memory counters"}
        if kept is not None:
            evidence["kept"] = {"name": kept.name, "kind": kept.kind, "at": kept.location,
                                "added_per_step": kept.added_per_step,
                                "mib_per_step": round(kept.bytes_per_step / 2**20, 2),
                                "graph_kept": kept.graph_kept}
        evidence["more_live_blocks"] = found.more_blocks
        if found.more_blocks is False and kept is None:
            # As many tensors at every step's end, each larger: growing inputs, no leak.
            yield _ranked(stage, Draft(
                severity="critical" if dies else "info", stage=stage.name, impact=0.0,
                title=("The tensors a step holds at its end grow without growing in number "
                       "(larger inputs or buffers each step: a length curriculum, batches "
                       f"sorted by length), not kept tensors; {grows}"),
                evidence=evidence,
                fix=("If the sizes grow by design, bound them (a maximum length, a few length "
                     "buckets) so that the largest step fits; memory held at the step's end "
                     "is its inputs' and the model's.")))
            continue
        yield _ranked(stage, Draft(
            severity="critical" if dies else "warning", stage=stage.name,
            title=(f"{_what_keeps(kept)}: {grows}" if kept is not None
                   else grows[0].upper() + grows[1:]),
            impact=0.0, evidence=evidence, location=kept.location if kept else None,
            fix=(_kept_fix(kept) if kept is not None else
                 "Find what keeps each step's tensors (a list appended every step, a running "
                 "total that keeps its graph) and keep numbers or detached slices instead."),
        ))


def _grows(found: Growth, runs_out: str) -> str:
    """The growth, measured by the counters (or, where they blur it, by a kept container's
    bytes a step), and when the memory runs out."""
    where = "on the GPU" if found.series == "allocated" else "in the process"
    if found.from_kept:
        return (f"~{found.mib:,.0f} MiB over {found.steps} steps, {found.now_mib:,.0f} MiB "
                f"{where} now; {runs_out}")
    held = where if found.series == "allocated" else \
        f"{where} (its resident set; torch keeps no CPU count)"
    return (f"memory grows {found.mib_per_step:,.1f} MiB a step {held}: "
            f"+{found.mib:,.0f} MiB over {found.steps} steps, "
            f"{found.now_mib:,.0f} MiB now; {runs_out}")


def _keeping(kept: list[KeptTensors]) -> KeptTensors | None:
    """What keeps the most from every step: the container adding the most bytes a step,
    else a tensor whose autograd graph grows (its saved tensors are not counted)."""
    if not kept:
        return None
    return max(kept, key=lambda k: (k.bytes_per_step, k.kind == "tensor with its graph",
                                    k.added_per_step))


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:,.0f} KiB"


def _what_keeps(kept: KeptTensors) -> str:
    """"`history` (a list at train.py:58) gains 1 tensor (131.0 MiB, with its autograd graph)
    a step"."""
    at = f" at {kept.location}" if kept.location else ""
    if kept.kind == "tensor with its graph":
        return (f"`{kept.name}` (a tensor{at}) keeps its autograd graph, "
                f"{kept.added_per_step:,.0f} more nodes a step (each step's graph, with what "
                "backward() has not freed)")
    container = kept.kind.split(" ")[0]
    count = f"{kept.added_per_step:,.2g}"
    noun = "tensor" if kept.added_per_step == 1 else "tensors"
    graph = ", with its autograd graph" if kept.graph_kept else ""
    return (f"`{kept.name}` (a {container}{at}) gains {count} {noun} "
            f"({_size(kept.bytes_per_step)}{graph}) a step")


def _kept_fix(kept: KeptTensors) -> str:
    """The change at the line that keeps them."""
    at = f" at {kept.location}" if kept.location else ""
    if kept.kind == "tensor with its graph":
        return (f"Accumulate a number, not the graph{at}: `{kept.name} += loss.item()` (or "
                "`loss.detach()`, read with .item() when logged); each step's graph is freed "
                "with the step then.")
    steps = []
    if kept.graph_kept:
        steps.append("add `.detach()` to what is kept (its autograd graph holds the step's "
                     "activations too)")
    steps.append("keep only what the end-of-run metric needs: `.item()` for a number, a running "
                 "sum, or a slice copied out (`x[:, -1].clone()`: a view keeps its whole tensor)")
    if kept.device == "cuda":
        steps.append("or `.cpu()` to hold it in host memory")
    where = f" ({kept.location})" if kept.location else ""
    return f"At the line that adds to `{kept.name}`{where}: " + "; ".join(steps) + "."


# Bytes an optimizer keeps per fp32 parameter element: torch.optim's Adam family two moments,
# RMSprop and Adagrad one (torch/optim/adam.py, rmsprop.py, adagrad.py); SGD's momentum buffer
# only with momentum, which the facts do not say: not counted.
STATE_BYTES = {"Adam": 8, "AdamW": 8, "NAdam": 8, "RAdam": 8, "Adamax": 8, "RMSprop": 4,
               "Adagrad": 4}
ADAM_FAMILY = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax")


def _gib(mib: float) -> str:
    return f"{mib / 1024:,.2f} GiB" if mib >= 1024 else f"{mib:,.0f} MiB"


def _blocks(stage: StageResult) -> str:
    """What activation checkpointing would wrap, where the run looked at its models."""
    owners = stage.facts.script.owners if stage.facts.script is not None else None
    return f"its {owners.blocks}" if owners is not None and owners.blocks else \
        "the model's blocks"


def _fit_knobs(stage: StageResult, memory: MemoryTimeline, warmup: int, *,
               cached_mib: float | None = None, requested_mib: float | None = None,
               failed_at_mib: float | None = None) -> list[str]:
    """What would free memory, each priced in bytes from what the run measured, in the order
    they are worth trying: what grew, what the cache held (`cached_mib`: beyond what tensors
    held; where an allocation of `requested_mib` failed, only if it would have fit), the
    optimizer's state, the step's own allocations (at least `failed_at_mib` where a step
    failed: what tensors held then and the request)."""
    knobs = []
    timeline = stage.facts.script.timeline if stage.facts.script else None
    found = growth(memory, warmup, (timeline.window_start, timeline.window_end)
                   if timeline else (None, None))
    kept = _keeping(stage.facts.script.kept) if stage.facts.script else None
    if found is not None and found.more_blocks is False:  # as many tensors, larger
        knobs.append(f"memory grew {found.mib_per_step:,.1f} MiB a step from step "
                     f"{found.first} ({_gib(found.mib)}) with as many tensors, larger: a batch "
                     "or sequence that grows; its largest step is what must fit")
    elif found is not None:
        keeper = f"{_what_keeps(kept)}; " if kept is not None else ""
        knobs.append(f"memory grew {found.mib_per_step:,.1f} MiB a step from step "
                     f"{found.first}: {_gib(found.mib)} kept by the script ({keeper}GD403); "
                     "keep numbers or detached slices instead")
    if cached_mib is not None and (cached_mib >= requested_mib if requested_mib
                                   else cached_mib >= KNOB_MIN_MIB):
        pieces = (f"in pieces none of which fit {_gib(requested_mib)}" if requested_mib
                  else "beyond what tensors used at the peak")
        knobs.append(f"the allocator held {_gib(cached_mib)} cached {pieces}: "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True grows a segment instead "
                     "(no code change)")
    script = stage.facts.script
    state = sum(STATE_BYTES.get(o.name, 0) * o.numel for o in script.optimizers) / 2**20 \
        if script else 0.0
    adam = script is not None and any(o.name in ADAM_FAMILY for o in script.optimizers)
    if state >= KNOB_MIN_MIB:
        knobs.append(f"the optimizer's state, {_gib(state)} in fp32: "
                     + (f"bf16 state saves half, 8-bit (bitsandbytes' AdamW8bit) three "
                        f"quarters ({_gib(state * 0.75)}); " if adam else "")
                     + "sharding it (ZeRO-1, FSDP) divides it by the GPUs")
    weights = 8 * sum(o.numel for o in script.optimizers) / 2**20 if script else 0.0
    # A step that failed needed what was held then and the request at least.
    peak = max(max(memory.peak_mib, default=0.0), failed_at_mib or 0.0)
    step_own = peak - weights - state if peak and weights else None
    if step_own is not None and step_own >= KNOB_MIN_MIB:
        knobs.append(f"the step's own allocations (activations and temporaries), ~"
                     f"{_gib(step_own)} at the peak beyond the fp32 weights, gradients and "
                     "state (an estimate): half the micro-batch with 2 accumulation steps "
                     f"saves about half ({_gib(step_own / 2)}); activation checkpointing of "
                     f"{_blocks(stage)} most of them, for about one more forward's time "
                     "(--try-fixes measures both)")
    elif step_own is None and failed_at_mib and failed_at_mib >= KNOB_MIN_MIB:
        knobs.append(f"the step needed {_gib(failed_at_mib)} at least (what tensors held when it "
                     "failed and its request; weights, gradients and activations not told "
                     f"apart: it failed before a step ended): activation checkpointing of "
                     f"{_blocks(stage)}, or half the micro-batch with 2 accumulation steps, cuts "
                     "what activations hold (--try-fixes measures checkpointing)")
    return knobs


@rule(
    "GD404", "out-of-memory", concern="memory",
    summary="The run died of an allocation that failed: what held memory, and what would fit.",
    why=("An out-of-memory error ends the run with PyTorch's traceback and a size; what held "
         "the memory, whether it grew, and which setting would make the step fit are what the "
         "engineer needs next."),
    fix=("In the order the finding lists: stop what grows, let the allocator reuse its cache, "
         "lighten or shard the optimizer's state, then shrink what one step allocates (a "
         "smaller micro-batch with gradient accumulation, activation checkpointing)."),
    prices=NoPart("the run died: each knob is priced in the bytes it frees, not in time"),
    thresholds=(Threshold("min_knob_mib", KNOB_MIN_MIB,
                          "a knob freeing less than 64 MiB is not listed"),
                *GROWTH_THRESHOLDS),
    references=("https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-"
                "pytorch-cuda-alloc-conf",
                "https://pytorch.org/docs/stable/torch_cuda_memory.html"),
)
def out_of_memory(run: RunResult) -> Iterator[Draft]:
    """A profiled script that died of CUDA's out-of-memory error (or the CPU allocator's): the
    allocation, the memory held then, and the knobs that would make it fit, in bytes."""
    for stage in run.stages:
        script = stage.facts.script
        memory = script.memory if script else None
        if script is None or memory is None or memory.oom is None:
            continue
        oom = memory.oom
        where = "the GPU" if oom.device == "cuda" else "the machine"
        held = (f" with {_gib(oom.allocated_mib)} held by tensors ({_gib(oom.reserved_mib)} "
                "reserved)" if oom.allocated_mib is not None and oom.reserved_mib is not None
                else "")
        total = memory.device_total_mib or oom.device_total_mib if oom.device == "cuda" \
            else memory.host_total_mib
        of = f" of {where}'s {_gib(total)}" if total else f" on {where}"
        if oom.cap_mib:
            of = (f" of the {_gib(oom.cap_mib)} the process may use (its "
                  f"set_per_process_memory_fraction; {where} holds {_gib(total or 0.0)})")
        asked = f"{_gib(oom.requested_mib)} requested" if oom.requested_mib else \
            "an allocation failed"
        cached = oom.reserved_mib - oom.allocated_mib \
            if oom.reserved_mib is not None and oom.allocated_mib is not None else None
        failed_at = oom.allocated_mib + (oom.requested_mib or 0.0) \
            if oom.allocated_mib is not None else None
        knobs = _fit_knobs(stage, memory, script.warmup, cached_mib=cached,
                           requested_mib=oom.requested_mib, failed_at_mib=failed_at)
        yield _ranked(stage, Draft(
            severity="critical", stage=stage.name, location=oom.line,
            title=f"Out of memory at step {oom.step}: {asked}{held}{of}",
            impact=0.0,
            evidence={"device": oom.device, "step": oom.step, "message": oom.message,
                      "requested_mib": oom.requested_mib, "allocated_mib": oom.allocated_mib,
                      "reserved_mib": oom.reserved_mib, "free_mib": oom.device_free_mib,
                      "peak_mib": max(memory.peak_mib, default=None), "knobs": knobs},
            fix=("; ".join(f"({i}) {k}" for i, k in enumerate(knobs, 1)) + "."
                 if knobs else "No owner of the memory was measured before the failure (on "
                 "a CPU the allocator keeps no counters): `gpudiag profile --try-fixes` "
                 "measures what frees memory (activation checkpointing of the model's "
                 "blocks); a smaller micro-batch with gradient accumulation keeps the "
                 "effective batch."),
        ))


MALLOC_MIN, MALLOC_WARNING = 0.05, 0.5  # cudaMalloc calls a steady step: named, warned


def _steady_mallocs(memory: MemoryTimeline, warmup: int,
                    window: tuple[int | None, int | None]) -> tuple[float, int]:
    """cudaMalloc calls per step past the warm-up and the optimizer's first steps, gpudiag's
    window apart (its buffers); and the steps counted."""
    changes = _steady_changes(memory.device_allocs, max(warmup, GROWTH_SKIP), window,
                              memory.read_steps)
    return (sum(changes) / len(changes) if changes else 0.0), len(changes)


@rule(
    "GD405", "allocator-misses", concern="memory",
    summary="The CUDA allocator asking the driver for memory in steady state, or retrying.",
    why=("The caching allocator exists so that a step's allocations come from its cache: a "
         "cudaMalloc in steady state (tensor sizes that keep changing, memory cut into pieces "
         "no request fits) synchronises the device and costs milliseconds, and a retry means "
         "it freed its whole cache to find room: the edge of out-of-memory."),
    fix=("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (segments grow instead of new "
         "blocks per size); keep tensor sizes steady (pad variable lengths to a few buckets)."),
    prices=NoPart("what --try-fixes measured with expandable segments; the allocator's calls "
                  "are no part of the step's accounts"),
    thresholds=(Threshold("min_mallocs_per_step", MALLOC_MIN,
                          "a cudaMalloc every 20 steady steps is named"),
                Threshold("warning_mallocs_per_step", MALLOC_WARNING,
                          "one every other step is a warning (so is any retry)"),
                *GROWTH_THRESHOLDS),
    references=("https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-"
                "pytorch-cuda-alloc-conf",),
)
def allocator_misses(run: RunResult) -> Iterator[Draft]:
    """A profiled CUDA script whose allocator called cudaMalloc past its warm-up at least once
    every 20 steps (a warning from one every other step), or retried after freeing its cache
    (a warning); not where kept tensors grow (GD403: growth needs new memory) or the script
    empties the cache every step (GD402 names it)."""
    for stage in run.ok_stages():
        script = stage.facts.script
        memory = script.memory if script else None
        if script is None or memory is None or memory.device != "cuda":
            continue
        timeline = script.timeline
        window = (timeline.window_start, timeline.window_end) if timeline else (None, None)
        grown = growth(memory, script.warmup, window)
        if (grown is not None and grown.more_blocks is not False) or (
                stage.evidence is not None and stage.evidence.empty_cache_per_step >= MIN_FREES
                and not _retried(stage)):
            continue
        mallocs, counted = _steady_mallocs(memory, script.warmup, window)
        retries = memory.alloc_retries or 0
        if (mallocs < MALLOC_MIN or counted < GROWTH_MIN_STEPS) and not retries:
            continue
        saved = measured_saving(run, "expandable-segments")
        fix = measured_fix(run, "expandable-segments")
        price = ("not priced: `gpudiag profile --try-fixes` measures expandable segments"
                 if saved is None or fix is None else
                 f"turning expandable segments on measured {pct(saved)} faster" if saved else
                 f"turning expandable segments on measured no faster ({fix.speedup:.2f}x, "
                 f"{fix.speedup_low or 0:.2f}-{fix.speedup_high or 0:.2f}): the misses cost "
                 "little here")
        said = [f"{mallocs:.2f} cudaMalloc calls a step past warm-up"] if mallocs >= MALLOC_MIN \
            else []
        said += [f"{retries} retries after freeing the whole cache"] if retries else []
        yield _ranked(stage, Draft(
            severity="warning" if (retries or mallocs >= MALLOC_WARNING) and saved != 0.0
            else "info",
            stage=stage.name, impact=saved or 0.0,
            title=f"The CUDA allocator misses its cache: {' and '.join(said)}; {price}",
            evidence={"mallocs_per_step": round(mallocs, 3), "steps_counted": counted,
                      "alloc_retries": retries, "measured_saving": saved,
                      "reserved_mib": max(memory.reserved_mib, default=None),
                      "peak_mib": max(memory.peak_mib, default=None)},
            fix=("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the job's "
                 "environment; where tensor sizes vary step to step (sequence lengths), pad "
                 "them to a few fixed sizes."),
        ))


HOST_WARNING, HOST_CRITICAL = 0.80, 0.95  # of the host's limit, the process and children


@dataclass(frozen=True)
class HostHeld:
    """What the script's processes held on the host at one recorded step's end: in all (the
    cgroup's anonymous memory where its limit applies, else their resident sets' sum), and
    the process's and its children's resident sets, or the pages of their own where those
    were read (a forked worker's resident set counts the pages it shares with the script)."""

    step: int
    mib: float
    process_mib: float
    children: int
    children_mib: float
    own: bool = False  # the process's and children's figures are their private pages


def _host_held(memory: MemoryTimeline, step: int) -> HostHeld:
    children = memory.children_resident_mib
    theirs = children[step] if step < len(children) else 0.0
    count = memory.children[step] if step < len(memory.children) else 0
    own = memory.resident_mib[step]
    used = memory.host_used_mib
    return HostHeld(step, used[step] if step < len(used) else own + theirs, own, count, theirs)


def _latest_held(memory: MemoryTimeline, held: HostHeld) -> HostHeld:
    """`held`, its parts the processes' own pages where they were read at that step (near
    the limit: before a kill, the last step recorded)."""
    private = memory.private
    if private is None or private.step != held.step:
        return held
    # Without a cgroup's count, the resident sets' sum counts each page a fork shares once per
    # process: their proportional sets' sum counts it once.
    together = private.together_mib if not memory.host_used_mib else None
    return HostHeld(held.step, together or held.mib, private.process_mib, private.children,
                    private.children_mib, own=True)


def _host_capacity(memory: MemoryTimeline) -> tuple[float, str] | None:
    """What the processes may hold on the host, and how to say it: a cgroup's limit where it
    is below the machine's memory (a container's, a Slurm job's), else the machine's."""
    limit = memory.host_limit
    if limit is not None and limit.source != "machine":
        return limit.limit_mib, (f"the container's {_gib(limit.limit_mib)} limit (cgroup "
                                 f"{limit.source.split()[-1]}; the machine has "
                                 f"{_gib(limit.machine_mib or 0.0)})")
    total = limit.limit_mib if limit is not None else memory.host_total_mib
    return (total, f"the machine's {_gib(total)}") if total else None


def _holders(held: HostHeld, pinned_mib: float | None) -> str:
    own = " of its own" if held.own else ""
    kids = (f", its {held.children} child processes {_gib(held.children_mib)}"
            f"{' of their own' if held.own else ''} "
            f"(~{_gib(held.children_mib / held.children)} each)" if held.children else "")
    pinned = f"; {_gib(pinned_mib)} of it page-locked (pinned)" if pinned_mib else ""
    shared = held.mib - held.process_mib - held.children_mib
    together = (f", {_gib(shared)} shared between them (the script's pages its forks still "
                "share)" if held.own and shared >= 1 else "")
    return f"the process {_gib(held.process_mib)}{own}{kids}{together}{pinned}"


@rule(
    "GD406", "host-memory-near-capacity", concern="memory",
    summary=("The script and its child processes (DataLoader workers) near the host memory "
             "they may use (a container's cgroup limit, else the machine's), or killed by the "
             "kernel's out-of-memory killer."),
    why=("Host memory runs out before the GPU's in many input pipelines: each DataLoader worker "
         "is a process holding its own copy of what the dataset object references (Python "
         "objects' reference counts touch their pages, so a fork's copy-on-write copies them), "
         "and pinned batches are page-locked. In a container, a Slurm job or a Kubernetes pod "
         "the limit is its cgroup's, often far below the machine's. The kernel's out-of-memory "
         "killer then ends the run with SIGKILL (exit 137) and no Python traceback at all."),
    fix=("Fewer workers or a smaller prefetch_factor; keep the dataset as memory-mapped arrays "
         "or tensors (np.memmap, torch.from_file, a datasets.Dataset), not Python lists of "
         "objects each worker copies; pin_memory only where the copies overlap compute."),
    prices=NoPart("a risk of a host out-of-memory kill, or the kill itself, not time"),
    thresholds=(Threshold("warning_share", HOST_WARNING,
                          "the process and its children hold 80% of the host memory they may "
                          "use; a SIGKILL with 80% held is the out-of-memory killer's"),
                Threshold("critical_share", HOST_CRITICAL, "... 95%"),
                Threshold("min_knob_mib", KNOB_MIN_MIB,
                          "a knob freeing less than 64 MiB is not listed")),
    references=("https://docs.kernel.org/admin-guide/cgroup-v2.html#memory-interface-files",
                "https://pytorch.org/docs/stable/data.html#multi-process-data-loading"),
)
def host_memory_near_capacity(run: RunResult) -> Iterator[Draft]:
    """A profiled script whose resident set and its child processes' (read at each step's
    end) reach 80% of the host memory they may use at their highest (the cgroup's limit where
    it is the smaller; what they hold, the cgroup's anonymous memory where it counts it, else
    their resident sets' sum, each shared page once where their proportional sets were read):
    who holds it, the children (DataLoader workers, compile workers) apart and each on
    average, and the pinned host memory where CUDA kept some. A script (or a
    DataLoader worker) that died of SIGKILL: the kernel's out-of-memory killer where it counted
    a kill or the last steps held 80%, a critical finding with the knobs in bytes; else a kill
    from elsewhere, said to be of unknown cause."""
    for stage in run.stages:
        script = stage.facts.script
        memory = script.memory if script else None
        capacity = _host_capacity(memory) if memory is not None else None
        if memory is None or capacity is None or not memory.resident_mib:
            continue
        held = [_host_held(memory, i) for i in range(len(memory.resident_mib))]
        if memory.killed is not None:
            yield _ranked(stage, _host_kill(stage, memory, held, capacity))
            continue
        top = max(held, key=lambda h: h.mib)
        read = memory.private.step if memory.private is not None else len(held)
        if read < len(held) and held[read].mib >= top.mib:  # as high, its own pages read
            top = held[read]
        top = _latest_held(memory, top)
        share = top.mib / capacity[0]
        if share < HOST_WARNING:
            continue
        yield _ranked(stage, Draft(
            severity=severity_for(share, warning=HOST_WARNING, critical=HOST_CRITICAL),
            stage=stage.name, impact=0.0,
            title=(f"The script and its child processes hold {_gib(top.mib)} of "
                   f"{capacity[1]} ({share:.0%}) at step {top.step}: "
                   f"{_holders(top, memory.pinned_host_mib)}"),
            evidence={"held_mib": round(top.mib, 1), "host_total_mib": memory.host_total_mib,
                      "limit_mib": capacity[0],
                      "limit_source": memory.host_limit.source if memory.host_limit else None,
                      "process_mib": top.process_mib, "children": top.children,
                      "children_mib": round(top.children_mib, 1),
                      "pinned_mib": memory.pinned_host_mib, "step": top.step},
            fix=("Fewer DataLoader workers or a smaller prefetch_factor (each worker is a process "
                 "with its own copy of what the dataset object references); keep the data as "
                 "memory-mapped arrays or tensors, not Python lists of objects; pin_memory only "
                 "where the copies overlap compute."),
        ))


def _host_kill(stage: StageResult, memory: MemoryTimeline, held: Sequence[HostHeld],
               capacity: tuple[float, str]) -> Draft:
    """A process that died of SIGKILL: the out-of-memory killer's where the kernel counted a
    kill in the cgroup whose limit applies, or the last recorded step held 80% of the limit;
    else a kill of unknown cause (a scheduler's preemption, a `kill -9`), never guessed to be
    memory. The machine's own count (/proc/vmstat) is any process's kill, in any cgroup: said,
    never taken for this process's."""
    last = _latest_held(memory, held[-1])
    limit = memory.host_limit
    counted = (limit.oom_kills_after - limit.oom_kills
               if limit is not None and limit.oom_kills_after is not None
               and limit.oom_kills is not None else None)
    if limit is not None and limit.source == "machine":
        return _machine_kill(stage, memory, last, capacity, counted)
    share = last.mib / capacity[0]
    who = ("A DataLoader worker" if memory.killed == "worker" else "The script's process")
    evidence = {"killed": memory.killed, "oom_kills_counted": counted,
                "held_mib": round(last.mib, 1), "limit_mib": capacity[0],
                "limit_source": limit.source if limit else None, "step": last.step,
                "process_mib": last.process_mib, "children": last.children,
                "children_mib": round(last.children_mib, 1),
                "pinned_mib": memory.pinned_host_mib}
    lost = ("" if memory.killed == "worker" else
            f" (recorded up to step {last.step}; the steps after its last report are lost "
            "with it)")
    if not counted and share < HOST_WARNING:
        count = ("no out-of-memory kill counted" if counted == 0 else
                 "no count of out-of-memory kills readable")
        return _unknown_kill(stage, f"{who} died of SIGKILL{lost} with {_gib(last.mib)} of "
                             f"{capacity[1]} ({share:.0%}) held at its last recorded step and "
                             f"{count}", evidence)
    how = (f"the kernel counted {counted} out-of-memory kill{'s' if counted != 1 else ''} "
           f"under {capacity[1]}" if counted else
           f"its last recorded step held {share:.0%} of {capacity[1]}")
    knobs = _host_knobs(stage, memory, last)
    return Draft(
        severity="critical", stage=stage.name, impact=0.0,
        title=(f"{who} was killed by the kernel's out-of-memory killer (SIGKILL, no Python "
               f"traceback){lost}: {how}; at step {last.step} "
               f"{_holders(last, memory.pinned_host_mib)}, {_host_growth(held)}"),
        evidence={**evidence, "knobs": knobs},
        fix="; ".join(f"({i}) {k}" for i, k in enumerate(knobs, 1)) + ".",
    )


def _unknown_kill(stage: StageResult, said: str, evidence: dict[str, Any]) -> Draft:
    return Draft(
        severity="warning", stage=stage.name, impact=0.0,
        title=(f"{said}: the cause is unknown (a SIGKILL from elsewhere: a scheduler's "
               "preemption or time limit, a `kill -9`), not host memory as recorded"),
        evidence=evidence,
        fix=("Look at what sends SIGKILL on this machine: the job scheduler's logs (a time or "
             "memory limit of its own), `dmesg` or `journalctl -k` for the kernel's messages "
             "(an out-of-memory kill names its victim there), another user's kill."),
    )


def _machine_kill(stage: StageResult, memory: MemoryTimeline, last: HostHeld,
                  capacity: tuple[float, str], counted: int | None) -> Draft:
    """A SIGKILL where no cgroup limits the host's memory: the killer's where the last step
    held 80% of the machine's, else of unknown cause, the machine's count of kills (any
    process's) said beside it."""
    share = last.mib / capacity[0]
    who = "A DataLoader worker" if memory.killed == "worker" else "The script's process"
    anywhere = (f"; the kernel counted {counted} out-of-memory kill{'s' if counted != 1 else ''}"
                " on the machine over the run (of any process: `dmesg` names each victim)"
                if counted else "")
    evidence = {"killed": memory.killed, "machine_oom_kills_counted": counted,
                "held_mib": round(last.mib, 1), "limit_mib": capacity[0],
                "limit_source": "machine", "step": last.step}
    if share < HOST_WARNING:
        return _unknown_kill(stage, f"{who} died of SIGKILL (recorded up to step {last.step}) "
                             f"with {_gib(last.mib)} of {capacity[1]} ({share:.0%}) held at its "
                             f"last recorded step{anywhere}", evidence)
    knobs = _host_knobs(stage, memory, last)
    return Draft(
        severity="critical", stage=stage.name, impact=0.0,
        title=(f"{who} was killed by the kernel's out-of-memory killer (SIGKILL, no Python "
               f"traceback) (recorded up to step {last.step}): it held {share:.0%} of "
               f"{capacity[1]} at its last recorded step, "
               f"{_holders(last, memory.pinned_host_mib)}{anywhere}"),
        evidence={**evidence, "knobs": knobs},
        fix="; ".join(f"({i}) {k}" for i, k in enumerate(knobs, 1)) + ".",
    )


def _host_growth(held: Sequence[HostHeld]) -> str:
    first, last = held[0], held[-1]
    if last.step == first.step:
        return "one step recorded"
    grew = last.mib - first.mib
    return (f"{'+' if grew >= 0 else ''}{_gib(grew) if grew >= 0 else '-' + _gib(-grew)} since "
            f"step {first.step} ({grew / (last.step - first.step):,.1f} MiB a step)")


def _host_knobs(stage: StageResult, memory: MemoryTimeline, last: HostHeld) -> list[str]:
    """What would bring the host's share down, each in the bytes the run measured: the
    workers' copies, the batches they prefetch, the pinned batches, the dataset's form."""
    script = stage.facts.script
    loader = next((use for use in script.loaders if use.training), None) if script else None
    workers = loader.settings.num_workers if loader else last.children
    knobs = []
    half = max(1, workers // 2)
    if last.children and workers > half:
        each = last.children_mib / last.children
        knobs.append(f"fewer DataLoader workers: each holds ~{_gib(each)} of its own, so "
                     f"num_workers={half} instead of {workers} frees "
                     f"~{_gib(each * (workers - half))}" if last.own else
                     f"fewer DataLoader workers: each's resident set is ~{_gib(each)}, the "
                     f"pages it still shares with the script counted, so num_workers={half} "
                     f"instead of {workers} frees less than {_gib(each * (workers - half))}")
    factor = (loader.settings.prefetch_factor or 2) if loader is not None else 2
    ready = workers * (factor - 1) * (loader.batch_bytes or 0) / 2**20 if loader else 0.0
    if ready >= KNOB_MIN_MIB:
        knobs.append(f"a smaller prefetch_factor: {workers} workers x {factor} batches of "
                     f"{_gib(ready / workers / (factor - 1))} wait ready; prefetch_factor=1 "
                     f"frees ~{_gib(ready)}")
    if memory.pinned_host_mib:
        knobs.append(f"pin_memory=False where the copies need not overlap compute: "
                     f"{_gib(memory.pinned_host_mib)} page-locked at its highest")
    elif loader is not None and loader.settings.pin_memory:
        knobs.append("pin_memory=False where the copies need not overlap compute: its pinned "
                     "batches are page-locked, never swapped")
    knobs.append("the dataset as memory-mapped arrays or tensors (np.memmap, torch.from_file, "
                 "a datasets.Dataset) instead of Python objects: a fork's workers share those "
                 "pages, where touching an object's reference count copies its page into each "
                 + (f"worker (~{_gib(last.children_mib / last.children)} each here)"
                    if last.children else "worker"))
    return knobs
