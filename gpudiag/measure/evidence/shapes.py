"""What an operator computes and moves, from the input shapes and types the profiler records
with `record_shapes=True` (its trace's `Input Dims` and `Input type` arguments): the dtype it
computes in, the bytes it reads and writes, and a matmul's FLOPs. Pure: tested on recorded
events without a GPU.

Bytes are a floor, not a measurement: each input read once and an output written the size of
its largest input (a matmul's output is its exact M x N); an in-place operator (`add_`) reads
and writes its first input, a copy writes its destination. A kernel that re-reads its input
(a softmax's two passes) moves more.
"""

from __future__ import annotations

import math
from typing import Any

# The profiler's names for floating types (c10's scalar type names), widest first.
_FLOAT_TYPES = {"double": ("fp64", 8), "float": ("fp32", 4), "c10::Half": ("fp16", 2),
                "c10::BFloat16": ("bf16", 2)}
_WIDTH = {"fp64": 3, "fp32": 2, "fp16": 1, "bf16": 1}
_OTHER_SIZES = {"long int": 8, "int": 4, "short int": 2, "signed char": 1,
                "unsigned char": 1, "bool": 1, "c10::complex<float>": 8,
                "c10::complex<double>": 16, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
# Casts sit at the edge of a precision region (autocast's own weight casts among them): not
# an fp32 island however wide their source.
CASTS = frozenset({"aten::copy_", "aten::_to_copy", "aten::to"})


def _inputs(op: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """(type, dims) of each tensor input with at least one dimension."""
    args = op.get("args") or {}
    types, dims = args.get("Input type") or [], args.get("Input Dims") or []
    return [(t, d) for t, d in zip(types, dims, strict=False)
            if isinstance(d, list) and d and all(isinstance(n, int) for n in d)]


def _itemsize(type_name: str) -> int:
    floating = _FLOAT_TYPES.get(type_name)
    return floating[1] if floating else _OTHER_SIZES.get(type_name, 4)


def compute_dtype(op: dict[str, Any]) -> str:
    """The floating dtype an operator computes in: its widest floating tensor input (type
    promotion: a bf16 activation times an fp32 parameter runs in fp32). "" when unrecorded or
    not floating."""
    widest = ""
    for type_name, _ in _inputs(op):
        floating = _FLOAT_TYPES.get(type_name)
        if floating and (not widest or _WIDTH[floating[0]] > _WIDTH[widest]):
            widest = floating[0]
    return widest


def _matmul_dims(name: str, dims: list[list[int]]) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matmul operator's product, from its inputs' dims."""
    if name == "aten::mm" and len(dims) >= 2 and len(dims[0]) == 2 and len(dims[1]) == 2:
        (m, k), (_, n) = dims[0], dims[1]
        return 1, m, k, n
    if name in ("aten::addmm", "aten::_addmm_activation") and len(dims) >= 3 \
            and len(dims[1]) == 2 and len(dims[2]) == 2:
        (m, k), (_, n) = dims[1], dims[2]
        return 1, m, k, n
    if name == "aten::bmm" and len(dims) >= 2 and len(dims[0]) == 3 and len(dims[1]) == 3:
        (b, m, k), (_, _, n) = dims[0], dims[1]
        return b, m, k, n
    if name == "aten::baddbmm" and len(dims) >= 3 and len(dims[1]) == 3 and len(dims[2]) == 3:
        (b, m, k), (_, _, n) = dims[1], dims[2]
        return b, m, k, n
    return None


def flops(op: dict[str, Any]) -> float:
    """A matmul operator's FLOPs (2 x batch x M x K x N); the profiler's own count where it
    recorded one (`with_flops`); else 0."""
    recorded = (op.get("args") or {}).get("flops")
    if isinstance(recorded, (int, float)):
        return float(recorded)
    product = _matmul_dims(op["name"], (op.get("args") or {}).get("Input Dims") or [])
    if product is None:
        return 0.0
    b, m, k, n = product
    return 2.0 * b * m * k * n


def bytes_moved(op: dict[str, Any]) -> float:
    """The bytes an operator reads and writes at least (the module's docstring)."""
    inputs = _inputs(op)
    if not inputs:
        return 0.0
    sizes = [math.prod(d) * _itemsize(t) for t, d in inputs]
    read = float(sum(sizes))
    product = _matmul_dims(op["name"], (op.get("args") or {}).get("Input Dims") or [])
    if product is not None:
        b, m, _, n = product
        return read + b * m * n * _itemsize(inputs[-1][0])
    if op["name"] == "aten::copy_":  # its destination written, its source read
        return read
    if op["name"].endswith("_"):  # in place: the output is the first input, written
        return read + sizes[0]
    return read + max(sizes)


def upcast(op: dict[str, Any]) -> bool:
    """Whether a copy (`aten::copy_(dst, src)`) converts fp16/bf16 into fp32."""
    types = (op.get("args") or {}).get("Input type") or []
    return len(types) >= 2 and types[0] == "float" and types[1] in ("c10::Half", "c10::BFloat16")
