"""The fixes `gpudiag profile --try-fixes` can apply to an unmodified script, for one run.

Each remedy is declared once: the findings that call for it, how gpudiag applies it (inside the
script's process, through the profile bootstrap: gpudiag/measure/profile/inscript/remedies.py),
whether it keeps the script's numerics, and the code change that makes it permanent. Findings
with no safe automatic remedy keep their written advice (NO_REMEDY says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Numerics = Literal["exact", "precision"]
FIX_SEED = 0  # the seed every run of one --try-fixes starts from (the script's own overrides)
# The runs of a --try-fixes besides one per remedy (fixes/<label>/): two without any fix that
# bracket the others, and the fixes that paid, together.
BASELINE_RUNS = ("without-fixes-1", "without-fixes-2")
COMBINED_RUN = "combined"
# The DataLoader arguments the loader remedies may change, recorded before and after in each
# loader they saw: the permanent change names the settings the run measured.
LOADER_SETTINGS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


@dataclass(frozen=True)
class Remedy:
    name: str
    title: str
    findings: tuple[str, ...]  # the rule codes that call for it
    numerics: Numerics  # "exact": the losses must not change; "precision": they may, a little
    applied: str  # how gpudiag applies it for one run
    change: str  # the permanent edit, with where it goes
    cuda_only: bool = False  # does nothing a CPU run could measure


REMEDIES: dict[str, Remedy] = {r.name: r for r in (
    Remedy("tf32", "TF32 for fp32 matmuls and convolutions", ("GD301",), "precision",
           "torch.set_float32_matmul_precision('high') and cudnn.allow_tf32 at start-up",
           "after `import torch`: torch.set_float32_matmul_precision(\"high\"); "
           "torch.backends.cudnn.allow_tf32 = True", cuda_only=True),
    Remedy("bf16-autocast", "bf16 autocast around the model's forward", ("GD301",),
           "precision",
           "torch.autocast(device, dtype=torch.bfloat16) entered around each outermost "
           "nn.Module call (the forward; backward follows its dtypes)",
           "wrap the forward and loss: `with torch.autocast(\"cuda\", dtype=torch.bfloat16): "
           "loss = model(batch)`; keep backward() and optimizer.step() outside it",
           cuda_only=True),
    Remedy("loader", "DataLoader workers, pinned memory, persistent workers, prefetch",
           ("GD201",), "exact",
           "each map-style DataLoader built with num_workers=min(8, CPUs) (never fewer than "
           "it had), pin_memory on CUDA, persistent_workers=True, prefetch_factor=4",
           "in the DataLoader(...) call: num_workers=8, pin_memory=True, "
           "persistent_workers=True, prefetch_factor=4 (workers: up to your CPU count)"),
    Remedy("pinned", "pinned batches copied with non_blocking=True", ("GD202", "GD203"),
           "exact",
           "DataLoader(pin_memory=True), and .to(device)/.cuda() of a pinned CPU tensor made "
           "non_blocking",
           "DataLoader(..., pin_memory=True) and batch.to(device, non_blocking=True)",
           cuda_only=True),
    Remedy("no-empty-cache", "torch.cuda.empty_cache() removed from the loop", ("GD402",),
           "exact", "torch.cuda.empty_cache made a no-op (calls counted)",
           "delete the torch.cuda.empty_cache() call in the loop (the caching allocator "
           "reuses its blocks; call it once after training if another process needs the "
           "memory)"),
    Remedy("async-save", "checkpoints written by a background thread", ("GD701",), "exact",
           "torch.save to a path snapshots the tensors (device to host copy, or a clone) and "
           "returns; a background thread writes the file, one save at a time, all written "
           "before the process exits",
           "save a CPU snapshot from a thread: `snap = {k: v.detach().cpu().clone() ...}; "
           "executor.submit(torch.save, snap, path)` (or "
           "torch.distributed.checkpoint.async_save), and wait for it before the next save"),
)}

# Findings whose cause is in the script's own logic: no change gpudiag could make for one run is
# safe without reading the code, so they keep their written fix.
NO_REMEDY: dict[str, str] = {
    "GD101": "a Python loop of tiny ops: vectorizing it changes the script's code, see the fix",
    "GD102": "the GPU starves behind host work; the finding names what keeps the host busy",
    "GD103": "host syncs (.item(), .cpu(), bool(tensor)) are the script's logic: move them "
             "out of the step or batch them, see the fix",
    "GD104": "small kernels: a bigger batch or torch.compile changes what the script trains",
    "GD703": "periodic work that is not a save (evaluation, logging) is the script's choice",
}


def remedies_for(code: str) -> list[Remedy]:
    return [r for r in REMEDIES.values() if code in r.findings]
