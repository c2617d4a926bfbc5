"""The fixes `gpudiag profile --try-fixes` can apply to an unmodified script, for one run.

Each remedy is declared once: the findings that call for it, how gpudiag applies it (inside the
script's process, through the profile bootstrap: gpudiag/measure/profile/inscript/remedies.py),
whether it keeps the script's numerics, and the code change that makes it permanent. Findings
with no safe automatic remedy keep their written advice (NO_REMEDY says why). What each one saw
in the script when applied (a record per remedy, together a `RemedyEvidence`) is declared here
too: the applier fills it in, run.json keeps it (validated on load like the rest), diagnose
reads it. Each record answers for itself (`RemedyRecord`) whether its remedy changed anything
and where it acted, so no list elsewhere names the records.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

# "exact": the losses must not change; "precision": they may, as mixed precision moves them;
# "reordered": the same arithmetic per element, rounded in another order (a fused or foreach
# kernel's sums and fused multiply-adds): they may differ by rounding that grows with the terms
# summed and the steps taken (gpudiag/diagnose/tryfix.py: reordering_tolerance); "recipe": it
# trains something else (a larger batch): never "same", whatever the losses.
Numerics = Literal["exact", "precision", "reordered", "recipe"]
FIX_SEED = 0  # the seed every run of one --try-fixes starts from (the script's own overrides)
# The runs of a --try-fixes besides one per remedy (fixes/<label>/): two without any fix that
# bracket the others, and the fixes that paid, together.
BASELINE_RUNS = ("without-fixes-1", "without-fixes-2")
COMBINED_RUN = "combined"
# A diagnosis run gpudiag stops after its window (--stop-after-window, --try-fixes) runs in a
# scratch copy of the working directory too, under this label.
DIAGNOSIS_RUN = "diagnosis"
# The DataLoader arguments the loader remedies may change, recorded before and after in each
# loader they saw: the permanent change names the settings the run measured.
LOADER_SETTINGS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor")


@dataclass(frozen=True)
class Remedy:
    name: str
    title: str
    findings: tuple[str, ...]  # the rule codes that call for it
    numerics: Numerics  # what it may change in the losses (Numerics above)
    applied: str  # how gpudiag applies it for one run
    change: str  # the permanent edit, with where it goes
    cuda_only: bool = False  # does nothing a CPU run could measure
    # A DataLoader iterator kept across passes draws no new seed at each pass: after the
    # first pass the shuffle differs, so losses are compared over the first pass only.
    reorders: bool = False
    # Its findings price disjoint parts of the step, each of which it removes: its price is
    # their sum (otherwise the largest, the parts may overlap).
    adds_prices: bool = False
    # It trades time for memory: judged by the peak it saves (its time is the cost), never
    # combined with the fixes that pay in time, and tried where memory is the limit (an
    # out-of-memory diagnosis too).
    frees_memory: bool = False


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
           "persistent_workers=True, prefetch_factor=4 (workers: up to your CPU count)",
           reorders=True),
    Remedy("persistent-workers", "DataLoader workers kept for the whole run", ("GD204",),
           "exact",
           "each DataLoader with workers built with persistent_workers=True (nothing else "
           "changed)",
           "in the DataLoader(...) call: persistent_workers=True", reorders=True),
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
    Remedy("fused-optimizer", "fused optimizer step (foreach where fused is not offered)",
           ("GD106",), "reordered",
           "each torch.optim optimizer built with fused=True where its class and tensors allow "
           "it, else foreach=True where they allow that (the same update, fewer kernels)",
           "in the optimizer's constructor: fused=True (and drop foreach=False)"),
    Remedy("async-save", "checkpoints written by a background thread", ("GD701",), "exact",
           "torch.save to a path snapshots the tensors (device to host copy, or a clone) and "
           "returns; a background thread writes the file, one save at a time, all written "
           "before the process exits",
           "save a CPU snapshot from a thread: `snap = {k: v.detach().cpu().clone() ...}; "
           "executor.submit(torch.save, snap, path)` (or "
           "torch.distributed.checkpoint.async_save), and wait for it before the next save"),
    Remedy("fsdp-keep-gathered", "FSDP2 units keep their parameters gathered until backward",
           ("GD805",), "exact",
           "each FSDP2 unit built by fully_shard(...) made to keep its gathered parameters from "
           "forward to backward, as reshard_after_forward=False does (the same collectives' "
           "results, one all-gather fewer per unit and step, more memory)",
           "in the fully_shard(...) call that shards each unit: reshard_after_forward=False"),
    # Inductor also lays out convolutions channels_last where a graph has them
    # (torch/_inductor/config.py, `layout_optimization`): it answers GD306's transposes too,
    # measured on the H200 (reports/examples/h200-issue55/cnn_layout: 3.23x, its two prices
    # 37% + 18%).
    Remedy("compile-model", "the model compiled (torch.compile's fusions)", ("GD304", "GD306"),
           "precision",
           "each outermost module with parameters compiled in place at its first call "
           "(nn.Module.compile(), Inductor's default mode): chains of memory-bound kernels fused",
           "after building the model: `model.compile()` (or `model = torch.compile(model)`)",
           cuda_only=True, adds_prices=True),
    Remedy("channels-last", "convolutions in channels_last (NHWC) memory format", ("GD306",),
           "precision",
           "each outermost module holding an nn.Conv2d converted to channels_last at its first "
           "call (module.to(memory_format=torch.channels_last), its parameters in place), and "
           "the 4-D floating-point inputs of its calls converted too (cuDNN then picks NHWC "
           "algorithms: sums in another order)",
           "after building the model: `model = model.to(memory_format=torch.channels_last)`; "
           "where its input is made: `x = x.to(memory_format=torch.channels_last)`",
           cuda_only=True),
    # The caching allocator maps more memory into a segment as it needs it instead of asking
    # cudaMalloc for a new block of a fitting size: no fragmentation between sizes, fewer
    # cudaMalloc calls and retries (pytorch.org/docs/stable/notes/cuda.html,
    # "expandable_segments"). An environment change: the script's files are untouched.
    Remedy("expandable-segments", "the CUDA allocator's expandable segments", ("GD405",),
           "exact",
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (added to what the script's "
           "environment had) before CUDA starts",
           "in the job's environment: `export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` "
           "(or add it to what PYTORCH_CUDA_ALLOC_CONF holds)", cuda_only=True),
    # Each block's forward recomputed in backward instead of its activations kept
    # (torch.utils.checkpoint, use_reentrant=False as its docs recommend; the RNG state is
    # replayed, so dropout draws the same masks): the same arithmetic on the same inputs.
    Remedy("activation-checkpointing", "activation checkpointing of the model's repeated blocks",
           ("GD401", "GD404"), "exact",
           "each repeated block (the children of an nn.ModuleList or nn.Sequential of one "
           "class, two or more, holding submodules: a transformer's layers) run through "
           "torch.utils.checkpoint.checkpoint(use_reentrant=False) while gradients are on; a "
           "Hugging Face model through its own gradient_checkpointing_enable()",
           "run each block through `torch.utils.checkpoint.checkpoint(block, x, "
           "use_reentrant=False)` in the model's forward (Hugging Face: "
           "`model.gradient_checkpointing_enable()`; FSDP: `apply_activation_checkpointing`)",
           frees_memory=True),
    Remedy("ddp-no-sync", "DDP all-reduces once per optimizer step, not per micro-step",
           ("GD802",), "exact",
           "every DistributedDataParallel forward run as under model.no_sync(), and the "
           "accumulated gradients averaged over the ranks in buckets of its bucket_cap_mb "
           "before the optimizer steps (or before clip_grad_norm_/clip_grad_value_ or a "
           "GradScaler's unscale_ read them)",
           "around the forward and backward of every micro-step but the last: `ctx = "
           "model.no_sync() if not last else contextlib.nullcontext(); with ctx: loss = "
           "model(x); loss.backward()`"),
    Remedy("no-debug", "debug settings off: anomaly detection, CUDA_LAUNCH_BLOCKING, emit_nvtx",
           ("GD107",), "exact",
           "torch.set_anomaly_enabled (set_detect_anomaly, detect_anomaly) kept off, "
           "CUDA_LAUNCH_BLOCKING unset before CUDA starts, emit_nvtx() made to emit nothing; a "
           "profiler the script runs itself is left on (the script reads its results)",
           "delete the call that turns it on (set_detect_anomaly(True), `with "
           "detect_anomaly()`, emit_nvtx()) or unset CUDA_LAUNCH_BLOCKING; keep them for a "
           "debugging run"),
    # A host- or launch-bound step does more work per launch at a larger batch; the step
    # takes longer, each sample less. Planned only where the headroom fits 2x the batch and a
    # map-style DataLoader makes it (gpudiag/diagnose/tryfix.py: batch_factor).
    Remedy("larger-batch", "a larger training batch (samples per second)", ("GD102", "GD104"),
           "recipe",
           "the training DataLoader (the diagnosis run's, by the line that built it) built with "
           "its batch_size times k: a power of two, 2 to 8, at most what the headroom says "
           "fits; measured in samples per second",
           "in the training DataLoader(...) call: a larger batch_size, with the learning rate "
           "scaled to it (linearly for SGD, about its square root for Adam) and the steps "
           "divided by the same factor to see as many samples"),
    Remedy("nondeterministic", "deterministic algorithms off", ("GD108",), "precision",
           "torch.use_deterministic_algorithms(True) and torch.backends.cudnn.deterministic = "
           "True skipped (calls noted)",
           "delete torch.use_deterministic_algorithms(True) / cudnn.deterministic = True, or "
           "keep them only in a run that must repeat bit for bit"),
)}

# Findings whose cause is in the script's own logic: no change gpudiag could make for one run is
# safe without reading the code, so they keep their written fix.
NO_REMEDY: dict[str, str] = {
    "GD101": "a Python loop of tiny ops: vectorizing it changes the script's code, see the fix",
    "GD102": "the GPU starves behind host work; the finding names what keeps the host busy",
    "GD103": "host syncs (.item(), .cpu(), bool(tensor)) are the script's logic: move them "
             "out of the step or batch them, see the fix",
    "GD104": "small kernels: fusing them or torch.compile changes the script's code; a "
             "larger batch is tried where its memory and DataLoader allow (larger-batch)",
    "GD403": "what the script keeps from each step is its logic: keep less, see the fix",
    "GD703": "periodic work that is not a save (evaluation, logging) is the script's choice",
}


def remedies_for(code: str) -> list[Remedy]:
    return [r for r in REMEDIES.values() if code in r.findings]


# --- what each remedy saw in the script -----------------------------------------------------

Count = Annotated[int, Field(ge=0)]


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):  # not a count DataLoader could use either
        return None


@dataclass
class LoaderSettings:
    """A DataLoader's LOADER_SETTINGS as it was given them. None: not recorded (records of
    schema 3 and before have num_workers and pin_memory only), or prefetch_factor left unset."""

    num_workers: Count | None = None
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: Count | None = None

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> LoaderSettings:
        """From DataLoader's bound arguments, as plain numbers and booleans."""
        return cls(num_workers=_int(arguments.get("num_workers")),
                   pin_memory=bool(arguments.get("pin_memory")),
                   persistent_workers=bool(arguments.get("persistent_workers")),
                   prefetch_factor=_int(arguments.get("prefetch_factor")))


