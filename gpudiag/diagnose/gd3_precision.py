"""Precision: fp32 matmuls without TF32, fp32 fallbacks inside autocast, idle tensor pipes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

from gpudiag.diagnose.ceilings import utilisation
from gpudiag.diagnose.common import pct
from gpudiag.diagnose.ledger import NoPart, device_time
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.facts import ConvLayout
from gpudiag.model.results import MEMORY_BOUND_KINDS, RunResult, StageResult

# fp32 matmuls without TF32 on a tensor-core GPU run ~7x below the TF32 rate on Hopper
# (67 vs 495 TFLOP/s dense, gpudiag/model/hardware.py); what TF32/autocast can win is most
# of their time.
RECOVERABLE_FP32_MATMUL = 0.8
FP32_MIN_SHARE, FP32_WARNING = 0.30, 0.10
FALLBACK_MIN_SHARE, FALLBACK_WARNING = 0.10, 0.05
TENSOR_MAX_PCT, TENSOR_MIN_MATMUL, TENSOR_MAX_IDLE = 10, 0.30, 0.25
RECOVERABLE = Threshold("recoverable_share", RECOVERABLE_FP32_MATMUL,
                        "of fp32 matmul time, what the matrix units win back (the impact)")


def _matmul_share(stage: StageResult, dtype: str) -> tuple[float, float]:
    """(ms of `dtype` matmuls per step, their share of all kernel time)."""
    ev = stage.evidence
    if ev is None or not ev.device_ms_per_step:
        return 0.0, 0.0
    ms = ev.matmul_ms_by_dtype.get(dtype, 0.0)
    return ms, ms / ev.device_ms_per_step


def _tensor_core_gpu(run: RunResult) -> bool:
    cc = run.env.compute_capability
    return cc is not None and float(cc) >= 8.0


@rule(
    "GD301", "fp32-matmul", concern="precision",
    summary="fp32 matmuls with TF32 off and no autocast on a tensor-core GPU.",
    why=("Ampere and newer GPUs run fp32 matmuls on the matrix units only as TF32 (or in "
         "fp16/bf16 under autocast); with TF32 off they use the far slower fp32 pipes: on an "
         "H100, 67 against 495 (TF32) or 989 (bf16) dense TFLOP/s."),
    fix=("torch.backends.cuda.matmul.allow_tf32 = True (or "
         "torch.set_float32_matmul_precision('high')) and torch.backends.cudnn.allow_tf32 = "
         "True; better, train under torch.autocast with bf16 or fp16."),
    prices=device_time("what TF32 or autocast would win of the fp32 matmuls' kernel time"),
    thresholds=(Threshold("min_fp32_matmul_share", FP32_MIN_SHARE,
                          "fp32 matmuls take at least 30% of kernel time"),
                Threshold("warning_impact", FP32_WARNING,
                          "the time TF32 or autocast would win, over the step: warning"),
                RECOVERABLE),
    references=("https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices",),
)
def fp32_matmul(run: RunResult) -> Iterator[Draft]:
    """On compute capability 8.0+, with TF32 matmul off, fp32 matmuls take 30%+ of kernel time
    in a stage without autocast. The ladder's deliberate fp32 rungs get information only."""
    if not _tensor_core_gpu(run) or run.env.tf32_matmul:
        return
    for stage in run.stages_with_evidence():
        if stage.facts.precision not in (None, "fp32"):
            continue
        ms, share = _matmul_share(stage, "fp32")
        if share < FP32_MIN_SHARE:
            continue
        impact = share * RECOVERABLE_FP32_MATMUL
        evidence: dict[str, object] = {"fp32_matmul_ms_per_step": round(ms, 2),
                                       "share_of_kernel_time": round(share, 3),
                                       "tf32_matmul": run.env.tf32_matmul}
        ref = run.stage_in_role("reference")
        note = ""
        if (ref is not None and ref.ok and ref.ms_per_iter and stage.ms_per_iter
                and not stage.facts.inference):
            evidence["mixed_precision_speedup_in_this_run"] = round(
                stage.ms_per_iter / ref.ms_per_iter, 2)
            note = f"; {ref.name} runs {stage.ms_per_iter / ref.ms_per_iter:.1f}x faster here"
        deliberate = stage.facts.deliberate_fp32
        yield Draft(
            severity="info" if deliberate else severity_for(impact, warning=FP32_WARNING),
            stage=stage.name,
            title=(f"fp32 matmuls with TF32 off take {pct(share)} of kernel time{note}"
                   + (" (the ladder's fp32 rung, by design)" if deliberate else "")),
            impact=impact,
            evidence=evidence,
            fix=("Enable TF32 (torch.backends.cuda.matmul.allow_tf32 = True; "
                 "torch.backends.cudnn.allow_tf32 = True) or train under "
                 "torch.autocast('cuda', dtype=torch.bfloat16)."),
        )


