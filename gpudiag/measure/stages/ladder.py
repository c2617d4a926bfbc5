"""The seed's diagnosis ladder (docs/field-cases.md#case-1), one stage per rung, in ladder order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from gpudiag.measure.models import Example, ModelBundle
from gpudiag.measure.stages.base import PREFETCH_FACTOR, StageContext, Workload, stage
from gpudiag.model.config import REFERENCE_STAGE
from gpudiag.model.facts import LoaderFacts, StageFacts

# The training recipe of the DGCA-ReLM trainer (docs/field-cases.md#case-1).
LEARNING_RATE = 5e-5
WEIGHT_DECAY = 0.01
FULL_MODEL_GRAD_CLIP = 1.0


def train_step(
    ctx: StageContext,
    bundle: ModelBundle,
    next_batch: Callable[[], Example],
    *,
    amp: bool,
    clip: float | None = None,
    hooks: StepHooks | None = None,
) -> Callable[[], None]:
    """A step of the usual loop: forward (autocast), scaled backward, optional clipping, AdamW.
    `hooks`, when given, receive the training state and run before and after each update."""
    model = bundle.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    scaler = torch.amp.GradScaler(ctx.device.type,
                                  enabled=amp and ctx.amp_dtype == torch.float16)
    phase = ctx.phases.phase
    if hooks is not None:
        hooks.attach(model, optimizer, scaler)

    def step() -> None:
        batch = next_batch()
        with phase("forward"), ctx.autocast(amp):
            loss = bundle.loss(model(**batch))
        with phase("backward"):
            scaler.scale(loss).backward()
        with phase("optimizer"):
            if hooks is not None:
                hooks.before_update()
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        if hooks is not None:
            hooks.after_step()

    return step


class StepHooks(Protocol):
    """What a stage adds to the training step (a checkpointer, say)."""

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler) -> None: ...
    def before_update(self) -> None: ...
    def after_step(self) -> None: ...


def fp32_rung(*, inference: bool = False) -> StageFacts:
    # The ladder's fp32 rungs are fp32 on purpose: precision rules treat them as information.
    return StageFacts(precision="fp32", deliberate_fp32=True, inference=inference)


def amp_facts(ctx: StageContext, *, loader: LoaderFacts | None = None,
              counterfactual: str | None = None) -> StageFacts:
    return StageFacts(precision=precision_of(ctx.config.amp_dtype), loader=loader,
                      counterfactual=counterfactual)


def precision_of(amp_dtype: str) -> str:
    """run.json's `precision` for a mixed-precision stage: "fp16-autocast", "bf16-autocast",
    or "fp32" where the machine has no fast half precision (see config.default_amp_dtype)."""
    return "fp32" if amp_dtype == "fp32" else f"{amp_dtype}-autocast"


def amp_label(ctx: StageContext) -> str:
    return {"fp16": "fp16 autocast + GradScaler", "bf16": "bf16 autocast"}.get(
        ctx.config.amp_dtype, "fp32 (no autocast: no native bf16 on this CPU)")


def tokens(ctx: StageContext) -> int:
    return ctx.config.batch_size * ctx.config.seq_len


# The base model's training step, whatever its precision or data source (Workload.flops_key).
TRAIN_FLOPS = ("train",)


@stage("infer", "forward only (no_grad, fp32)")
def infer(ctx: StageContext) -> Workload:
    bundle = ctx.bundle()
    model = bundle.model.eval()
    inputs = ctx.batch(bundle, keys=bundle.infer_inputs)

    def step() -> None:
        with torch.no_grad():
            model(**inputs)

    return Workload(step=step, samples_per_step=ctx.config.batch_size,
                    tokens_per_step=tokens(ctx), description=f"{bundle.description}, fp32",
                    facts=fp32_rung(inference=True))


@stage("train", "training step (fp32, AdamW)")
def train(ctx: StageContext) -> Workload:
    bundle = ctx.bundle()
    batch = ctx.batch(bundle)
    return Workload(step=train_step(ctx, bundle, lambda: batch, amp=False),
                    samples_per_step=ctx.config.batch_size, tokens_per_step=tokens(ctx),
                    description=f"{bundle.description}, fp32", facts=fp32_rung(),
                    flops_key=TRAIN_FLOPS)


@stage(REFERENCE_STAGE, "training step with mixed precision (autocast)", role="reference")
def train_fp16(ctx: StageContext) -> Workload:
    bundle = ctx.bundle()
    batch = ctx.batch(bundle)
    return Workload(step=train_step(ctx, bundle, lambda: batch, amp=True),
                    samples_per_step=ctx.config.batch_size, tokens_per_step=tokens(ctx),
                    description=f"{bundle.description}, {amp_label(ctx)}",
                    facts=amp_facts(ctx), flops_key=TRAIN_FLOPS)


def _loader_facts(ctx: StageContext) -> LoaderFacts:
    workers = ctx.config.loader_workers
    return LoaderFacts(num_workers=workers, pin_memory=ctx.device.type == "cuda",
                       prefetch_factor=PREFETCH_FACTOR if workers else None,
                       persistent_workers=workers > 0)


@stage("dataloader", "DataLoader alone (workers, pinned memory): time per batch",
       role="loader")
def dataloader(ctx: StageContext) -> Workload:
    bundle = ctx.bundle(weights=False)  # only the data is needed
    data_loader = ctx.loader(bundle)
    batches = iter(data_loader)

    def step() -> None:
        next(batches)

    loader = _loader_facts(ctx)
    return Workload(step=step, samples_per_step=ctx.config.batch_size,
                    tokens_per_step=tokens(ctx), host_only=True,
                    facts=StageFacts(bursty=True, loader=loader),
                    description=f"{loader.num_workers} workers, "
                                f"pin_memory={loader.pin_memory}",
                    close=lambda: _shutdown(batches))


@stage("data-train", "DataLoader + mixed-precision training")
def data_train(ctx: StageContext) -> Workload:
    bundle = ctx.bundle()
    batches = iter(ctx.loader(bundle))

    def next_batch() -> Example:
        with ctx.phases.phase("data_wait", host=True):
            batch = next(batches)
        with ctx.phases.phase("h2d_copy"):
            return ctx.to_device(batch)

    return Workload(step=train_step(ctx, bundle, next_batch, amp=True),
                    samples_per_step=ctx.config.batch_size, tokens_per_step=tokens(ctx),
                    facts=amp_facts(ctx, loader=_loader_facts(ctx)),
                    description=f"{bundle.description}, {amp_label(ctx)}, "
                                f"{ctx.config.loader_workers} loader workers",
                    close=lambda: _shutdown(batches), flops_key=TRAIN_FLOPS)


def _full_model(ctx: StageContext, variant: str, counterfactual: str | None = None) -> Workload:
    bundle = ctx.bundle(variant)
    batch = ctx.batch(bundle)
    return Workload(step=train_step(ctx, bundle, lambda: batch, amp=True,
                                    clip=FULL_MODEL_GRAD_CLIP),
                    samples_per_step=ctx.config.batch_size, tokens_per_step=tokens(ctx),
                    description=f"{bundle.description}, {amp_label(ctx)}, grad clip 1.0",
                    facts=amp_facts(ctx, counterfactual=counterfactual))


@stage("full-loop", "full model, prompt written by a per-element Python loop")
def full_loop(ctx: StageContext) -> Workload:
    # The same model with the loop vectorized: rules price the loop by that measured twin.
    return _full_model(ctx, "loop", counterfactual="full-vectorized")


@stage("full-vectorized", "full model, prompt written by one vectorized op")
def full_vectorized(ctx: StageContext) -> Workload:
    return _full_model(ctx, "vectorized")


def _shutdown(batches: object) -> None:
    # Persistent workers stop when their iterator goes; do it now, not at garbage collection.
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
