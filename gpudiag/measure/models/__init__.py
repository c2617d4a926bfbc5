"""Model registry: built-in workloads, installed plugins, and user files.

A model is a `ModelSpec`: a name, a one-line summary, a `build` factory for the model that the
ladder's baseline stages train, and optional named `variants` (the `dgca` model has `loop` and
`vectorized`, which the `full-loop` and `full-vectorized` stages use). A factory takes
`ModelOptions` and returns a `ModelBundle`: the module plus a function that makes one synthetic
example, so that both the synthetic-batch stages and the DataLoader stages see the same data.

Three ways to make a model known, in the order they are looked up:
- `--model path/to/file.py:factory`, where `factory` is a `ModelSpec` or a function
  `(ModelOptions) -> ModelBundle`;
- an installed package's entry point in the group `gpudiag.models` (same two kinds of object);
- the built-ins, which register themselves on import (`bert`, `dgca`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpudiag.model.errors import BadInput

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gpudiag.model.config import ModelShape

Example = dict[str, "torch.Tensor"]
ENTRY_POINT_GROUP = "gpudiag.models"  # public: third-party packages register here
_BUILTIN_MODULES = ("gpudiag.measure.models.bert", "gpudiag.measure.models.dgca")


@dataclass(frozen=True)
class ModelOptions:
    """What a model factory is given: the shape to build and the data layout to produce."""

    shape: ModelShape
    seq_len: int
    prompt_length: int = 3
    candidates: int = 16
    seed: int = 0


@dataclass
class ModelBundle:
    """A built model and its data. `make_example(i)` must be deterministic in `i` and return
    CPU tensors of equal shape for every i (they are stacked into batches). `make_batch(start,
    count)`, where a model has it, builds rows start..start+count-1 at once with tensor ops,
    deterministic in (start, count): a batch of 100,000 rows takes a moment, not minutes."""

    model: nn.Module
    make_example: Callable[[int], Example]
    description: str = ""
    make_batch: Callable[[int, int], Example] | None = None
    # Keys of an example that an inference forward takes (None: all of them).
    infer_inputs: tuple[str, ...] | None = None

    def rows(self, start: int, count: int) -> Example:
        """Rows start..start+count-1 as one batch: `make_batch`, or the examples stacked."""
        if self.make_batch is not None:
            return self.make_batch(start, count)
        from torch.utils.data import default_collate  # noqa: PLC0415 (as in loss())

        return default_collate([self.make_example(i) for i in range(start, start + count)])

    def loss(self, output: Any) -> torch.Tensor:
        """The scalar loss of a forward's output: `.loss`, `["loss"]`, or the tensor itself."""
        import torch  # noqa: PLC0415 (run.json readers import models for names, not torch)

        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None and isinstance(output, torch.Tensor):
            loss = output
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("the model's output has no scalar loss: return a scalar tensor, a "
                            "dict with 'loss', or an object with a .loss attribute")
        return loss


Factory = Callable[[ModelOptions], ModelBundle]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    summary: str
    build: Factory
    variants: Mapping[str, Factory] = field(default_factory=dict)
    source: str = "built-in"


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Make `spec` known by its name. Built-in modules call this when imported."""
    _REGISTRY[spec.name] = spec
    return spec


def model_specs() -> list[ModelSpec]:
    """Every known model: built-ins first, then installed plugins."""
    _load_builtins()
    specs = dict(_REGISTRY)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in specs:
            try:
                specs[ep.name] = _as_spec(ep.load(), ep.name, f"plugin {ep.value}")
            except Exception as exc:  # a broken plugin is reported, not fatal
                specs[ep.name] = ModelSpec(ep.name, f"(failed to load: {exc})",
                                           build=_broken(ep.name, exc), source=ep.value)
    return list(specs.values())


def resolve_model(name: str) -> ModelSpec:
    """Find a model by registry name, plugin name, or `path/to/file.py:factory`."""
    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return _load_from_file(name)
    for spec in model_specs():
        if spec.name == name:
            return spec
    known = ", ".join(s.name for s in model_specs())
    raise BadInput(f"unknown model {name!r} (known: {known}; or path/to/file.py:factory)")


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _load_from_file(ref: str) -> ModelSpec:
    path_text, attr = ref.split(":", 1)
    path = Path(path_text)
    if not path.is_file():
        raise BadInput(f"--model {ref}: no such file {path_text}")
    module = _import_file(path.resolve(), path.stat().st_mtime_ns, ref)
    target = getattr(module, attr, None)
    if target is None:
        raise BadInput(f"--model {ref}: {path_text} defines no {attr!r}")
    return _as_spec(target, f"{path.stem}:{attr}", str(path))


@functools.cache
def _import_file(path: Path, modified_ns: int, ref: str) -> types.ModuleType:
    """The user's model file, imported once per process and version of the file (the plan and
    the runner both resolve the model; a file with side effects must see them once). Anything
    it raises, SystemExit and KeyboardInterrupt included, is a one-line error naming it."""
    module_name = f"gpudiag_user_model_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise BadInput(f"--model {ref}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    # No __pycache__ left beside the user's file (or beside what it imports): gpudiag adds
    # nothing to the user's folders. Seen once CI allowed bytecode writing: a run of
    # `--model exits.py:factory` left __pycache__/exits.cpython-311.pyc there.
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[module_name]
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise BadInput(f"--model {ref}: importing {path.name} failed: {detail}") from None
    finally:
        sys.dont_write_bytecode = writes_bytecode
    return module


def _as_spec(target: object, name: str, source: str) -> ModelSpec:
    if isinstance(target, ModelSpec):
        return target
    if callable(target):
        doc = (getattr(target, "__doc__", None) or "").strip().splitlines()
        return ModelSpec(name=name, summary=doc[0] if doc else f"user model from {source}",
                         build=target, source=source)
    raise BadInput(f"model {name!r}: expected a ModelSpec or a factory function, "
                   f"got {type(target).__name__}")


def _broken(name: str, exc: Exception) -> Factory:
    def build(options: ModelOptions) -> ModelBundle:
        raise BadInput(f"model plugin {name!r} failed to load: {exc}")

    return build