assert tuple(f.name for f in dataclasses.fields(LoaderSettings)) == LOADER_SETTINGS


@dataclass
class LoaderSeen:
    """One DataLoader a loader remedy saw built: where, its settings before and after the
    remedy, and what built it (gpudiag/measure/profile/inscript/frameworks.py)."""

    site: str | None  # the script's line that built it
    before: LoaderSettings | None = None
    after: LoaderSettings | None = None
    kept: str | None = None  # why it was left as it was (an IterableDataset)
    # A framework's loader: transformers' Trainer from its arguments (their class, and the
    # script's line that constructs them), a framework calling the script's hook, or a library
    # that rebuilt a loader the script built.
    framework: str | None = None
    arguments: str | None = None
    edit_at: str | None = None
    hook: str | None = None
    rebuilt_by: str | None = None

    @classmethod
    def of(cls, site: str | None, origin: Mapping[str, str]) -> LoaderSeen:
        """Built at `site`, by what `origin` says (frameworks.loader_origin's keys)."""
        return cls(site=site, framework=origin.get("framework"),
                   arguments=origin.get("arguments"), edit_at=origin.get("edit_at"),
                   hook=origin.get("hook"), rebuilt_by=origin.get("rebuilt_by"))


class RemedyRecord(ABC):
    """What a remedy saw in the script, answering for itself whether it changed anything and
    where it acted: methods only, so run.json keeps its fields as they were."""

    @abstractmethod
    def unchanged(self) -> str | None:
        """Why the remedy changed nothing in the script (its run then measures noise); None
        where it changed something."""

    @property
    @abstractmethod
    def site(self) -> str | None:
        """The script's line the remedy acted on first: where its permanent change goes."""


