"""Which line of the user's code issued each piece of device work.

During the evidence window a TorchFunctionMode wraps every Python-level torch call in a profiler
range named after its call site: the first frame outside torch itself. Kernels, copies and syncs
then fall inside a range on the host timeline (or link to one through the CUDA correlation id),
so they can be charged to a file and line. The profiler's own Python stacks cannot do this: they
name a function's first line, not the line inside it that runs in a loop.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Literal

import torch

# The profiler's record function without record_function's Python: no torch op dispatched to
# open and close it (torch/autograd/profiler.py), a range a third of the cost (the one
# Inductor's generated code uses). Its ranges land in the trace as operators, "cpu_op".
from torch._C._profiler import _RecordFunctionFast
from torch.overrides import TorchFunctionMode

from gpudiag.measure.evidence.annotation import Site, annotation

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
# torch frames that only dispatch the call the user made (not library code calling torch).
_DISPATCH_FILES = ("overrides.py", "functional.py", "_tensor.py")


# Calls whose kernels are matrix products: the annotation records the dtype they compute in.
_MATMUL_FUNCS = {
    torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
    torch.addmm, torch.baddbmm, torch.einsum, torch.nn.functional.conv1d,
    torch.nn.functional.conv2d, torch.nn.functional.conv3d,
    torch.nn.functional.scaled_dot_product_attention,
}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
               torch.float64: "fp64"}


def matmul_dtype(func: Any, args: tuple[Any, ...]) -> str:
    """The dtype a matmul-family call computes in: autocast's when autocast is on for the
    inputs' device, else the first tensor input's. Empty for other calls."""
    if func not in _MATMUL_FUNCS:
        return ""
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        return ""
    device_type = tensor.device.type
    if tensor.is_floating_point() and torch.is_autocast_enabled(device_type):
        return DTYPE_NAMES.get(torch.get_autocast_dtype(device_type), "other")
    return DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))


# gpudiag's own code (this window, the profile recorder, its telemetry and timing, the
# gpudiag.step() a script calls): never a call site, never the user's work. Its models and
# stages are: they are the code `gpudiag run` measures.
_GPUDIAG_DIR = str(Path(__file__).resolve().parents[2]) + os.sep
_GPUDIAG_WORKLOADS = tuple(str(Path(__file__).resolve().parent.parent / d) + os.sep
                           for d in ("models", "stages"))
_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})


@functools.cache
def _is_gpudiag(filename: str) -> bool:
    return filename.startswith(_GPUDIAG_DIR) and not filename.startswith(_GPUDIAG_WORKLOADS)


@functools.cache
def _is_internal(filename: str) -> bool:
    return (filename.startswith(_TORCH_DIR) or _is_gpudiag(filename)
            or filename.startswith("<frozen"))


@functools.cache
def is_library(filename: str) -> bool:
    """Installed packages and the standard library: code the user did not write. An installed
    package is under site-packages, or beside a `*.dist-info` folder (pip install --target,
    vendored environments); an editable install of the user's own project is not (its
    dist-info lives in site-packages, away from the sources)."""
    if filename.startswith(_GPUDIAG_WORKLOADS):
        return False
    parts = Path(filename).parts
    if "site-packages" in parts or "dist-packages" in parts or filename.startswith(_STDLIB):
        return True
    return any(_holds_distributions(str(d)) for d in Path(filename).parents)


@functools.cache
def _holds_distributions(directory: str) -> bool:
    try:
        return any(Path(directory).glob("*.dist-info"))
    except OSError:
        return False


@functools.cache
def display_path(filename: str) -> str:
    """A short, stable name: relative to site-packages for an installed package (wherever the
    environment lives), else to the working directory or the script's."""
    path = Path(filename)
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return str(Path(*parts[parts.index(marker) + 1:]))
    for root in path.parents:
        if _holds_distributions(str(root)):
            return str(path.relative_to(root))
    # The working directory, else the script's own (a script run from elsewhere, `python
    # ../train.py`): a path the user recognises, not the machine's absolute one.
    script = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else None
    for base in (Path.cwd(), script):
        if base is None:
            continue
        try:
            return str(path.resolve().relative_to(base))
        except ValueError:
            continue
    return str(path)


