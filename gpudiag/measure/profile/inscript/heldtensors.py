"""What holds tensors in a profiled script, read from its own namespaces: the containers (lists,
dicts, deques, and those one attribute down of an object) in the training loop's locals and the
script's globals, with how many tensors each holds, the bytes of their storages and whether
they keep autograd graphs; and the local tensors whose autograd graphs they keep. Two looks some
steps apart tell what grows (`kept_between`): memory a script keeps from every step, named as
the script names it, at the line that adds to it (`adding_line`).

Pure reads of Python objects: nothing here changes the script's state or runs its code (no
property is evaluated: attributes are read from `__dict__`).
"""

from __future__ import annotations

import collections
import linecache
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import CodeType, FrameType, FunctionType, ModuleType
from typing import Any, Literal

import torch

from gpudiag.measure.evidence.source import display_path
from gpudiag.model.facts import KeptKind, KeptTensors

MAX_ITEMS = 20_000  # items of one container looked at (a data set held as a list: its first)
MAX_NODES = 200_000  # autograd nodes of one tensor's graph counted
_KINDS: dict[type, KeptKind] = {list: "list of tensors", dict: "dict of tensors",
                                collections.deque: "deque of tensors",
                                tuple: "tuple of tensors", set: "set of tensors"}
StorageKey = tuple[str, int]


@dataclass(frozen=True)
class Held:
    """What one name holds at one look."""

    kind: KeptKind
    tensors: int  # a container's tensors; a tensor's autograd nodes
    bytes: int  # its tensors' storages, each once
    graph_kept: bool
    device: str  # its largest tensor's device type


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """The storage a tensor views (two views of one storage hold its bytes once)."""
    try:
        return tensor.device.type, tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, a tensor subclass
        return None


def storage_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, TypeError):
        return int(tensor.numel() * tensor.element_size())


