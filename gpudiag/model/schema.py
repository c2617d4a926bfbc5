"""run.json's schema: the dataclasses of results.py and facts.py, validated strictly on load.

One declaration: a field's type (and its `Annotated` bounds, e.g. a step time of at least a
microsecond) is what a file must hold. pydantic validates the parsed document in JSON's strict
mode (https://docs.pydantic.dev/latest/concepts/strict_mode/): no coercion of "5" or true into a
number, no NaN or infinity, unknown severities and statuses refused. What JSON can express but
no gpudiag run can hold is refused before it reaches the types: nesting deeper than the
parser's stack, and integers beyond 64 bits (Python would turn them into floats that overflow).
Every refusal is one line: the file, the field's path and what is wrong with it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from typing import Any, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

T = TypeVar("T")

MAX_ABS_INT = 2**63  # run.json holds counts, bytes and sizes: 64-bit integers
_STRICT = ConfigDict(strict=True, allow_inf_nan=False)


class SchemaError(ValueError):
    """The document does not fit the schema; the message names the field."""


def parse_json(text: str) -> Any:
    """Parsed JSON, or SchemaError for what the parser refuses (deep nesting, huge numbers)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SchemaError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise SchemaError("nested too deeply to be a gpudiag file") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise SchemaError(f"not valid JSON ({exc})") from None


def field_path(loc: tuple[str | int, ...]) -> str:
    """`stages[0].iter_ms[3]` from a location tuple."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _out_of_range(data: Any) -> str | None:
    """What is wrong with the first number no run can hold (NaN, infinity, an integer beyond 64
    bits), with its path; None if there is none. Iterative: any depth json.loads allows."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return f"{field_path(path)}: {value} is not a finite number"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_ABS_INT:
            return f"{field_path(path)}: integer of {len(str(abs(value)))} digits is out of range"
        if isinstance(value, dict):
            stack.extend(((*path, str(k)), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))
    return None


def _dataclasses_under(cls: type) -> set[type]:
    """`cls` and every dataclass its fields can hold."""
    seen: set[type] = set()
    todo = [cls]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for hint in typing.get_type_hints(current).values():
            stack = [hint]
            while stack:
                item = stack.pop()
                if dataclasses.is_dataclass(item) and isinstance(item, type):
                    todo.append(item)
                stack.extend(typing.get_args(item))
    return seen


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    # pydantic reads a stdlib dataclass's config from this attribute; set it on each dataclass
    # of the schema so nested ones are as strict as the top.
    for item in _dataclasses_under(cls):
        item.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]
    return TypeAdapter(cls)


def validate_as(cls: type[T], data: Any) -> T:
    """An instance of dataclass `cls` from parsed JSON, or SchemaError naming the first field
    that does not fit. Unknown keys are ignored (files from newer gpudiags stay readable)."""
    wrong = _out_of_range(data)
    if wrong is not None:
        raise SchemaError(wrong)
    try:
        adapter: TypeAdapter[T] = _adapter(typing.cast(type, cls))
        return adapter.validate_json(json.dumps(data))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        value = repr(first.get("input"))
        shown = f" (got {value[:40]}{'...' if len(value) > 40 else ''})" if (
            first["type"] not in ("missing", "dataclass_type")) else ""
        raise SchemaError(f"{field_path(tuple(first['loc']))}: {first['msg'].lower()}{shown}"
                          ) from None
