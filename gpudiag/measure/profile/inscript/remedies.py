"""Remedies applied inside a profiled script, for one run (`gpudiag profile --try-fixes`).

Each is applied at start-up, before the script's first line, by replacing or wrapping what the
script will call (torch.save, DataLoader.__init__, torch.cuda.empty_cache, ...), and records
what it saw in the script (`evidence`: a DataLoader's workers before and after, calls skipped,
saves written in the background), so the report shows the fix took effect. The catalog (what
each remedy is, which findings call for it, the permanent change) is gpudiag/model/remedies.py.

Also here: the first steps' losses, recorded for the equivalence check (the value every
backward() starts from, up to a count), and the seed every run of one --try-fixes shares.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.data import DataLoader, IterableDataset

from gpudiag.measure.evidence.source import call_site
from gpudiag.measure.profile.inscript.frameworks import loader_origin
from gpudiag.model.remedies import LOADER_SETTINGS, REMEDIES

Evidence = dict[str, Any]
MAX_LOADER_WORKERS = 8
LOADER_PREFETCH = 4


def _site(depth: int = 2) -> str | None:
    """The script's line that called into what a remedy wraps (`depth` frames up)."""
    site = call_site(sys._getframe(depth))
    return site.location if site is not None else None


def _wrap(owner: Any, name: str, around: Callable[[Callable[..., Any]], Callable[..., Any]],
          ) -> None:
    # Not hooks.py's _wrap, which wraps once: remedies stack (loader and pinned both wrap
    # DataLoader.__init__ in a combined run), and the recorder then wraps what they made.
    setattr(owner, name, around(getattr(owner, name)))


# --- tf32 ---------------------------------------------------------------------------------

def _tf32(evidence: Evidence) -> Callable[[], None]:
    """TF32 on, and kept on: a script that switches it off itself (the usual cause of the
    finding) is overruled for this run, and the line that did it is noted (the one to edit)."""
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    evidence["kept_on"] = []

    def overruled(what: str) -> None:
        evidence["kept_on"].append({"site": _site(depth=3), "set": what})

    def guard(cls: type[object]) -> None:
        original = cls.__setattr__

        def __setattr__(self: object, name: str, value: object) -> None:
            if (name == "allow_tf32" and value is False) or (
                    name == "fp32_precision" and value == "ieee"):
                overruled(f"{name} = {value!r}")
                return
            original(self, name, value)
        cls.__setattr__ = __setattr__  # type: ignore[method-assign]

    guard(type(torch.backends.cuda.matmul))
    guard(type(torch.backends.cudnn))

    def around(original: Callable[[str], None]) -> Callable[[str], None]:
        def set_float32_matmul_precision(precision: str) -> None:
            if precision == "highest":
                overruled(f"set_float32_matmul_precision({precision!r})")
                return
            original(precision)
        return set_float32_matmul_precision

    _wrap(torch, "set_float32_matmul_precision", around)

    def observe() -> None:
        evidence["matmul_precision"] = torch.get_float32_matmul_precision()
        evidence["cudnn_allow_tf32"] = bool(torch.backends.cudnn.allow_tf32)
        if evidence["kept_on"]:
            evidence["site"] = evidence["kept_on"][0]["site"]
    return observe


# --- bf16 autocast around the outermost module call ----------------------------------------

def _bf16_autocast(evidence: Evidence) -> Callable[[], None]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = threading.local()
    evidence.update(device=device, forwards=0)

    def enter(module: torch.nn.Module, _args: Any) -> None:
        depth = getattr(state, "depth", 0)
        if depth == 0:
            state.context = torch.autocast(device, dtype=torch.bfloat16)
            state.context.__enter__()
            evidence["forwards"] += 1
            evidence.setdefault("module", type(module).__name__)
        state.depth = depth + 1

    def leave(_module: torch.nn.Module, args: Any, output: Any) -> Any:
        state.depth = getattr(state, "depth", 1) - 1
        if state.depth != 0:
            return None
        state.context.__exit__(None, None, None)
        # What leaves the autocast region comes back in the caller's dtype (as Accelerate's
        # convert_outputs_to_fp32 does): `F.mse_loss(model(x), x)` would otherwise mix a
        # bf16 output with the caller's fp32 tensors.
        floats = [a.dtype for a in tree_leaves(args)
                  if isinstance(a, torch.Tensor) and a.is_floating_point()]
        caller = floats[0] if floats else torch.get_default_dtype()
        if caller == torch.bfloat16:
            return None
        return tree_map_only(torch.Tensor, lambda t: t.to(caller) if t.dtype == torch.bfloat16
                             else t, output)

    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)
    return lambda: None


# --- DataLoader settings --------------------------------------------------------------------