def bytes_once(tensors: Iterable[torch.Tensor], seen: set[StorageKey] | None = None) -> int:
    """The bytes of the storages `tensors` view, each storage once (and none in `seen`, which
    gets the new ones)."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        key = storage_key(tensor)
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        total += storage_bytes(tensor)
    return total


def _tensors_in(container: Any) -> Iterator[torch.Tensor]:
    """A container's tensors, and those of the containers in it (one level: a list of
    (output, target) pairs, a dict of lists), MAX_ITEMS items at most."""
    items = container.values() if isinstance(container, Mapping) else container
    for n, item in enumerate(items):
        if n >= MAX_ITEMS:
            return
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, (list, tuple, collections.deque, dict)):
            inner = item.values() if isinstance(item, dict) else item
            yield from (t for t in inner if isinstance(t, torch.Tensor))


def graph_nodes(tensor: torch.Tensor) -> int:
    """The autograd nodes behind a tensor (its graph's size), MAX_NODES at most."""
    seen: set[int] = set()
    todo = [tensor.grad_fn] if tensor.grad_fn is not None else []
    while todo and len(seen) < MAX_NODES:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(nxt for nxt, _ in getattr(node, "next_functions", ()) if nxt is not None)
    return len(seen)


def held_by(value: Any) -> Held | None:
    """What `value` holds: a container's tensors, a tensor's autograd graph; None for anything
    else (or a container of no tensors)."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is None:
            return None
        return Held("tensor with its graph", graph_nodes(value), storage_bytes(value), True,
                    value.device.type)
    kind = _KINDS.get(type(value))
    if kind is None or isinstance(value, str):
        return None
    tensors = list(_tensors_in(value))
    if not tensors:
        return None
    graph = any(t.grad_fn is not None or t.requires_grad for t in tensors)
    largest = max(tensors, key=lambda t: t.numel() * t.element_size())
    return Held(kind, len(tensors), bytes_once(tensors), graph, largest.device.type)


def _scanned(value: Any) -> bool:
    """An object whose attributes are looked at, one level down (`self.history`): not a
    module, class, function or tensor."""
    return not isinstance(value, (ModuleType, type, FunctionType, torch.Tensor)) and \
        isinstance(getattr(value, "__dict__", None), dict)


def look(namespaces: Mapping[str, Mapping[str, Any]]) -> dict[str, Held]:
    """Every name in `namespaces` (the loop's locals, the script's globals: a prefix each,
    "" for plain names) that holds tensors, and the attributes of the objects there."""
    found: dict[str, Held] = {}
    for prefix, names in namespaces.items():
        for name, value in list(names.items()):
            if name.startswith("__"):
                continue
            held = held_by(value)
            if held is not None:
                found[prefix + name] = held
            elif _scanned(value) and not isinstance(value, torch.nn.Parameter):
                for attr, inner in list(vars(value).items()):
                    held = held_by(inner)
                    if held is not None:
                        found[f"{prefix}{name}.{attr}"] = held
    return found


def loop_namespaces(frame: FrameType) -> dict[str, Mapping[str, Any]]:
    """The training loop's locals (a loop in a function) and its module's globals."""
    spaces: dict[str, Mapping[str, Any]] = {"": frame.f_globals}
    if frame.f_code.co_name != "<module>":
        spaces = {"": dict(frame.f_locals), "globals:": frame.f_globals}
    return spaces


def grown(before: Mapping[str, Held], after: Mapping[str, Held]) -> list[tuple[str, Held, Held]]:
    """The names whose tensors (a graph's nodes) grew between two looks, largest growth in
    bytes first; a name seen once only is not compared."""
    found = [(name, before[name], held) for name, held in after.items()
             if name in before and held.kind == before[name].kind
             and held.tensors > before[name].tensors]
    return sorted(found, key=lambda f: (f[2].bytes - f[1].bytes, f[2].tensors - f[1].tensors),
                  reverse=True)


def kept_between(before: Mapping[str, Held], after: Mapping[str, Held], steps: tuple[int, int],
                 code: CodeType | None, loop_line: str | None) -> list[KeptTensors]:
    """What grew between the looks at step boundaries `steps`, each at the line that adds to
    it (`code`: the loop's function), as facts."""
    apart = max(1, steps[1] - steps[0])
    kept = []
    for name, first, last in grown(before, after):
        location, found_by = adding_line(_bare(name), last.kind, code)
        graph = last.kind == "tensor with its graph"
        kept.append(KeptTensors(
            name=_bare(name), kind=last.kind, location=location or loop_line, steps=steps,
            tensors=last.tensors, added_per_step=round((last.tensors - first.tensors) / apart, 3),
            bytes=last.bytes,
            bytes_per_step=0.0 if graph else round(max(0, last.bytes - first.bytes) / apart, 1),
            graph_kept=last.graph_kept, found_by=found_by if location else "loop",
            device=last.device))
    return kept


def _bare(name: str) -> str:
    return name.removeprefix("globals:")


_ADDS = r"\s*\.\s*(?:append|extend|insert|appendleft|extendleft|add|update|setdefault)\s*\("
_SETS = r"\s*\[[^\]]*\]\s*=(?!=)"
_GROWS = r"\s*(?:\+|-|\*|/)=|\s*=\s*{name}\s*[-+*/]"


def _patterns(name: str, kind: KeptKind) -> re.Pattern[str]:
    escaped = re.escape(name)
    if kind == "tensor with its graph":
        forms = _GROWS.format(name=escaped)
    else:
        forms = f"{_ADDS}|{_SETS}|\\s*\\+="
    return re.compile(rf"(?<![\w.]){escaped}(?:{forms})")


def _code_lines(code: CodeType) -> range:
    lines = [line for _, _, line in code.co_lines() if line is not None]
    return range(code.co_firstlineno, max(lines, default=code.co_firstlineno) + 1)


def adding_line(name: str, kind: KeptKind,
                code: CodeType | None) -> tuple[str | None, Literal["append", "name", "loop"]]:
    """The line that adds to `name` (`name.append(`, `name[k] =`, `name +=`): in the loop's
    function first ("append"), else anywhere in its file ("name": a helper the loop calls);
    (None, "loop") where neither has one."""
    if code is None:
        return None, "loop"
    source = linecache.getlines(code.co_filename)
    pattern = _patterns(name, kind)
    span = _code_lines(code)
    ordered = [*span, *(n for n in range(1, len(source) + 1) if n not in span)]
    for number in ordered:
        if 0 < number <= len(source) and pattern.search(source[number - 1]):
            return (f"{display_path(code.co_filename)}:{number}",
                    "append" if number in span else "name")
    return None, "loop"
