"""The in-script watches (gpudiag/measure/profile/inscript/watches/): every module of the package
is one, found without a list, each reading the recorder as its StepClock; and a watch's facts,
filled into the stage the recorder writes, from what it saw (here the loaders' watch, fed by
hand: which loader feeds training, and its wait on the timed steps)."""

from __future__ import annotations

import json
import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import profile_script, write_script
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from gpudiag.measure.profile.inscript import watches
from gpudiag.measure.profile.inscript.recorder import Recorder
from gpudiag.measure.profile.inscript.watches import StageDraft
from gpudiag.measure.profile.inscript.watches.convlayout import ConvLayoutWatch, memory_format
from gpudiag.measure.profile.inscript.watches.loaders import LoadersWatch, LoaderUses
from gpudiag.model.config import ProfileConfig
from gpudiag.model.facts import ScriptFacts, StageFacts, StepTimeline


def test_every_module_of_the_package_is_a_watch_the_recorder_holds(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, ProfileConfig(telemetry="off", host_sample_hz=0))
    modules = sorted(m.name for m in pkgutil.iter_modules(watches.__path__))
    assert [type(w).__module__.rpartition(".")[2] for w in recorder.watches] == modules
    assert {"compiled", "convlayout", "ddp", "fsdp", "loaders", "optimizers",
            "saves"} <= set(modules)
    assert all(w.clock is recorder for w in recorder.watches)


class _Clock:
    def __init__(self) -> None:
        self.steps = 0
        self.host_marks = [0.0]


def test_a_save_keeps_the_lines_that_called_it_one_checkpoint_all_of_its_files() -> None:
    """Which training-loop line ran a save (gpudiag/diagnose/timeline.py decides by it whether
    a saving step's extra is the save's): the callers' file:line, innermost first; a
    checkpoint's files (HF Trainer's four torch.save calls) keep the union, in order."""
    from gpudiag.measure.profile.inscript.watches.saves import SavesWatch, _callers

    def training_loop() -> list[str]:
        return _callers(sys._getframe())

    stack = training_loop()
    here = f"tests/test_watches.py:{training_loop.__code__.co_firstlineno + 1}"
    assert stack[0].endswith(here.rpartition("/")[2]) and len(stack) <= 40
    clock = _Clock()
    watch = SavesWatch(clock)
    clock.steps = 3
    watch.saved(5.0, None, ["a.py:1", "train.py:9"])
    watch.saved(7.0, None, ["b.py:2", "train.py:9"])
    timeline = StepTimeline(step_ms=[10.0] * 10)
    script = ScriptFacts(steps=10, warmup=2, timed=4, step_clock="optimizer.step()",
                         timeline=timeline)
    draft = StageDraft(StageFacts(script=script), script, timeline, timed=range(2, 6))
    watch.fill(draft)
    assert [s.stack for s in timeline.saves] == [["a.py:1", "train.py:9"],
                                                 ["b.py:2", "train.py:9"]]
    assert draft.facts.checkpoint is not None
    (checkpoint,) = draft.facts.checkpoint.saves
    assert checkpoint.stack == ["a.py:1", "train.py:9", "b.py:2"]
    assert checkpoint.blocking_ms == 12.0 and checkpoint.files == 2


def test_the_loaders_watch_tells_trainings_loader_from_an_evaluations() -> None:
    """The training iterator serves every step; an evaluation's serves all its batches on one:
    its waits are its loop's, not the next step's input."""
    clock = _Clock()
    watch = LoadersWatch(clock)
    train, evaluation = object(), object()
    for step in range(10):
        clock.steps = step
        watch.waited(2.0, torch.zeros(8, 3), train)
        if step == 5:
            for _ in range(4):
                watch.waited(1.0, None, evaluation)
    timeline = StepTimeline(step_ms=[10.0] * 10)
    script = ScriptFacts(steps=10, warmup=2, timed=4, step_clock="optimizer.step()",
                         timeline=timeline)
    draft = StageDraft(StageFacts(script=script), script, timeline, timed=range(2, 6))
    watch.fill(draft)
    assert timeline.data_wait_ms == [2.0] * 10
    assert draft.phases_ms == {"data_wait": [2.0] * 4}
    assert draft.samples_per_step == 8
    (loop,) = timeline.loops
    assert (loop.batches, loop.steps) == (4, [5])


def test_the_loaders_watch_notes_a_loader_of_an_iterable_dataset() -> None:
    """An IterableDataset's loader decides its own passes: --try-fixes' larger batch is not
    planned on it (gpudiag/diagnose/tryfix.py), so its use says what it reads."""
    class Stream(IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.zeros(8, 1))

    uses = LoaderUses()
    stream, mapped = DataLoader(Stream(), batch_size=4), DataLoader(
        TensorDataset(torch.zeros(8, 1)), batch_size=4)
    uses.iterated(stream, 1, 0, 0.0, None)
    uses.iterated(mapped, 2, 0, 0.0, None)
    assert [(u.iterable, u.batch_size) for u in uses.facts(set())] == [(True, 4), (False, 4)]


