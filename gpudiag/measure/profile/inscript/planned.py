"""How many optimizer steps a script means to make, where it says so: transformers' Trainer
(`state.max_steps`, which it computes from max_steps or epochs before training), Lightning
(`trainer.max_steps`, else `estimated_stepping_batches`), or the script's own loop around its
step, read from the source: `for step in range(N)`, `for batch in loader` (its len()), nested
loops multiplied. Read once, at the first optimizer step, from the live frames; nothing is
called but len() on a loader or a list, and an expression is only evaluated when it is made of
numbers, names, attributes kept in an object's own __dict__, arithmetic, range() and len()."""

from __future__ import annotations

import ast
import functools
import linecache
import operator
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any

from torch.utils.data import DataLoader

from gpudiag.measure.evidence.source import code_role, display_path

MAX_FRAMES = 64  # frames looked through, from the optimizer's step outward
_LIGHTNING = ("lightning.", "pytorch_lightning.")


class _NotPlain(Exception):
    """The expression calls or reads something that could run code: not evaluated."""


def planned_steps(frame: FrameType | None) -> tuple[int, str] | None:
    """(steps, where that figure comes from) for the run `frame` (the optimizer step's caller)
    is part of, or None where nothing says."""
    frames = list(_outward(frame))
    for f in frames:
        found = _trainer(f) or _lightning(f)
        if found is not None:
            return found
    steps, where = 1, ""
    for f in frames:
        if code_role(f.f_code) != "user":
            continue
        loops = _loops_around(f.f_code, f.f_lineno)
        if loops is None:
            # No loop here: the loop is further out; or, once one was found, this frame calls
            # the loop's function once, unless a loop holds the call after all (a `while`, an
            # `if` inside a `for`): then how often is not known.
            if where and _held_unknown(f.f_code, f.f_lineno):
                return None
            continue
        for loop in loops:
            count = _length(loop, f)
            if count is None:
                return None
            steps *= count
        # The innermost loop names the figure; loops in the callers (an epoch loop around a
        # train_epoch() call) multiply it.
        if not where:
            path = display_path(f.f_code.co_filename)
            where = (f"the loop at {path}:{loops[0].lineno}" if len(loops) == 1 else
                     f"the loops at {path}:" + " x :".join(str(x.lineno) for x in loops))
        else:
            where += f" x the loop at {display_path(f.f_code.co_filename)}:{loops[0].lineno}"
    return (steps, where) if where and steps > 0 else None


def _outward(frame: FrameType | None) -> Iterator[FrameType]:
    for _ in range(MAX_FRAMES):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def _trainer(frame: FrameType) -> tuple[int, str] | None:
    """transformers' Trainer, inside its training loop."""
    if frame.f_code.co_name != "_inner_training_loop" or \
            "transformers" not in frame.f_code.co_filename:
        return None
    state = getattr(frame.f_locals.get("self"), "state", None)
    steps = getattr(state, "max_steps", None)
    if isinstance(steps, int) and steps > 0:
        return steps, "transformers' Trainer (state.max_steps)"
    return None


def _lightning(frame: FrameType) -> tuple[int, str] | None:
    """Lightning's Trainer, from one of its loops (only Lightning's own objects are asked:
    a script's object may compute `trainer` with a property that raises or does work)."""
    owner = frame.f_locals.get("self")
    if not type(owner).__module__.startswith(_LIGHTNING):
        return None
    trainer = getattr(owner, "trainer", None)
    if trainer is None or not type(trainer).__module__.startswith(_LIGHTNING):
        return None
    steps = getattr(trainer, "max_steps", -1)
    if isinstance(steps, int) and steps > 0:
        return steps, "Lightning's Trainer (max_steps)"
    try:
        estimated = trainer.estimated_stepping_batches
    except Exception:  # an unsized loader, or a trainer not set up: nothing says
        return None
    if isinstance(estimated, (int, float)) and 0 < estimated < float("inf"):
        return int(estimated), "Lightning's Trainer (estimated_stepping_batches)"
    return None


