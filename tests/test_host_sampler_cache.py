"""What keeps a host sample cheap (gpudiag/measure/profile/inscript/hostsampler.py) changes
nothing it says: the memo of classified stacks (Classifier) says what classify() says on every
stack of a small training loop, and steps filed in batches add up as filed one at a time."""

from __future__ import annotations

import random
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gpudiag.measure.profile.inscript import hostsampler
from gpudiag.measure.profile.inscript.hostsampler import (
    Classifier,
    HostSampler,
    Key,
    Sample,
    classify,
)
from gpudiag.model.facts import HostSamples


@contextmanager
def _every_call(seen: Callable[[FrameType], None]) -> Iterator[None]:
    """`seen` at every call and return, Python's and C functions' (a C call's frame is at its
    call instruction: `loss.item()`, `torch.cat(...)`, `np.stack(...)`)."""
    def profile(frame: FrameType, _event: str, _arg: Any) -> None:
        seen(frame)

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


class _Compare:
    """Each stack through a Classifier and through classify(), side by side."""

    def __init__(self, loop_code: CodeType | None, cuda: bool) -> None:
        self.loop_code, self.cuda = loop_code, cuda
        self.classifier = Classifier(loop_code, cuda)
        self.samples: list[Sample] = []
        self.mismatches: list[tuple[Sample, Sample]] = []

    def __call__(self, frame: FrameType) -> None:
        cached = self.classifier(frame)
        plain = classify(frame, self.loop_code, self.cuda)
        self.samples.append(plain)
        if cached != plain:
            self.mismatches.append((cached, plain))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def _training_loop(steps: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    total = 0.0
    for _ in range(steps):
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total += sum(i * i for i in range(20))  # Python work
        batch = np.stack([np.ones(3), np.zeros(3)])  # numpy
        both = torch.cat([out, out])  # a torch call by name
        total += loss.item() + float(batch.sum()) + both.sum().item()  # read-backs
    return total


@pytest.mark.parametrize("cuda", [True, False])
def test_a_remembered_stack_is_classified_as_classify_would(cuda: bool) -> None:
    _training_loop(1)  # warm: lazily imported torch code runs once
    compare = _Compare(_training_loop.__code__, cuda)
    with _every_call(compare):
        _training_loop(4)
    assert not compare.mismatches, compare.mismatches[:5]
    kinds = {s.key.kind for s in compare.samples}
    assert {"torch", "python", "call", "sync" if cuda else "torch"} <= kinds
    assert any(s.loop_line for s in compare.samples)
    if sys.gettrace() is None:  # (a tracer, coverage's, makes every stack unremembered)
        assert len(compare.classifier.known) < len(compare.samples) / 2  # stacks repeat


def test_without_a_training_loop_the_whole_stack_is_the_key() -> None:
    compare = _Compare(None, True)
    with _every_call(compare):
        _training_loop(2)
    assert not compare.mismatches, compare.mismatches[:5]
    assert all(s.loop_line is None for s in compare.samples)


def test_a_global_rebound_to_other_code_changes_the_kind_at_the_same_instruction(
        tmp_path: Path) -> None:
    source = tmp_path / "user_step.py"  # (read for the call's callee: `helper`)
    source.write_text("def step(x):\n    return helper(x)\n")
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    step = namespace["step"]
    compare = _Compare(step.__code__, True)
    x = torch.tensor([-1.0, 2.0])
    with _every_call(compare):
        for helper in (torch.abs, abs, torch.abs):
            namespace["helper"] = helper
            step(x)
    assert not compare.mismatches, compare.mismatches
    at_call = [s.key.kind for s in compare.samples
               if s.key.location.endswith("user_step.py:2") and s.key.kind != "call"]
    assert "torch" in at_call and "python" in at_call
    if sys.gettrace() is None:
        assert len(compare.classifier.known) < len(compare.samples)


def test_remembered_stacks_hold_their_code_and_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostsampler, "MAX_CLASSIFIED", 8)
    classifier = Classifier(None, False)
    codes = []
    for n in range(20):  # 20 functions, each a stack of its own
        namespace: dict[str, Any] = {"sys": sys}
        exec(compile(f"def f{n}():\n    return sys._getframe()\n", f"user_{n}.py", "exec"),
             namespace)
        frame = namespace[f"f{n}"]()
        sample = classifier(frame)
        assert sample == classify(frame, None, False)
        assert sample.key.location.endswith(f"user_{n}.py:2")
        codes.append(weakref.ref(frame.f_code))
        del frame, namespace
        assert len(classifier.known) <= 8
    if sys.gettrace() is None:
        # The code of a stack still remembered lives on (its id cannot name another code).
        assert codes[-1]() is not None


def _sampled_run(rng: random.Random, steps: int) -> HostSamples:
    """A sampler fed made-up steps (2 ms, some of 20: slow) and samples (0 to 3 a step, at
    random lines and kinds), its profiler window and warm-up skipped."""
    marks = [0.0]
    sampler = HostSampler(marks, thread_id=0, loop_code=None, cuda=True, warmup=5,
                          skip=range(40, 46), max_steps=steps - 30)
    queue: list[Sample] = []
    sampler.classifier = lambda _frame: queue.pop()  # type: ignore[assignment,misc]
    frame = sys._getframe()
    lines = [f"train.py:{n}" for n in range(12)]
    for _ in range(steps):
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            queue.append(Sample(Key(rng.choice(lines), "<module>", "",
                                    rng.choice(["python", "torch", "call", "sync"])),
                                rng.choice([*lines, None])))
            sampler.take(rng.uniform(0.5, 5.0), frame)
        marks.append(marks[-1] + rng.choice([2.0, 2.0, 2.1, 20.0]) * 1e-3)
    return sampler.stop()


def test_steps_filed_in_batches_add_up_as_filed_one_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for seed in range(5):
        batched = _sampled_run(random.Random(seed), 700)
        monkeypatch.setattr(hostsampler, "FILE_EVERY", 0)
        one_by_one = _sampled_run(random.Random(seed), 700)
        monkeypatch.undo()
        assert batched == one_by_one
        assert batched.slow_steps and batched.steady_steps > 400 and batched.lines


def test_a_sample_with_no_line_of_the_script_below_a_frameworks_loop_is_the_librarys() -> None:
    """A framework's loop (library code, the training loop's) with no user frame below it:
    the sample is charged to the library's line and says so (GD105 then names no line of the
    script to edit); the same stack in a script's own loop is the user's."""
    from gpudiag.measure.profile.inscript.hostsampler import classify

    def innermost(path: str) -> FrameType:
        namespace: dict[str, object] = {"sys": sys}
        exec(compile("def loop():\n    return sys._getframe()\n", path, "exec"), namespace)
        return namespace["loop"]()  # type: ignore[operator,no-any-return]

    framework = innermost("/usr/lib/python3/site-packages/lightning/loops/fit_loop.py")
    sample = classify(framework, framework.f_code, cuda=False)
    assert sample.key.library and sample.key.location.startswith("lightning/loops/")
    script = innermost(str(Path.cwd() / "train.py"))
    assert not classify(script, script.f_code, cuda=False).key.library