@dataclass
class Tf32Overruled:
    """The script switching TF32 off, overruled for the run: its line, and what it set."""

    site: str | None
    set: str


@dataclass
class Tf32Record(RemedyRecord):
    kept_on: list[Tf32Overruled] = field(default_factory=list)
    matmul_precision: str | None = None  # at the end of the run
    cudnn_allow_tf32: bool | None = None

    def unchanged(self) -> str | None:
        # Switched on at start-up, whatever the script does (what it had before is not
        # recorded): a change, always.
        return None

    @property
    def site(self) -> str | None:
        """The first line that switched TF32 off: the one to edit."""
        return self.kept_on[0].site if self.kept_on else None


@dataclass
class Bf16AutocastRecord(RemedyRecord):
    device: str | None = None
    forwards: Count = 0  # outermost module calls run under autocast
    module: str | None = None  # the first one's class

    def unchanged(self) -> str | None:
        return None if self.forwards else "the script called no module's forward"

    @property
    def site(self) -> str | None:
        return None  # not recorded: the change wraps the forward, wherever it is called


def _loaders_unchanged(loaders: list[LoaderSeen]) -> str | None:
    """Why a loader remedy changed no DataLoader's settings, or None where it changed one."""
    if not loaders:
        return "the script built no DataLoader while it ran"
    if all(n.before == n.after for n in loaders):
        return "the script's DataLoaders had these settings already"
    return None