SIGNATURES_SEEN = """
import inspect, json, sys
import torch
import torch.distributed.fsdp  # FSDP2's parameter groups are patched once imported
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

seen = {}
for label, function in [
        ("DataLoader.__init__", DataLoader.__init__), ("DataLoader.__iter__", DataLoader.__iter__),
        ("_BaseDataLoaderIter.__next__", _BaseDataLoaderIter.__next__),
        ("Optimizer.__init__", torch.optim.Optimizer.__init__),
        ("DistributedDataParallel.__init__", DistributedDataParallel.__init__),
        ("autograd.backward", torch.autograd.backward), ("torch.save", torch.save),
        ("FSDPParamGroup.__init__", FSDPParamGroup.__init__)]:
    original = getattr(function, "__wrapped__", None)
    seen[label] = None if original is None else {
        "signature": str(inspect.signature(function)) == str(inspect.signature(original))
                     and "*args" not in str(inspect.signature(function))[:7],
        "name": (function.__name__, function.__qualname__, function.__doc__)
                == (original.__name__, original.__qualname__, original.__doc__)}
json.dump(seen, sys.stdout)
"""


@pytest.mark.slow
def test_every_function_a_watch_wraps_keeps_its_signature_name_and_docstring(
        tmp_path: Path) -> None:
    """What a framework sees of a patched function is the original's (issue 56: Lightning read
    `inspect.signature(DataLoader.__init__)` as `(self, *args, **kwargs)`, and rebuilt each
    DataLoader of a DDP job with batch_size 1): checked in a profiled script, where the
    bootstrap installed every watch."""
    script = write_script(tmp_path / "signatures.py", SIGNATURES_SEEN)
    profiled = profile_script(tmp_path, script, "--no-rerun")
    seen = json.loads(profiled.output.strip().splitlines()[-1])
    assert all(seen.values()), {label: "not patched" for label, v in seen.items() if not v}
    assert all(v["signature"] and v["name"] for v in seen.values()), seen


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_the_conv_layout_watch_names_the_format_where_the_model_is_built_and_called() -> None:
    """The first Conv2d built and called: its input's format, the line that built the
    outermost module (not the Conv2d's own line inside it) and the line that called it; then
    Conv2d's own __init__ and forward are back, so later convolutions cost nothing."""
    init, forward = nn.Conv2d.__init__, nn.Conv2d.forward
    watch = ConvLayoutWatch(_Clock())
    watch.install()
    model = nn.Sequential(_Block(), nn.ReLU())
    built = sys._getframe().f_lineno - 1
    model(torch.randn(2, 3, 8, 8))
    called = sys._getframe().f_lineno - 1
    assert nn.Conv2d.__init__ is init and nn.Conv2d.forward is forward
    script = ScriptFacts(steps=1, warmup=0, timed=0, step_clock="optimizer.step()")
    watch.fill(StageDraft(StageFacts(script=script), script, StepTimeline(), timed=range(0)))
    layout = script.conv_layout
    assert layout is not None
    assert (layout.memory_format, layout.device, layout.dtype) == \
        ("channels_first", "cpu", "torch.float32")
    assert layout.built_at is not None and layout.built_at.endswith(f"test_watches.py:{built}")
    assert layout.called_at is not None and layout.called_at.endswith(f":{called}")


def test_a_convolution_runs_channels_last_where_its_input_or_its_weight_is() -> None:
    """As torch's cudnn_conv_suggest_memory_format decides: either in channels_last is enough."""
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    last = torch.channels_last
    assert memory_format(x, w) == "channels_first"
    assert memory_format(x.to(memory_format=last), w) == "channels_last"
    assert memory_format(x, w.to(memory_format=last)) == "channels_last"
    assert memory_format(x.transpose(2, 3), w) == "other"
    assert memory_format(torch.randn(2, 3, 8), torch.randn(4, 3, 3)) == "other"


def test_a_new_iterator_never_takes_a_dead_ones_key() -> None:
    """A loader without persistent workers makes an iterator per pass, and CPython often gives
    it the address of the last, dead one: keyed by id(), loader_restarts.py's training
    loader was sometimes read as another loop. Each iterator has a number of its own."""
    class _Iterator:
        pass

    watch = LoadersWatch(_Clock())
    keys, addresses = [], []
    for _ in range(50):
        iterator = _Iterator()
        keys.append(watch.key(iterator))
        assert watch.key(iterator) == keys[-1]  # the same for as long as it lives
        addresses.append(id(iterator))
        del iterator
    assert len(set(keys)) == len(keys)
    assert len(set(addresses)) < len(addresses)  # addresses were reused: the case is met