def call_site(frame: FrameType | None) -> Site | None:
    """The innermost frame of the user's own code that led to a torch call, and the library
    frame it went through (if any). Frames in torch and in gpudiag's instrumentation are
    skipped; library and standard-library frames are passed through, remembered as `via`. With
    no user frame at all (a library's own thread), the library frame itself, `direct` False."""
    direct = True
    while frame is not None and (_is_internal(frame.f_code.co_filename)
                                 or code_role(frame.f_code) == "torch"):
        if not frame.f_code.co_filename.endswith(_DISPATCH_FILES):
            direct = False
        frame = frame.f_back
    if frame is None:
        return None
    first = frame
    while frame is not None and code_role(frame.f_code) != "user":
        frame = frame.f_back
    if frame is None:
        code = first.f_code
        return Site(f"{display_path(code.co_filename)}:{first.f_lineno}", code.co_name, False)
    code = frame.f_code
    via = "" if frame is first else \
        f"{display_path(first.f_code.co_filename)}:{first.f_lineno}"
    return Site(f"{display_path(code.co_filename)}:{frame.f_lineno}", code.co_name,
                direct and not via, via=via)


FrameRole = Literal["user", "library", "torch", "gpudiag"]


def _generated_by_torch(filename: str) -> bool:
    """Code torch writes and runs: torch.fx's graph modules (`<eval_with_key>.N`) and
    Inductor's compiled kernels' wrappers (under its cache directory, by default
    <tmp>/torchinductor_<user>, else $TORCHINDUCTOR_CACHE_DIR)."""
    if filename.startswith("<eval_with_key>"):
        return True
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache and filename.startswith(cache):
        return True
    return any(part.startswith("torchinductor_") for part in Path(filename).parts[:-1])


@functools.cache
def frame_role(filename: str) -> FrameRole:
    """Whose code a frame runs: the user's, an installed library's (or the standard library's),
    torch's, or gpudiag's own instrumentation."""
    if filename.startswith(_TORCH_DIR) or _generated_by_torch(filename):
        return "torch"
    if _is_gpudiag(filename):
        return "gpudiag"
    if filename.startswith("<frozen") or is_library(filename):
        return "library"
    return "user"


# Code compiled from a string has the file name "<string>": the user's own (`python -c`, an
# exec of the user's text), or code Python and torch generate and run: Dynamo's guard for each
# compiled frame (torch/_dynamo/guards.py, `build_guard_function`: exec of `def
# ___make_guard_fn(...)`, returning `def guard(L)`), dataclasses' methods (their qualified
# name under `__create_fn__`, Lib/dataclasses.py).
_STRING_CODE = "<string>"
_DYNAMO_GUARDS = frozenset({"guard", "___make_guard_fn"})


def code_role(code: CodeType) -> FrameRole:
    """frame_role() of a code object, which also tells generated code in a "<string>" file
    from the user's: Dynamo's guards are torch's, dataclasses' methods the standard
    library's, the rest the user's."""
    if code.co_filename != _STRING_CODE:
        return frame_role(code.co_filename)
    if code.co_name in _DYNAMO_GUARDS:
        return "torch"
    if getattr(code, "co_qualname", "").startswith("__create_fn__"):  # 3.11+
        return "library"
    return "user"


def _is_users(filename: str) -> bool:
    return frame_role(filename) == "user"


def caller_site(frame: FrameType | None) -> str | None:
    """`path:line` of the user's line that called the function holding the user's innermost
    frame (the evaluation call in the training loop, for a loop inside evaluate()); None
    when that function was called from outside the user's code."""
    while frame is not None and not _is_users(frame.f_code.co_filename):
        frame = frame.f_back
    caller = frame.f_back if frame is not None else None
    while caller is not None and not _is_users(caller.f_code.co_filename):
        caller = caller.f_back
    if caller is None:
        return None
    return f"{display_path(caller.f_code.co_filename)}:{caller.f_lineno}"


class SourceAnnotator(TorchFunctionMode):
    """Names a profiler range after the call site of every torch call made while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        site = call_site(sys._getframe(1))
        self.calls += 1
        if site is None:
            return func(*args, **(kwargs or {}))
        with _RecordFunctionFast(annotation(site.location, site.function, site.direct,
                                            matmul_dtype(func, args), site.via)):
            return func(*args, **(kwargs or {}))