@functools.lru_cache(maxsize=64)
def _tree(filename: str) -> ast.Module | None:
    try:
        return ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return None


def _first_line(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    """Where a code object of this definition starts (its first decorator's line)."""
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _loops_around(code: CodeType, line: int) -> list[ast.For] | None:
    """The `for` statements of `code`'s function whose bodies hold `line`, outermost first;
    None when no loop holds it, the source is not readable, or a `while` loop or an `if`
    inside the innermost loop holds it (how often the step runs is then not the loop's
    count)."""
    held = _statements_around(code, line)
    if held is None:
        return None
    loops = [n for n in held if isinstance(n, ast.For)]
    if not loops or any(isinstance(n, ast.While) for n in held) or any(
            isinstance(n, ast.If) and n.lineno > loops[-1].lineno for n in held):
        return None
    return loops


def _held_unknown(code: CodeType, line: int) -> bool:
    """Whether a loop holds `line` in `code`'s function, or its source is unreadable: for a
    line no countable loop holds (_loops_around gave None), how often it runs is not known."""
    held = _statements_around(code, line)
    return held is None or any(isinstance(n, (ast.For, ast.While)) for n in held)


def _statements_around(code: CodeType, line: int) -> list[ast.stmt] | None:
    """The for, while and if statements of `code`'s function whose bodies hold `line`,
    outermost first; None when the source is not readable."""
    tree = _tree(code.co_filename)
    if tree is None:
        return None
    held: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    _first_line(child) != code.co_firstlineno:
                continue  # another function's loops are not this frame's
            end = getattr(child, "end_lineno", None)
            if end is None or not getattr(child, "lineno", line + 1) <= line <= end:
                continue
            if isinstance(child, (ast.For, ast.While, ast.If)) and any(
                    s.lineno <= line <= (s.end_lineno or s.lineno) for s in child.body):
                held.append(child)
            visit(child)

    visit(tree)
    return held


def _length(loop: ast.For, frame: FrameType) -> int | None:
    """How many times `loop` runs, where its iterable says so plainly."""
    target = loop.iter
    if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and \
            target.func.id == "enumerate" and target.args:
        target = target.args[0]
    try:
        if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and \
                target.func.id == "range":
            bounds = [_value(a, frame) for a in target.args]
            if all(isinstance(b, int) for b in bounds) and 1 <= len(bounds) <= 3:
                return len(range(*bounds))
            return None
        return _sized(_value(target, frame))
    except (_NotPlain, ValueError, TypeError, ZeroDivisionError):
        return None


def _sized(value: Any) -> int | None:
    """len() of a DataLoader, a list or a tuple (their len() runs no script code)."""
    if isinstance(value, (list, tuple, range)) or (
            isinstance(value, DataLoader) and hasattr(value.dataset, "__len__")):
        try:
            return len(value)
        except TypeError:  # an IterableDataset's loader
            return None
    return None


_ARITHMETIC: dict[type[ast.operator], Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv}


def _value(node: ast.expr, frame: FrameType) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        scope = next((s for s in (frame.f_locals, frame.f_globals) if node.id in s), None)
        if scope is None:
            raise _NotPlain(node.id)
        return scope[node.id]
    if isinstance(node, ast.Attribute):
        fields = getattr(_value(node.value, frame), "__dict__", None)
        if not isinstance(fields, dict) or node.attr not in fields:
            raise _NotPlain(node.attr)
        return fields[node.attr]
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = _value(node.left, frame), _value(node.right, frame)
        if isinstance(left, int) and isinstance(right, int):
            return _ARITHMETIC[type(node.op)](left, right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id == "len" and len(node.args) == 1:
        return _sized(_value(node.args[0], frame))
    raise _NotPlain(type(node).__name__)