@rule(
    "GD302", "autocast-fp32-fallback", concern="precision",
    summary="Matmuls that still run in fp32 inside an autocast region.",
    why=("autocast casts matmul inputs to fp16/bf16, unless they are computed outside the region, "
         "in a custom op, or on inputs autocast does not touch; such matmuls lose the matrix "
         "units' rate."),
    fix=("Find the fp32 matmuls (the profiler's top ops) and run them inside the autocast "
         "region, or cast their inputs explicitly."),
    prices=device_time("what 16-bit operands would win of the fp32 matmuls' kernel time"),
    thresholds=(Threshold("min_fp32_share_of_matmul", FALLBACK_MIN_SHARE,
                          "a tenth of matmul time left in fp32"),
                Threshold("warning_kernel_share", FALLBACK_WARNING,
                          "those fp32 matmuls' share of kernel time: warning"),
                RECOVERABLE),
)
def autocast_fp32_fallback(run: RunResult) -> Iterator[Draft]:
    """On a tensor-core GPU, in an autocast stage, fp32 matmuls are 10%+ of matmul time."""
    if not _tensor_core_gpu(run):
        return
    for stage in run.stages_with_evidence():
        precision = stage.facts.precision or ""
        if not precision.endswith("autocast") or stage.evidence is None:
            continue
        by_dtype = stage.evidence.matmul_ms_by_dtype
        total = sum(by_dtype.values())
        fp32 = by_dtype.get("fp32", 0.0)
        if not total or fp32 / total < FALLBACK_MIN_SHARE:
            continue
        _, kernel_share = _matmul_share(stage, "fp32")
        yield Draft(
            severity=severity_for(kernel_share, warning=FALLBACK_WARNING),
            stage=stage.name,
            title=(f"{pct(fp32 / total)} of matmul time still runs in fp32 under {precision}"),
            impact=kernel_share * RECOVERABLE_FP32_MATMUL,
            evidence={"matmul_ms_by_dtype": {k: round(v, 3) for k, v in by_dtype.items()}},
            fix=("Move those matmuls inside torch.autocast, or cast their inputs to "
                 f"{precision.split('-')[0]} explicitly."),
        )


