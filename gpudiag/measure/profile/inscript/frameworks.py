"""Which training framework built a DataLoader or an optimizer, and where its user sets what it
was built with.

The DataLoader remedy sees each `DataLoader(...)` as it is built; the permanent change goes where
the script decides the loader's settings, which a framework moves:

- transformers' Trainer builds the loader itself (`get_train_dataloader`, in
  transformers/trainer.py) from its `TrainingArguments`: the change goes there, as
  `dataloader_num_workers=...`, at the script's `TrainingArguments(` line.
- Lightning (and a Trainer subclass that overrides `get_train_dataloader`) calls the script's own
  hook, `train_dataloader()`, which builds it: the change goes in that hook.
- Accelerate's `prepare` (and Lightning, to add a distributed sampler) rebuilds a loader the
  script built already, with its settings: the change goes where the script built that one.

The Trainer also builds its optimizer (`create_optimizer`) from `TrainingArguments(optim=...)`;
Lightning's comes from the script's own `configure_optimizers`, a line of the script's.

And whether the script has run torch.compile'd code (its watch, and the memory owners' watch,
which then leaves autograd's saved-tensor hooks alone: Dynamo guards on them and would
recompile).
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader

from gpudiag.measure.evidence.source import display_path, frame_role

# Libraries that call the script's own hook to get a loader.
HOOK_CALLERS = ("transformers", "lightning", "pytorch_lightning")
# Libraries that rebuild a loader the script gave them, with its settings.
REBUILDERS = ("accelerate", "lightning", "pytorch_lightning", "lightning_fabric")
TRANSFORMERS_TRAINER = ("transformers", "trainer.py")


def _package(filename: str) -> tuple[str, ...]:
    """An installed module's path inside site-packages, as parts: ("transformers", ...)."""
    return Path(display_path(filename)).parts


def loader_origin(frame: FrameType | None, loader: DataLoader[Any]) -> dict[str, str]:
    """What built `loader`, whose `__init__` `frame` called (outward from it): for the record
    of the loader remedy (`framework`, `arguments`, `edit_at`, `hook`, `rebuilt_by`); empty
    for a loader the script built itself, outside any framework's hook."""
    inner: list[tuple[tuple[str, ...], FrameType]] = []  # library frames, loader to user's line
    callers: list[str] = []  # packages between the user's line and the user's next frame out
    users: list[FrameType] = []
    while frame is not None:
        role = frame_role(frame.f_code.co_filename)
        if role == "library" and not users:
            inner.append((_package(frame.f_code.co_filename), frame))
        elif role == "library" and len(users) == 1:
            callers.append(_package(frame.f_code.co_filename)[0])
        elif role == "user":
            users.append(frame)
        frame = frame.f_back
    trainer = next((f for parts, f in inner if parts[-2:] == TRANSFORMERS_TRAINER), None)
    if trainer is not None:
        return _transformers(trainer, users)
    # A library frame holding another loader builds this one from it (Lightning also wraps
    # DataLoader.__init__ while the hook runs, to note its arguments: that rebuilds nothing).
    rebuilt = next((parts[0] for parts, f in inner if parts[0] in REBUILDERS and any(
        isinstance(v, DataLoader) and v is not loader for v in f.f_locals.values())), None)
    if rebuilt is not None:
        return {"rebuilt_by": rebuilt}
    called_by = next((c for c in callers if c in HOOK_CALLERS), None)
    if called_by is not None:
        code = users[0].f_code
        # "main.<locals>.Data.train_dataloader" (a class defined in a function): "Data.train_..."
        hook = getattr(code, "co_qualname", code.co_name).rpartition("<locals>.")[2]
        return {"framework": called_by, "hook": hook}
    return {}


def optimizer_origin(frame: FrameType | None) -> dict[str, str]:
    """What built the optimizer whose constructor `frame` is in: {} when the script did;
    transformers' Trainer (`framework`, `arguments`, `edit_at`) when it did, from its
    arguments."""
    users: list[FrameType] = []
    trainer: FrameType | None = None
    while frame is not None:
        role = frame_role(frame.f_code.co_filename)
        if role == "user":
            users.append(frame)
        elif role == "library" and not users and trainer is None \
                and _package(frame.f_code.co_filename)[-2:] == TRANSFORMERS_TRAINER:
            trainer = frame
        frame = frame.f_back
    return {} if trainer is None else _transformers(trainer, users)


def _transformers(trainer: FrameType, users: list[FrameType]) -> dict[str, str]:
    """The Trainer built the loader from its arguments: their class, and the script's line that
    constructs them (when a file on the stack has one)."""
    arguments = getattr(trainer.f_locals.get("self"), "args", None)
    name = type(arguments).__name__ if arguments is not None else "TrainingArguments"
    origin = {"framework": "transformers", "arguments": name}
    for frame in users:
        line = _constructed_at(frame.f_code.co_filename, name, frame.f_lineno)
        if line is not None:
            origin["edit_at"] = f"{display_path(frame.f_code.co_filename)}:{line}"
            break
    return origin


def _constructed_at(filename: str, name: str, before: int) -> int | None:
    """The line of the call `name(...)` in `filename` nearest before line `before` (the first
    one when none precedes it)."""
    lines = _calls_of(filename, name)
    if not lines:
        return None
    preceding = [n for n in lines if n <= before]
    return preceding[-1] if preceding else lines[0]


@functools.cache
def _calls_of(filename: str, name: str) -> tuple[int, ...]:
    try:
        tree = ast.parse(Path(filename).read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple(sorted(
        node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == name or getattr(node.func, "attr", None) == name)))


def compiled() -> bool:
    """Whether the process has run torch.compile'd code (Dynamo compiled a frame)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    # Dynamo's counters are a defaultdict: reading with [] would add keys the script can see.
    counters = dynamo.utils.counters
    return bool(counters.get("frames", {}).get("ok")
                or counters.get("stats", {}).get("unique_graphs"))
