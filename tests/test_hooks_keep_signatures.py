"""What gpudiag replaces in a profiled script's interpreter looks, to a framework that inspects
it, like what it replaced (issue 56: Lightning rebuilt every DataLoader with batch_size 1 from
`inspect.signature(DataLoader.__init__)` of a bare `(self, *args, **kwargs)` hook).

Every watch (gpudiag/measure/profile/inscript/watches/) and, separately, every remedy
(remedies.py) is installed into this interpreter, and whatever changed is found by comparing
every loaded module's and class's attributes before and after, so a hook that bypasses
watches.patch or remedies._wrap is checked too; then everything is put back. Whether the
frameworks then train the same job is benchmarks/same_job.py's (reports/examples/same-job/)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpudiag.measure.profile.inscript.remedies import APPLIERS, Applied, LossLog
from gpudiag.measure.profile.inscript.watches import discover
from gpudiag.measure.profile.inscript.watches.fsdp import FSDP_PARAM_GROUP_MODULES
from gpudiag.model.remedies import LargerBatchRecord

# Modules a hook patches only if imported: imported first, so their attributes are compared.
PATCHED_IF_IMPORTED = (*FSDP_PARAM_GROUP_MODULES, "safetensors.torch")
GLOBAL_HOOKS = [getattr(owner, name) for owner in (module_hooks, optimizer_hooks)
                for name in vars(owner) if name.startswith("_global_")
                and isinstance(getattr(owner, name), dict)]
_INHERITED = object()  # an attribute the owner did not hold itself before


@dataclass
class Replaced:
    """One attribute a hook replaced: its owner, its name, the owner's own entry before (or
    _INHERITED), and what `getattr(owner, name)` gave before."""

    owner: Any
    name: str
    before: Any
    original: Any

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__qualname__', getattr(self.owner, '__name__', '?'))}" \
               f".{self.name}"


def _owners() -> Iterator[Any]:
    """Every loaded module but gpudiag's and the tests', its type where that is a class of its
    own (torch.backends.cudnn is a CudnnModule), and the classes it defines."""
    for name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or name.startswith(("gpudiag", "test_")):
            continue
        yield module
        if type(module) is not types.ModuleType:
            yield type(module)
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                yield value


def _as_gotten(raw: Any, owner: Any) -> Any:
    """What `getattr` gives of a class's own entry `raw` (a static or class method unwrapped)."""
    return raw.__get__(None, owner) if isinstance(raw, (staticmethod, classmethod)) else raw


def _inherited(owner: type, name: str, before: dict[int, tuple[Any, dict[str, Any]]]) -> Any:
    for base in owner.__mro__[1:]:
        entries = before[id(base)][1] if id(base) in before else vars(base)
        if name in entries:
            return _as_gotten(entries[name], owner)
    return None


def _replaced(before: dict[int, tuple[Any, dict[str, Any]]]) -> list[Replaced]:
    """The callables changed since `before`: an owner's entry replaced, or a class given one
    it inherited before (torch.Tensor.to)."""
    found = []
    for owner, entries in before.values():
        for name, now in list(vars(owner).items()):
            if name in entries and entries[name] is not now and callable(_as_gotten(now, owner)):
                found.append(Replaced(owner, name, entries[name],
                                      _as_gotten(entries[name], owner)))
            elif name not in entries and isinstance(owner, type) and callable(now):
                found.append(Replaced(owner, name, _INHERITED, _inherited(owner, name, before)))
    return found


@contextlib.contextmanager
def _undone() -> Iterator[Callable[[], list[Replaced]]]:
    """Every hook installed in the block taken out after it: attributes, global module and
    optimizer hooks, import hooks, the float32 matmul precision. Yields what finds the
    replacements made so far."""
    for name in PATCHED_IF_IMPORTED:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    with warnings.catch_warnings():  # reading every module's attributes wakes deprecations
        warnings.simplefilter("ignore")
        before = {id(owner): (owner, dict(vars(owner))) for owner in _owners()}
    hooks = [dict(hook) for hook in GLOBAL_HOOKS]
    meta_path, precision = list(sys.meta_path), torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    try:
        yield lambda: _replaced(before)
    finally:
        for replaced in _replaced(before):
            if replaced.before is _INHERITED:
                delattr(replaced.owner, replaced.name)
            else:
                setattr(replaced.owner, replaced.name, replaced.before)
        for hook, kept in zip(GLOBAL_HOOKS, hooks, strict=True):
            hook.clear()
            hook.update(kept)
        sys.meta_path[:] = meta_path
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError) as exc:  # a builtin without a text signature: as it was
        return f"no signature ({type(exc).__name__})"