@dataclass
class LoaderRecord(RemedyRecord):
    loaders: list[LoaderSeen] = field(default_factory=list)

    def unchanged(self) -> str | None:
        return _loaders_unchanged(self.loaders)

    @property
    def site(self) -> str | None:
        """The first DataLoader's line."""
        return self.loaders[0].site if self.loaders else None


@dataclass
class PinnedRecord(RemedyRecord):
    loaders: list[LoaderSeen] = field(default_factory=list)
    non_blocking_copies: Count = 0  # .to()/.cuda() of pinned tensors made non_blocking

    def unchanged(self) -> str | None:
        loaders = _loaders_unchanged(self.loaders)
        if loaders is None or self.non_blocking_copies:
            return None
        return f"{loaders}, and it copied no pinned tensor without non_blocking"

    @property
    def site(self) -> str | None:
        """The first DataLoader's line."""
        return self.loaders[0].site if self.loaders else None


@dataclass
class NoEmptyCacheRecord(RemedyRecord):
    calls_skipped: Count = 0

    def unchanged(self) -> str | None:
        return None if self.calls_skipped else \
            "the script never called torch.cuda.empty_cache()"

    @property
    def site(self) -> str | None:
        return None  # not recorded: the calls are skipped wherever they are


@dataclass
class AsyncSaveRecord(RemedyRecord):
    saves: Count = 0  # written in the background
    kept_blocking: Count = 0  # to a buffer, not a path: left as they were
    waited_ms: Annotated[float, Field(ge=0)] = 0.0  # a save waiting for the one before
    errors: list[str] = field(default_factory=list)
    site: str | None = None  # the first save's line

    def unchanged(self) -> str | None:
        return None if self.saves else "the script called torch.save on no path while it ran"