@rule(
    "GD303", "low-tensor-activity", concern="precision",
    summary="Matmul-heavy mixed-precision stage with the tensor pipes mostly idle (GPM).",
    why=("GPM's tensor-pipe activity says how much of the time the matrix units worked; when "
         "matmuls dominate the kernels but this stays low, they are too small or memory-bound."),
    fix="Larger matmuls (batch, hidden sizes multiple of 64), fused attention, fewer reshapes.",
    prices=NoPart("its findings are information and price no time"),
    thresholds=(Threshold("max_tensor_active_pct", TENSOR_MAX_PCT,
                          "tensor pipes busy under 10% of the time"),
                Threshold("min_matmul_share", TENSOR_MIN_MATMUL, "matmuls are 30%+ of kernel time"),
                Threshold("max_idle_fraction", TENSOR_MAX_IDLE,
                          "a starved GPU idles its tensor pipes for other reasons")),
)
def low_tensor_activity(run: RunResult) -> Iterator[Draft]:
    """GPM tensor activity under 10% in an autocast stage where matmuls take 30%+ of kernel
    time and the GPU is not starved (idle under 25%): information, with the stage's MFU
    against the measured (peak stage) or datasheet ceiling when FLOPs were counted."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        tensor = stage.telemetry.gpm.get("tensor_active_pct")
        if (ev is None or tensor is None or tensor >= TENSOR_MAX_PCT
                or not (stage.facts.precision or "").endswith("autocast")
                or (ev.idle_fraction or 0.0) >= TENSOR_MAX_IDLE or not ev.device_ms_per_step):
            continue
        share = sum(ev.matmul_ms_by_dtype.values()) / ev.device_ms_per_step
        if share < TENSOR_MIN_MATMUL:
            continue
        use = utilisation(run, stage)
        mfu = use["mfu"] if use else None
        ceiling = (f"; the stage runs at {mfu:.0%} of {use['ceiling']} {use['dtype']} peak"
                   if use and mfu is not None else "")
        yield Draft(
            severity="info", stage=stage.name,
            title=(f"Tensor pipes active {tensor:.0f}% while matmuls are {pct(share)} of "
                   f"kernels{ceiling}"),
            impact=0.0,
            evidence={"tensor_active_pct": tensor, "matmul_share": round(share, 3),
                      "mfu": None if mfu is None else round(mfu, 3),
                      "achieved_tflops": None if use is None else round(use["tflops"], 1)},
            fix="Make matmuls larger (batch, sequence) and dimensions multiples of 64.",
        )


# Convolutions (and cuDNN's transposes around them) this share of the kernel time: the layout
# is worth a word. A warning where the transposes alone hold this share of the step, or where
# the convolution blocks (convolutions, transposes, batch norms) hold half the kernel time in
# 16 bits with an NCHW input recorded: NCHW batch norms and cuDNN's NCHW algorithms cost more
# than the transposes, and the trace does not say how much (an H200 ResNet-style step's norms
# held 60% of its kernel time; channels_last measured 2.54x).
CONV_MIN_SHARE, LAYOUT_WARNING, CONV_BLOCK_WARNING = 0.20, 0.05, 0.50
LAYOUT_MIN_SHARE = 0.01  # of the kernel time in layout transposes: NCHW seen in the trace
CONV_KINDS = frozenset({"convolution", "layout"})

MEMORY_WARNING, MEMORY_CRITICAL = 0.50, 0.75  # of the step's kernel time
MEMORY_MAX_IDLE = 0.25  # idler than this, the host sets the pace (GD102), not the kernels
# Short of half the kernel time, a warning still where fusing them saves this much of the step
# by the bytes model (FusionModel): compile's fusions measured 1.48x at 48% (an H200,
# reports/examples/h200-memory-bound-compile/narrow_fixes.json).
MEMORY_FUSION_SAVING = 0.20
# ... and information from a tenth: nanoGPT at GPT-2 small's width, eager, was modelled at 17%
# and compile measured 15-17% (reports/examples/h200-memory-bound-compile/README.md).
MEMORY_FUSION_INFO = 0.10
OPTIMIZER_SHARE = 0.15  # an unfused optimizer this large is worth its own advice
OTHER_MEMORY_SHARE = 0.25  # memory-bound time outside attention this large: fusion advice
KIND_NAMED_SHARE = 0.05  # a memory-bound kind named in the title from this share
ATTENTION_SPAN = 6  # lines around a softmax that are its attention's (scale, mask, cast)
MEMORY_THRESHOLDS = (
    Threshold("warning_share", MEMORY_WARNING,
              "memory-bound kernels take half the kernel time: the step is not in its "
              "matmuls"),
    Threshold("critical_share", MEMORY_CRITICAL, "three quarters of it"),
    Threshold("fusion_saving", MEMORY_FUSION_SAVING,
              "short of half, a warning still where fusing them saves this share of the step "
              "by the bytes model"),
    Threshold("fusion_info", MEMORY_FUSION_INFO,
              "... and information from this share"),
    Threshold("max_idle_fraction", MEMORY_MAX_IDLE,
              "the GPU busy nearly all the step, so kernel time is the step's time"),
    Threshold("optimizer_share", OPTIMIZER_SHARE,
              "an optimizer's own kernels this share of the kernel time: foreach/fused advice"),
    Threshold("other_memory_share", OTHER_MEMORY_SHARE,
              "of the memory-bound time, outside a hand-written attention: torch.compile "
              "advice"),
    Threshold("kind_named_share", KIND_NAMED_SHARE,
              "a memory-bound kind is named in the title from this share of kernel time"),
    Threshold("attention_span", ATTENTION_SPAN,
              "lines either side of a softmax taken as its attention's (scale, mask, cast)"),
    Threshold("conv_share", CONV_MIN_SHARE,
              "convolutions and their transposes this share of the kernel time: channels_last "
              "advice before fusion (GD306)"),
)


@dataclass
class FusionModel:
    """What fusing the memory-bound operators would save, per step: a model in bytes (the
    roofline's memory side). Each run of consecutive ones becomes one kernel moving the run's
    largest operator's bytes (LineCount.fused_memory_bytes), at the rate the line's kernels
    reach now: their time shrinks with their bytes. Kernels that re-read their input (a
    softmax's passes) move more than counted; the model keeps today's rate, not the peak's."""

    saving_ms: float  # per step, on the lines with recorded shapes
    modelled_ms: float  # their memory-bound ms per step
    unmodelled_ms: float  # memory-bound ms on lines without shapes (compiled, or unrecorded)


def _fusion_model(stage: StageResult) -> FusionModel:
    ev = stage.evidence
    saving = modelled = unmodelled = 0.0
    for count in ev.line_counts if ev else []:
        ms = sum(v for k, v in count.kind_ms.items() if k in MEMORY_BOUND_KINDS)
        if ms <= 0:
            continue
        if count.memory_bytes <= 0:
            unmodelled += ms
            continue
        modelled += ms
        saving += ms * max(0.0, 1.0 - count.fused_memory_bytes / count.memory_bytes)
    return FusionModel(saving_ms=saving, modelled_ms=modelled, unmodelled_ms=unmodelled)


def _memory_price(model: FusionModel, upper: float) -> str:
    """How GD304's price was reached, in words for the report."""
    bound = (f"at most {pct(upper)} of the step, were the memory-bound kernels to vanish "
             "(a fused attention kernel also skips masked matmul work, and may win that)")
    if model.modelled_ms <= 0:
        return (f"an upper bound, no shapes recorded on the lines that own them: {bound}; "
                "--try-fixes compiles the model to measure it")
    unmodelled = (f"; {model.unmodelled_ms:.2f} ms/step on lines without shapes not counted"
                  if model.unmodelled_ms >= 0.005 else "")
    return (f"a model in bytes (the roofline's memory side): consecutive memory-bound "
            f"operators fused as a compiler fuses them, each run into one kernel moving its "
            f"largest operator's bytes at today's rate, save {model.saving_ms:.2f} of their "
            f"{model.modelled_ms:.2f} ms/step{unmodelled}; "
            f"{bound}; --try-fixes compiles the model to measure it")


def _memory_lines(stage: StageResult) -> list[tuple[str, float, dict[str, float]]]:
    """(line, memory-bound ms per step, its ms by kind) for the lines that own such kernels,
    busiest first."""
    ev = stage.evidence
    if ev is None:
        return []
    found = []
    for count in ev.line_counts:
        kinds = {k: v for k, v in count.kind_ms.items() if k in MEMORY_BOUND_KINDS}
        if kinds:
            found.append((count.location, sum(kinds.values()), count.kind_ms))
    return sorted(found, key=lambda x: -x[1])


def _outside_attention(lines: list[tuple[str, float, dict[str, float]]]) -> float:
    """The share of the memory-bound time on lines that are not a hand-written attention's:
    a softmax's line and the lines just around it in the same file (its scale, mask, cast)."""
    softmax = [loc.rpartition(":") for loc, _, kinds in lines if kinds.get("softmax")]
    near = {(path, int(number) + d) for path, _, number in softmax if number.isdigit()
            for d in range(-ATTENTION_SPAN, ATTENTION_SPAN + 1)}
    total = sum(ms for _, ms, _ in lines)
    outside = 0.0
    for loc, ms, _ in lines:
        path, _, number = loc.rpartition(":")
        if not number.isdigit() or (path, int(number)) not in near:
            outside += ms
    return outside / total if total else 0.0


def _memory_fix(by_kind: dict[str, float], lines: list[tuple[str, float, dict[str, float]]]
                ) -> str:
    """Fixes for what the memory-bound time is: a softmax beside matmuls with no fused
    attention is attention written by hand; norms and chains of elementwise ops fuse under
    torch.compile; an optimizer's per-parameter kernels fuse with foreach/fused."""
    named = ", ".join(
        f"{loc} {ms:.2f} ms ({'/'.join(sorted(k for k in kinds if k in MEMORY_BOUND_KINDS))})"
        for loc, ms, kinds in lines[:3])
    fixes = []
    total = sum(by_kind.values())
    # A softmax too small to be named (a classifier's cross-entropy) is no attention's.
    if total and by_kind.get("softmax", 0.0) / total >= KIND_NAMED_SHARE \
            and not by_kind.get("attention"):
        fixes.append("attention written as matmul, scale, mask, softmax, matmul materialises "
                      "the B x H x T x T scores several times: call "
                      "torch.nn.functional.scaled_dot_product_attention(q, k, v, "
                      "is_causal=...), which runs a fused (Flash) kernel")
    if total and sum(by_kind.get(k, 0.0) for k in CONV_KINDS) / total >= CONV_MIN_SHARE:
        fixes.append("batch norms and activations between convolutions run faster in NHWC: "
                     "a channels_last model and input (GD306) come before fusing them")
    if _outside_attention(lines) >= OTHER_MEMORY_SHARE:
        fixes.append("norms, activations, casts and residual adds each read and write the whole "
                     "tensor: torch.compile fuses such chains into one kernel")
    if total and by_kind.get("optimizer", 0.0) / total >= OPTIMIZER_SHARE:
        fixes.append("the optimizer's per-parameter kernels: torch.optim.AdamW(..., "
                     "fused=True) (or foreach=True)")
    where = f"Lines owning them: {named}. " if named else ""
    advice = "; ".join(fixes)
    return f"{where}{advice[:1].upper()}{advice[1:]}." if fixes else where


@rule(
    "GD304", "memory-bound-kernels", concern="compute",
    summary=("The busy GPU spends much of its kernel time in memory-bound kernels that fusion "
             "would cut, not in matmuls."),
    why=("Softmax, normalisation, activations, casts and residual adds do a few operations per "
         "element read and written: their time is memory bandwidth, and a step made of them "
         "runs far below the GPU's matmul rate however busy it looks. A hand-written "
         "attention block at long sequence lengths spends most of its time on the "
         "B x H x T x T scores; fused kernels (FlashAttention, torch.compile's fusions) keep "
         "such intermediates on chip."),
    fix=("Use fused kernels: F.scaled_dot_product_attention for attention, torch.compile for "
         "chains of norms and elementwise ops, fused=True/foreach=True optimizers."),
    prices=device_time("what fusing the memory-bound kernels would save"),
    thresholds=MEMORY_THRESHOLDS,
    references=("https://pytorch.org/docs/stable/generated/"
                "torch.nn.functional.scaled_dot_product_attention.html",),
)
def memory_bound_kernels(run: RunResult) -> Iterator[Draft]:
    """On a GPU busy at least 75% of the step, memory-bound kernels (softmax, norm,
    elementwise, reduction: gpudiag/measure/evidence/kinds.py) hold at least half the kernel
    time, or fusing them would save a fifth of the step by the bytes model (a tenth:
    information); priced by what
    fusing them would save (FusionModel: bytes at today's rate), never above their share of
    the step (what removing them would save); their share where no line's shapes were
    recorded."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        by_kind = ev.device_ms_by_kind
        total = sum(by_kind.values())
        idle = ev.idle_fraction
        if ev.backend != "cuda" or total <= 0 or idle is None or idle > MEMORY_MAX_IDLE:
            continue
        memory = sum(v for k, v in by_kind.items() if k in MEMORY_BOUND_KINDS)
        share = memory / total
        model = _fusion_model(stage)
        modelled = model.modelled_ms > 0
        upper = share * (1 - idle)
        step_share = model.saving_ms / total * (1 - idle) if modelled else upper
        if share < MEMORY_WARNING and not (modelled and step_share >= MEMORY_FUSION_INFO):
            continue
        severity = (severity_for(max(share, MEMORY_WARNING), warning=MEMORY_WARNING,
                                 critical=MEMORY_CRITICAL)
                    if share >= MEMORY_WARNING or step_share >= MEMORY_FUSION_SAVING else "info")
        lines = _memory_lines(stage)
        saving = f"; fused, ~{pct(step_share)} of the step would go" if modelled else ""
        matmul = by_kind.get("matmul", 0.0) / total
        top = f"; most at {lines[0][0]} ({lines[0][1]:.2f} ms/step)" if lines else ""
        kinds = ", ".join(f"{k} {pct(v / total)}" for k, v in
                          sorted(by_kind.items(), key=lambda kv: -kv[1])
                          if k in MEMORY_BOUND_KINDS and v / total >= KIND_NAMED_SHARE)
        yield Draft(
            severity=severity,
            stage=stage.name,
            title=(f"Memory-bound kernels take {pct(share)} of the kernel time ({kinds}), "
                   f"matmuls {pct(matmul)}, with the GPU busy {pct(1 - idle)} of the step"
                   f"{top}{saving}"),
            location=lines[0][0] if lines else None, impact=min(upper, step_share),
            evidence={"memory_bound_share": round(share, 3), "matmul_share": round(matmul, 3),
                      "device_ms_by_kind": {k: round(v, 3) for k, v in by_kind.items()},
                      "idle_fraction": round(idle, 3),
                      "price": _memory_price(model, upper),
                      "fusion_saving_ms": round(model.saving_ms, 3),
                      "upper_bound_share": round(upper, 3),
                      "lines": {loc: {"memory_bound_ms": round(ms, 3),
                                      "ms_by_kind": {k: round(v, 3) for k, v in kinds_.items()}}
                                for loc, ms, kinds_ in lines[:5]}},
            fix=_memory_fix(by_kind, lines))


ISLAND_MIN_LOW_MATMUL = 0.5  # of matmul time in fp16/bf16: the stage is mixed precision
# fp32 memory-bound time, of all kernel time: information from 15%, a warning from 30% (what
# 16 bits would win back, half of it, is then 15% of the kernel time).
ISLAND_MIN_SHARE, ISLAND_WARNING = 0.15, 0.30
# Memory-bound time follows bytes: the same work in 16 bits moves half of them.
ISLAND_RECOVERABLE = 0.5
ISLAND_ADVICE_SHARE = 1 / 3  # of the top lines' fp32 time: a cause this large gets its advice
ISLAND_THRESHOLDS = (
    Threshold("min_low_precision_matmul", ISLAND_MIN_LOW_MATMUL,
              "half the matmul time runs in fp16/bf16: the stage trains in mixed precision"),
    Threshold("min_share", ISLAND_MIN_SHARE,
              "memory-bound work computing in fp32 takes 15% of the kernel time"),
    Threshold("warning_share", ISLAND_WARNING,
              "30% of it (half of which 16 bits would win back): warning"),
    Threshold("recoverable_share", ISLAND_RECOVERABLE,
              "of that time, what 16-bit operands win back (half the bytes; the impact)"),
    Threshold("advice_share", ISLAND_ADVICE_SHARE,
              "of the top lines' fp32 time, promoted operations or autocast's own fp32 "
              "operations: that cause's advice"),
    Threshold("kind_named_share", KIND_NAMED_SHARE,
              "of the top lines' fp32 time, a softmax: the attention's fused kernel advised"),
)


PROMOTED_KINDS = frozenset({"elementwise", "reduction"})  # an fp32 input promoted them


def _island_fix(ms_by_kind: dict[str, float]) -> str:
    """What an fp32 island is, by the kinds of its fp32 work on its top lines: elementwise
    operations and reductions promoted by an fp32 input, or autocast's own fp32 operations
    (softmax, norms) and the casts into fp32 that feed them. Each cause holding a third of
    that time gets its advice, the larger first."""
    total = sum(ms_by_kind.values()) or 1.0
    promoted = sum(v for k, v in ms_by_kind.items() if k in PROMOTED_KINDS) / total
    # A softmax too small to be named (a classifier's loss) is no attention's: an MLP is not
    # told to call scaled_dot_product_attention.
    attention = ("F.scaled_dot_product_attention for attention, "
                 if ms_by_kind.get("softmax", 0.0) / total >= KIND_NAMED_SHARE else "")
    # Pairs, not a dict keyed by share: an even split would keep one cause's advice only.
    advice = [
        (promoted, "an fp32 tensor mixed into fp16/bf16 activations (a mask or bias built "
                   "with torch.zeros/ones/arange in the default dtype, a parameter used "
                   "outside a Linear, an fp32 residual stream) promotes the operation, and "
                   "what follows it, to fp32: create it in the activations' dtype "
                   "(mask.to(scores.dtype)) or use a bool mask with masked_fill"),
        (1.0 - promoted, "autocast runs softmax, log_softmax, layer_norm and the losses in "
                         "fp32 on purpose (its fp32 list), with a cast into fp32 before each: "
                         "where they are the cost, a fused kernel does the same in one pass "
                         f"({attention}torch.compile for norms and the chains around them)")]
    chosen = [text for share, text in sorted(advice, key=lambda a: -a[0])
              if share >= ISLAND_ADVICE_SHARE]
    text = "; ".join(chosen)
    return f"{text[:1].upper()}{text[1:]}."


@rule(
    "GD305", "fp32-islands", concern="precision",
    summary="Memory-bound work still computing in fp32 inside a mixed-precision step.",
    why=("Under autocast the matmuls run in fp16/bf16, but an operation with an fp32 input "
         "runs in fp32 (type promotion), and autocast itself keeps softmax, norms and losses "
         "in fp32. Such islands read and write twice the bytes of the same work in 16 bits, "
         "and memory-bound kernels take their time from bytes."),
    fix=("Keep tensors mixed into activations in the activations' dtype; use fused kernels "
         "for the operations autocast keeps in fp32."),
    prices=device_time("what 16-bit operands would save of memory-bound kernels (a part of "
                       "GD304's)"),
    thresholds=ISLAND_THRESHOLDS,
    references=("https://pytorch.org/docs/stable/amp.html#ops-that-can-autocast-to-float32",),
)
def fp32_islands(run: RunResult) -> Iterator[Draft]:
    """Half or more of the matmul time runs in fp16/bf16, and memory-bound operators whose
    widest input is fp32 (casts aside; gpudiag/measure/evidence/shapes.py) take 15% or
    more of the kernel time. Priced as half their share of the step: a part of GD304's
    memory-bound time where both fire, not added to it. GPUs only, as GD304: on a CPU
    without native bf16 arithmetic, bf16 elementwise kernels widen to fp32 inside, so the
    bytes saved are no time saved (a clean bf16-autocast Transformer on a CPU got this
    warning first)."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        if ev.backend != "cuda":
            continue
        total = sum(ev.device_ms_by_kind.values())
        matmul = sum(ev.matmul_ms_by_dtype.values())
        low = sum(v for k, v in ev.matmul_ms_by_dtype.items() if k in ("fp16", "bf16"))
        lines = sorted((c for c in ev.line_counts if c.fp32_memory_bound_ms > 0),
                       key=lambda c: -c.fp32_memory_bound_ms)
        islands = sum(c.fp32_memory_bound_ms for c in lines)
        if not total or not matmul or low / matmul < ISLAND_MIN_LOW_MATMUL \
                or islands / total < ISLAND_MIN_SHARE:
            continue
        share = islands / total
        busy = 1.0 - (ev.idle_fraction or 0.0)
        dtype = max(("fp16", "bf16"), key=lambda k: ev.matmul_ms_by_dtype.get(k, 0.0))
        top = lines[0]
        kinds: dict[str, float] = defaultdict(float)
        for c in lines[:3]:
            for k, ms in c.fp32_ms_by_kind.items():
                kinds[k] += ms
        top_kinds = ", ".join(f"{'casts into fp32' if k == 'cast' else k} {ms:.2f}" for k, ms in
                              sorted(top.fp32_ms_by_kind.items(), key=lambda kv: -kv[1]))
        yield Draft(
            severity=severity_for(share, warning=ISLAND_WARNING), stage=stage.name,
            title=(f"fp32 islands in a {dtype} step: memory-bound work computing in fp32 takes "
                   f"{pct(share)} of the kernel time while {pct(low / matmul)} of matmul time "
                   f"runs in fp16/bf16; most at {top.location} "
                   f"({top.fp32_memory_bound_ms:.2f} ms/step: {top_kinds})"),
            location=top.location, impact=min(1.0, share * busy * ISLAND_RECOVERABLE),
            evidence={"fp32_memory_bound_share": round(share, 3),
                      "low_precision_matmul_share": round(low / matmul, 3),
                      "lines": {c.location: {"fp32_memory_bound_ms": round(
                          c.fp32_memory_bound_ms, 3), "fp32_ms_by_kind": c.fp32_ms_by_kind}
                          for c in lines[:5]},
                      "within": "GD304"},
            fix=_island_fix(kinds))


CHANNELS_LAST_FIX = ("model = model.to(memory_format=torch.channels_last) where the model is "
                     "built, and x = x.to(memory_format=torch.channels_last) where its input "
                     "is made")


LOW_PRECISION = ("torch.bfloat16", "torch.float16")


def _conv_layout(stage: StageResult) -> ConvLayout:
    """The profiled script's first convolution as it recorded it (watches/convlayout.py); all
    unknown where not recorded (gpudiag run's stages, a script with no Conv2d module)."""
    layout = stage.facts.script.conv_layout if stage.facts.script else None
    return layout or ConvLayout(memory_format="other", device="unknown", dtype="unknown")


def _layout_fix(run: RunResult, built: str | None, called: str | None) -> str:
    where = (f"At {built}: `model = model.to(memory_format=torch.channels_last)`"
             if built else "Where the model is built: `model = model.to(memory_format="
                           "torch.channels_last)`")
    where += (f"; at {called}, the input: `x = x.to(memory_format=torch.channels_last)`"
              if called else "; and its input: `x = x.to(memory_format=torch.channels_last)`")
    bench = ("; with fixed input shapes, torch.backends.cudnn.benchmark = True lets cuDNN time "
             "its algorithms once and keep the fastest" if run.env.cudnn_benchmark is False
             else "")
    return (f"{where} (tensor cores run convolutions in NHWC; channels_last keeps activations "
            f"there, no transposes, NHWC batch norms){bench}. --try-fixes --fix channels-last "
            "measures it.")


@rule(
    "GD306", "conv-memory-format", concern="precision",
    summary="Convolutions on a tensor-core GPU run on NCHW (channels_first) tensors.",
    why=("Tensor-core convolutions (cuDNN's and CUTLASS's implicit GEMMs) work in NHWC. On "
         "PyTorch's default NCHW tensors cuDNN transposes each activation to NHWC and back "
         "around its convolutions, or picks slower NCHW algorithms, and NCHW batch norms are "
         "slower than NHWC ones; a channels_last model and input keep activations in NHWC "
         "end to end."),
    fix=CHANNELS_LAST_FIX + " (and torch.backends.cudnn.benchmark = True for fixed shapes).",
    prices=device_time("the layout transposes' kernel time: a lower bound of what "
                       "channels_last saves"),
    thresholds=(Threshold("min_conv_share", CONV_MIN_SHARE,
                          "convolutions and their transposes take a fifth of the kernel time"),
                Threshold("min_layout_share", LAYOUT_MIN_SHARE,
                          "layout transposes from this share of the kernel time: NCHW seen in "
                          "the trace"),
                Threshold("warning_layout_share", LAYOUT_WARNING,
                          "the transposes alone this share of the step: warning"),
                Threshold("warning_block_share", CONV_BLOCK_WARNING,
                          "convolutions, their transposes and batch norms half the kernel "
                          "time, computing in 16 bits on an NCHW input recorded: warning")),
    references=("https://pytorch.org/tutorials/intermediate/memory_format_tutorial.html",
                "https://docs.nvidia.com/deeplearning/performance/dl-performance-convolutional/"
                "index.html#tensor-layout"),
)
def conv_memory_format(run: RunResult) -> Iterator[Draft]:
    """On a tensor-core GPU, convolutions and layout transposes take a fifth of the kernel
    time, and the convolutions run NCHW: the profiled script recorded its first Conv2d's
    input as channels_first, or (not recorded) cuDNN's NCHW <-> NHWC transposes take 1% of the
    kernel time. Priced by the transposes' share of the step, a lower bound (the NCHW batch
    norms and algorithms are not counted), with the convolution blocks' share as the upper
    one; a warning from 5% of the step, or where those blocks hold half the kernel time and
    compute in 16 bits on an NCHW input."""
    if not _tensor_core_gpu(run):
        return
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        by_kind = ev.device_ms_by_kind
        total = sum(by_kind.values())
        seen = _conv_layout(stage)
        nchw = seen.memory_format == "channels_first"
        if ev.backend != "cuda" or not total or seen.memory_format == "channels_last":
            continue
        conv, layout = by_kind.get("convolution", 0.0), by_kind.get("layout", 0.0)
        if (conv + layout) / total < CONV_MIN_SHARE or \
                (not nchw and layout / total < LAYOUT_MIN_SHARE):
            continue
        busy = 1.0 - (ev.idle_fraction or 0.0)
        impact = layout / total * busy
        blocks = (conv + layout + by_kind.get("norm", 0.0)) / total
        warning = impact >= LAYOUT_WARNING or \
            (nchw and seen.dtype in LOW_PRECISION and blocks >= CONV_BLOCK_WARNING)
        how = (f"its first convolution's input is NCHW ({seen.dtype.removeprefix('torch.')})"
               if nchw else f"cuDNN transposes NCHW <-> NHWC around them ({pct(layout / total)} "
                            "of the kernel time)")
        yield Draft(
            severity="warning" if warning else "info", stage=stage.name,
            title=(f"Convolutions take {pct((conv + layout) / total)} of the kernel time "
                   f"(with batch norms {pct(blocks)}) in NCHW (channels_first) memory format: "
                   f"{how}" + (f"; the model is built at {seen.built_at}" if seen.built_at
                               else "")),
            location=seen.built_at or seen.called_at, impact=impact,
            evidence={"memory_format": seen.memory_format if nchw else None,
                      "compute_dtype": seen.dtype if nchw else None,
                      "built_at": seen.built_at, "called_at": seen.called_at,
                      "convolution_share": round(conv / total, 3),
                      "layout_share": round(layout / total, 3),
                      "conv_block_share": round(blocks, 3),
                      "cudnn_benchmark": run.env.cudnn_benchmark,
                      "price": (f"the layout transposes, {pct(impact)} of the step: a lower "
                                "bound (NCHW batch norms and algorithms not counted); at most "
                                f"the convolution blocks' {pct(blocks * busy)}")},
            fix=_layout_fix(run, seen.built_at, seen.called_at))