def _binding(raw: Any) -> str:
    return ("static" if isinstance(raw, staticmethod) else
            "class" if isinstance(raw, classmethod) else "plain")


def _unlike(replaced: Replaced) -> list[str]:
    """How the replacement differs from the original, as a framework would see it."""
    now, original = getattr(replaced.owner, replaced.name), replaced.original
    raw_now = vars(replaced.owner)[replaced.name]
    differences = []
    if replaced.before is not _INHERITED and _binding(raw_now) != _binding(replaced.before):
        differences.append(f"bound as {_binding(raw_now)}, was {_binding(replaced.before)}")
    if _signature(now) != _signature(original):
        differences.append(f"signature {_signature(now)} != {_signature(original)}")
    chain = [now]
    while chain[-1] is not original and hasattr(chain[-1], "__wrapped__") and len(chain) < 20:
        chain.append(chain[-1].__wrapped__)
    if chain[-1] is not original:
        differences.append("__wrapped__ does not lead to the original")
    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(original, attribute) and \
                getattr(now, attribute, None) != getattr(original, attribute):
            differences.append(f"{attribute} {getattr(now, attribute, None)!r}")
    if inspect.isroutine(now) != inspect.isroutine(original):
        differences.append("not a function as the original was")
    return differences


def _classes_kept(replacements: list[Replaced]) -> list[str]:
    """Owners that are classes are still the classes their modules name, with their MRO."""
    lost = []
    for owner in {id(r.owner): r.owner for r in replacements}.values():
        if isinstance(owner, type) and "." not in owner.__qualname__:
            named = getattr(sys.modules[owner.__module__], owner.__qualname__, owner)
            if named is not owner or not all(isinstance(b, type) for b in owner.__mro__):
                lost.append(owner.__qualname__)
    return lost


def _frameworks_see_the_same() -> None:
    """What the frameworks do with the hooked classes: Lightning's DataLoader rebuilt from its
    signature keeps the batch size, a Conv2d called by keyword, an optimizer's class."""
    loader: DataLoader[tuple[torch.Tensor, ...]] = DataLoader(
        TensorDataset(torch.arange(32)), batch_size=8, shuffle=False, drop_last=True)
    parameters = inspect.signature(DataLoader.__init__).parameters
    rebuilt = DataLoader(**{name: getattr(loader, name) for name in parameters  # a new sampler
                            if name not in ("self", "sampler", "batch_sampler")
                            and hasattr(loader, name)})
    assert isinstance(rebuilt, DataLoader) and rebuilt.batch_size == 8
    assert (len(rebuilt), rebuilt.drop_last) == (4, True)  # not iterated: the loader remedy's
    # workers would be processes
    conv = nn.Conv2d(3, 4, 3)
    assert isinstance(conv, nn.Conv2d) and isinstance(conv, nn.Module)
    assert conv(input=torch.randn(1, 3, 6, 6)).shape == (1, 4, 4, 4)
    optimizer = torch.optim.SGD(conv.parameters(), lr=0.1)
    assert isinstance(optimizer, torch.optim.Optimizer) and type(optimizer) is torch.optim.SGD
    assert issubclass(torch.optim.SGD, torch.optim.Optimizer)


class _Clock:
    steps = 0
    host_marks = (0.0,)


def _install_watches() -> None:
    for watch in discover(_Clock()):
        watch.install()


def _apply_remedies() -> None:
    # The larger batch's wrapper installed, for a training loader built elsewhere: the
    # loaders built here keep the batch size _frameworks_see_the_same checks.
    Applied(list(APPLIERS), LargerBatchRecord(training_site="train.py:1"))
    LossLog(1)


@pytest.mark.parametrize(("install", "expected"), [
    (_install_watches, {"DataLoader.__init__", "Conv2d.__init__", "Conv2d.forward",
                        "Optimizer.__init__", "DistributedDataParallel.__init__"}),
    (_apply_remedies, {"DataLoader.__init__", "SGD.__init__", "Tensor.to", "Tensor.backward",
                       "CudnnModule.__setattr__"}),
], ids=["watches", "remedies"])
def test_every_hook_looks_like_what_it_replaced(install: Callable[[], None],
                                                expected: set[str]) -> None:
    with _undone() as replacements_now:
        install()
        replacements = replacements_now()
        assert expected <= {r.label for r in replacements}  # the comparison sees the hooks
        unlike = {r.label: d for r in replacements if (d := _unlike(r))}
        assert not unlike, unlike
        assert not _classes_kept(replacements)
        _frameworks_see_the_same()
    assert not replacements_now()  # and all of it was put back