def _loader_options(evidence: Evidence, change: Callable[[dict[str, Any]], dict[str, Any]],
                    ) -> None:
    """Rewrite each map-style DataLoader's arguments with `change`; note every loader, and what
    built it (a framework, from the script's line: frameworks.py, beside this one)."""
    evidence.setdefault("loaders", [])
    signature = inspect.signature(DataLoader.__init__)

    def around(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            given = dict(bound.arguments)
            given.pop("self")
            note: dict[str, Any] = {"site": _site(), **loader_origin(sys._getframe(1), self)}
            if isinstance(given["dataset"], IterableDataset):
                # More workers would each iterate the whole dataset: not the same training.
                note["kept"] = "an IterableDataset: worker count left as it was"
            else:
                before = {k: given[k] for k in LOADER_SETTINGS}
                given = change(given)
                note.update(before=before, after={k: given[k] for k in before})
            evidence["loaders"].append(note)
            original(self, **given)
        return __init__

    _wrap(DataLoader, "__init__", around)


def _more_workers(given: dict[str, Any]) -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = max(given["num_workers"], min(MAX_LOADER_WORKERS, cpus or 1))
    given.update(num_workers=workers, pin_memory=given["pin_memory"] or torch.cuda.is_available())
    if workers > 0:
        given.update(persistent_workers=True, prefetch_factor=max(
            LOADER_PREFETCH, given.get("prefetch_factor") or 0))
    return given


def _loader(evidence: Evidence) -> Callable[[], None]:
    _loader_options(evidence, _more_workers)
    return lambda: None


def _pinned(evidence: Evidence) -> Callable[[], None]:
    _loader_options(evidence, lambda given: {**given, "pin_memory": True})
    evidence["non_blocking_copies"] = 0

    def around(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # Positional non_blocking (to(device, dtype, non_blocking)) is left as written.
            if (self.device.type == "cpu" and "non_blocking" not in kwargs and len(args) < 3
                    and self.is_pinned()):
                kwargs["non_blocking"] = True
                evidence["non_blocking_copies"] += 1
            return original(self, *args, **kwargs)
        return to

    _wrap(torch.Tensor, "to", around)
    _wrap(torch.Tensor, "cuda", around)
    return lambda: None


# --- empty_cache ---------------------------------------------------------------------------

def _no_empty_cache(evidence: Evidence) -> Callable[[], None]:
    evidence["calls_skipped"] = 0

    def skipped() -> None:
        evidence["calls_skipped"] += 1

    torch.cuda.empty_cache = skipped
    torch.cuda.memory.empty_cache = skipped
    return lambda: None


# --- asynchronous torch.save ---------------------------------------------------------------

class _BackgroundSaver:
    """torch.save to a path: a snapshot of the tensors on the host now, the file written by one
    background thread; a save waits for the one before it (at most one snapshot is held), and
    the process waits for the last one before it exits."""

    def __init__(self, original: Callable[..., Any], evidence: Evidence) -> None:
        self.original, self.evidence = original, evidence
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="gpudiag-save")
        self.pending: Future[Any] | None = None
        evidence.update(saves=0, kept_blocking=0, waited_ms=0.0, errors=[])
        atexit.register(self.flush)

    def __call__(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)):  # a buffer the script reads right after
            self.evidence["kept_blocking"] += 1
            return self.original(obj, f, *args, **kwargs)
        self.flush()
        snapshot = _snapshot(obj, {})
        self.pending = self.executor.submit(self.original, snapshot, f, *args, **kwargs)
        self.evidence["saves"] += 1
        self.evidence.setdefault("site", _site())
        return None

    def flush(self) -> None:
        if self.pending is None:
            return
        start = time.perf_counter()
        try:
            self.pending.result()
        except Exception as exc:  # the file the script asked for was not written: say so
            self.evidence["errors"].append(f"{type(exc).__name__}: {exc}")
            print(f"gpudiag profile: a background torch.save failed: {exc}", file=sys.stderr)
        self.evidence["waited_ms"] += (time.perf_counter() - start) * 1e3
        self.pending = None


def _snapshot(value: Any, seen: dict[tuple[Any, ...], torch.Tensor]) -> Any:
    """`value` with every tensor copied to the host (tied tensors stay tied)."""
    if isinstance(value, torch.Tensor):
        key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(),
               tuple(value.shape), value.stride(), value.dtype)
        if key not in seen:
            seen[key] = value.detach().to("cpu", copy=True)
        return seen[key]
    if isinstance(value, dict):
        return type(value)((k, _snapshot(v, seen)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_snapshot(v, seen) for v in value)
    return value


def _async_save(evidence: Evidence) -> Callable[[], None]:
    saver = _BackgroundSaver(torch.save, evidence)
    torch.save = saver
    return saver.flush


APPLIERS: dict[str, Callable[[Evidence], Callable[[], None]]] = {
    "tf32": _tf32, "bf16-autocast": _bf16_autocast, "loader": _loader, "pinned": _pinned,
    "no-empty-cache": _no_empty_cache, "async-save": _async_save,
}
assert set(APPLIERS) == set(REMEDIES), "every declared remedy has an applier"


class Applied:
    """The remedies applied in this process and what each saw; `observe()` at the end."""

    def __init__(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in APPLIERS]
        if unknown:
            raise ValueError(f"unknown remedy {unknown[0]!r}")
        self.evidence: dict[str, Evidence] = {name: {} for name in names}
        self.observers = [APPLIERS[name](self.evidence[name]) for name in names]

    def observe(self) -> dict[str, Evidence]:
        for observe in self.observers:
            with contextlib.suppress(Exception):
                observe()
        return self.evidence


# --- losses and seed -----------------------------------------------------------------------

class LossLog:
    """The value each backward() starts from, for the first `limit` calls (a scalar loss; a
    GradScaler's scaled loss is the same scale in every run). Reading it is a host sync, so
    only the first calls are read: they fall in the warm-up, before any timed step."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.values: list[float] = []
        if limit > 0:
            _wrap(torch.Tensor, "backward", self._around)

    def _around(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if len(self.values) < self.limit and tensor.numel() == 1:
                self.values.append(float(tensor.detach().float()))
            return original(tensor, *args, **kwargs)
        return backward


def seed_everything(seed: int) -> None:
    """One seed for every run of a --try-fixes (a script that seeds itself overrides it)."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)


