"""Remedies that trade time for memory, applied inside a profiled script for one run
(`gpudiag profile --try-fixes` where memory is the limit: GD401, GD404). Declared, with their
records, in gpudiag/model/remedies.py; applied beside the others (remedies.py's APPLIERS).
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpudiag.measure.evidence.source import call_site
from gpudiag.model.remedies import ActivationCheckpointRecord, RemedyEvidence

MAX_MODELS = 4  # outermost modules looked into: a model, perhaps an EMA copy or a critic


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The model's repeated blocks: the children of its outermost nn.ModuleList or
    nn.Sequential that holds two or more modules of one class with submodules of their own
    (a transformer's layers, a ResNet stage's bottlenecks; a run of plain Linear layers is
    no block: checkpointing one saves its input all the same), with the container's name."""
    for name, container in model.named_modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        composite = [c for c in container.children() if next(c.children(), None) is not None]
        counts = Counter(type(c) for c in composite)
        if counts:
            kind, count = counts.most_common(1)[0]
            if count >= 2:
                where = f"{type(model).__name__}.{name}" if name else type(model).__name__
                return where, [c for c in composite if type(c) is kind]
    return None


def _checkpoint(block: nn.Module, record: ActivationCheckpointRecord) -> None:
    """`block`'s forward recomputed in backward instead of its activations kept, where
    gradients are on (an evaluation's no_grad forward runs as it was). The first block's call
    is the script's line the permanent change goes to (its model's forward)."""
    forward = block.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if record.site is None:
            record.site = _site()
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    block.forward = checkpointed  # this instance's only


def _hugging_face(model: nn.Module, record: ActivationCheckpointRecord) -> bool:
    """A transformers model checkpoints through its own switch (its layers take the
    library's checkpoint function, and it turns the KV cache off, which checkpointing
    would recompute wrongly)."""
    enable: Callable[..., None] | None = getattr(model, "gradient_checkpointing_enable", None)
    if not getattr(model, "supports_gradient_checkpointing", False) or enable is None:
        return False
    if getattr(model, "is_gradient_checkpointing", False):
        record.kept = f"the script's {type(model).__name__} checkpoints its layers already"
    else:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        record.framework = "transformers"
    return True


def _activation_checkpointing(seen: RemedyEvidence) -> Callable[[], None]:
    """At the first call of each outermost module with parameters: its repeated blocks
    checkpointed. The hooks step aside while Dynamo traces, as the compile remedy's do."""
    record = seen.activation_checkpointing = ActivationCheckpointRecord()
    state = threading.local()
    looked: set[int] = set()

    def enter(module: nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        depth = getattr(state, "depth", 0)
        state.depth = depth + 1
        if depth or id(module) in looked or len(looked) >= MAX_MODELS \
                or next(module.parameters(), None) is None:
            return
        looked.add(id(module))
        if _hugging_face(module, record):
            if record.framework:
                record.site = record.site or _site()
            return
        found = repeated_blocks(module)
        if found is None:
            return
        record.container, blocks = found
        for block in blocks:
            _checkpoint(block, record)
        record.blocks += len(blocks)
        record.block = record.block or type(blocks[0]).__name__

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        if not torch.compiler.is_compiling():
            state.depth = max(0, getattr(state, "depth", 1) - 1)

    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
    return lambda: None


def _site() -> str | None:
    """The script's line that called the module whose pre-hook runs (torch's call machinery
    and gpudiag's frames between are skipped)."""
    site = call_site(sys._getframe(1))
    return site.location if site is not None else None


MEMORY_APPLIERS: dict[str, Callable[[RemedyEvidence], Callable[[], None]]] = {
    "activation-checkpointing": _activation_checkpointing,
}