@dataclass
class OptimizerSeen:
    """One optimizer the fused-optimizer remedy saw built: where, its class, and how it
    steps as the script built it and as the remedy did ("fused=True", "foreach=False",
    "default"), or why it was left as it was."""

    site: str | None
    name: str
    before: str
    after: str | None = None
    kept: str | None = None


@dataclass
class FusedOptimizerRecord(RemedyRecord):
    optimizers: list[OptimizerSeen] = field(default_factory=list)

    def unchanged(self) -> str | None:
        return None if any(o.after for o in self.optimizers) else \
            "the script built no torch.optim optimizer that could step fused or foreach"

    @property
    def site(self) -> str | None:
        """The first optimizer the remedy changed: the constructor to edit."""
        return next((o.site for o in self.optimizers if o.after), None)


@dataclass
class FsdpKeepGatheredRecord(RemedyRecord):
    units: Count = 0  # FSDP2 units made to keep their parameters gathered
    kept: Count = 0  # units that kept them already (reshard_after_forward=False)
    site: str | None = None  # the script's first fully_shard(...) line the remedy changed

    def unchanged(self) -> str | None:
        return None if self.units else \
            "the script built no FSDP2 unit that reshards after forward"


@dataclass
class CompileModelRecord(RemedyRecord):
    modules: list[str] = field(default_factory=list)  # the classes compiled, in order
    site: str | None = None  # the script's line that first called one: the model's forward

    def unchanged(self) -> str | None:
        return None if self.modules else \
            "the script called no module with parameters that was not compiled already"


@dataclass
class ChannelsLastRecord(RemedyRecord):
    modules: list[str] = field(default_factory=list)  # the classes converted, in order
    kept: list[str] = field(default_factory=list)  # channels_last already: left as they were
    inputs: Count = 0  # 4-D inputs converted (calls of those modules)
    site: str | None = None  # the script's line that first called one: the model's forward

    def unchanged(self) -> str | None:
        return None if self.modules else \
            "the script called no module holding a Conv2d that was not channels_last already"


@dataclass
class DdpNoSyncRecord(RemedyRecord):
    models: Count = 0  # DistributedDataParallel models whose forwards were deferred
    deferred_forwards: Count = 0  # forwards that would have all-reduced in their backward
    reductions: Count = 0  # the remedy's own all-reduce rounds (one per optimizer step)
    site: str | None = None  # the script's first DDP forward line: the micro-step to wrap

    def unchanged(self) -> str | None:
        return None if self.deferred_forwards else \
            "the script ran no DistributedDataParallel forward outside no_sync()"


@dataclass
class DebugOff:
    """A debug setting a remedy kept off: the call or variable that would have turned it on,
    and the script's line (None: a variable)."""

    set_by: str
    site: str | None = None


@dataclass
class DebugOffRecord(RemedyRecord):
    kept_off: list[DebugOff] = field(default_factory=list)

    def unchanged(self) -> str | None:
        return None if self.kept_off else \
            "the script turned on none of the settings the remedy keeps off"

    @property
    def site(self) -> str | None:
        """The first line that turned one on: the one to delete."""
        return next((k.site for k in self.kept_off if k.site is not None), None)


@dataclass
class AllocatorConfRecord(RemedyRecord):
    before: str | None = None  # PYTORCH_CUDA_ALLOC_CONF as the script's environment had it
    after: str | None = None  # as the run had it
    late: bool = False  # CUDA had started already: the setting came too late to apply

    def unchanged(self) -> str | None:
        if self.late:
            return "CUDA had started before the setting could apply"
        if self.before is not None and "expandable_segments:True" in self.before:
            return "the script's environment had expandable segments already"
        return None

    @property
    def site(self) -> str | None:
        return None  # the environment, no line of the script


@dataclass
class ActivationCheckpointRecord(RemedyRecord):
    blocks: Count = 0  # blocks whose forwards were checkpointed
    block: str | None = None  # their class
    container: str | None = None  # where they are in the model ("model.layers")
    framework: str | None = None  # "transformers": its own gradient_checkpointing_enable()
    # The script's line that first called a block (its model's forward: where the change goes;
    # a Hugging Face model's: the line that called the model)
    site: str | None = None
    kept: str | None = None  # why a model was left as it was (it checkpoints already)

    def unchanged(self) -> str | None:
        return None if self.blocks or self.framework else self.kept or (
            "the script's model has no repeated blocks to checkpoint (an nn.ModuleList or "
            "nn.Sequential of two or more submodules of one class)")


@dataclass
class BatchSeen:
    """One DataLoader the larger-batch remedy saw built: where, its batch_size before and
    after, or why it was left as it was."""

    site: str | None
    before: Count | None = None
    after: Count | None = None
    kept: str | None = None


@dataclass
class LargerBatchRecord(RemedyRecord):
    factor: Annotated[int, Field(ge=1)] = 2  # what the plan asked: batch_size times this
    training_site: str | None = None  # the diagnosis run's training loader (None: any)
    loaders: list[BatchSeen] = field(default_factory=list)

    def unchanged(self) -> str | None:
        if any(n.after != n.before for n in self.loaders):
            return None
        return "the script built no map-style DataLoader given a batch_size" + (
            f" at {self.training_site}" if self.training_site else "")

    @property
    def site(self) -> str | None:
        """The training DataLoader's line, the one the remedy scaled."""
        return next((n.site for n in self.loaders if n.after != n.before), None)

    def batches(self) -> tuple[int, int] | None:
        """The training batch without and with the remedy, where it scaled one."""
        return next(((n.before, n.after) for n in self.loaders
                     if n.before is not None and n.after is not None and n.after != n.before),
                    None)


@dataclass
class RemedyEvidence:
    """What the remedies applied in one process saw, one record per remedy (None: not
    applied). A field is its remedy's name with underscores (run.json's keys of schema 3 and
    before were the names)."""

    tf32: Tf32Record | None = None
    bf16_autocast: Bf16AutocastRecord | None = None
    loader: LoaderRecord | None = None
    persistent_workers: LoaderRecord | None = None
    pinned: PinnedRecord | None = None
    no_empty_cache: NoEmptyCacheRecord | None = None
    fused_optimizer: FusedOptimizerRecord | None = None
    async_save: AsyncSaveRecord | None = None
    fsdp_keep_gathered: FsdpKeepGatheredRecord | None = None
    ddp_no_sync: DdpNoSyncRecord | None = None
    compile_model: CompileModelRecord | None = None
    no_debug: DebugOffRecord | None = None
    nondeterministic: DebugOffRecord | None = None
    channels_last: ChannelsLastRecord | None = None
    expandable_segments: AllocatorConfRecord | None = None
    activation_checkpointing: ActivationCheckpointRecord | None = None
    larger_batch: LargerBatchRecord | None = None

    def record(self, name: str) -> RemedyRecord | None:
        """Remedy `name`'s record (None: not applied, or no such remedy)."""
        value: RemedyRecord | None = getattr(self, field_of(name), None) \
            if name in REMEDIES else None
        return value

    @property
    def applied(self) -> list[str]:
        """The names of the remedies recorded, in REMEDIES' order."""
        return [name for name in REMEDIES if self.record(name) is not None]

    def records(self, names: Iterable[str]) -> list[RemedyRecord]:
        """The records of remedies `names` that were applied, in that order."""
        return [r for r in map(self.record, names) if r is not None]

    def unchanged(self, names: Iterable[str]) -> str | None:
        """Why remedies `names` changed nothing in the script, the first of them that did not
        (a run that measures noise); None where each changed something."""
        return next((f"{why}: nothing was changed" for r in self.records(names)
                     if (why := r.unchanged()) is not None), None)

    def site(self, names: Iterable[str]) -> str | None:
        """The script's line the first of remedies `names` that names one acted on (a
        DataLoader built, a torch.save called, TF32 switched off)."""
        return next((r.site for r in self.records(names) if r.site is not None), None)


def field_of(name: str) -> str:
    """RemedyEvidence's field for remedy `name`."""
    return name.replace("-", "_")


assert {f.name for f in dataclasses.fields(RemedyEvidence)} == {field_of(n) for n in REMEDIES}, \
    "every declared remedy has a record"
