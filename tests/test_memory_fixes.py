"""Fixes that trade time for memory (issue 57): activation checkpointing applied to an unmodified
model, judged by the allocator's peak (its time the cost), and tried after a run that died of
out-of-memory."""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import in_folder, invoke, line_of, script_run, script_stage
from torch import nn
from torch.nn.modules import module as module_hooks

from gpudiag.diagnose.tryfix import assess, passing, plan_fixes
from gpudiag.measure.profile.inscript.memoryremedies import _hugging_face, repeated_blocks
from gpudiag.measure.profile.inscript.remedies import Applied
from gpudiag.model.facts import MemoryOwners, MemoryTimeline, OutOfMemory
from gpudiag.model.remedies import (
    BASELINE_RUNS,
    NO_REMEDY,
    ActivationCheckpointRecord,
    RemedyEvidence,
)
from gpudiag.model.results import Finding, MeasuredFix, RunResult
from gpudiag.model.runfile import load_run
from gpudiag.present.fixes import fixes_markdown, memory_cell, recommended


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_repeated_blocks_are_a_containers_composite_children_of_one_class() -> None:
    """A transformer's layers, nn.TransformerEncoder's too, and a Sequential's bottlenecks are
    blocks; a Sequential of Linear and ReLU (each leaf saves its input anyway) is none; one
    block alone is none."""
    where, blocks = repeated_blocks(Stack()) or ("", [])
    assert where == "Stack.layers" and len(blocks) == 4
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 3,
                                    enable_nested_tensor=False)
    where, blocks = repeated_blocks(encoder) or ("", [])
    assert where == "TransformerEncoder.layers" and len(blocks) == 3
    stage = nn.Sequential(nn.Conv2d(3, 8, 3), Block(), Block(), nn.Flatten())
    where, blocks = repeated_blocks(stage) or ("", [])
    assert where == "Sequential" and [type(b) for b in blocks] == [Block, Block]
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) is None
    assert repeated_blocks(Stack(blocks=1)) is None


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """Bytes autograd kept for backward over one forward (each storage once), and the
    gradients of one backward."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return sum(seen.values()), grads


@contextlib.contextmanager
def _global_module_hooks_restored() -> Iterator[None]:
    """The remedy registers global module hooks for the rest of the process (a profiled
    script's): taken out again after the test, so no other test's modules run them."""
    names = ("_global_forward_pre_hooks", "_global_forward_hooks",
             "_global_forward_hooks_always_called")
    saved = {name: dict(getattr(module_hooks, name)) for name in names}
    try:
        yield
    finally:
        for name, hooks in saved.items():
            current = getattr(module_hooks, name)
            current.clear()
            current.update(hooks)


def test_checkpointed_blocks_keep_less_for_backward_and_compute_the_same_gradients() -> None:
    """The remedy on an unmodified model, in this process: the same gradients bit for bit
    (the blocks' forwards recomputed in backward), and a fraction of the activations kept
    (each block's input, not its norm, GELU and projections), recorded with the container
    and the line that called the model."""
    torch.manual_seed(0)
    plain, x = Stack(), torch.randn(256, 8)
    model = Stack()
    model.load_state_dict(plain.state_dict())
    kept_plain, grads_plain = _saved_bytes(plain, x)
    with _global_module_hooks_restored():
        applied = Applied(["activation-checkpointing"])
        kept_fixed, grads_fixed = _saved_bytes(model, x)
    record = applied.observe().activation_checkpointing
    assert record is not None and record.unchanged() is None
    assert (record.blocks, record.block, record.container) == (4, "Block", "Stack.layers")
    assert record.site is not None and record.site.startswith("tests/test_memory_fixes.py:")
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_fixed, strict=True))
    assert kept_fixed < kept_plain / 3, (kept_fixed, kept_plain)
    with torch.no_grad():  # an evaluation's forward runs as it was
        assert torch.equal(model(x), plain(x))


def test_a_hugging_face_model_checkpoints_through_its_own_switch() -> None:
    """transformers' PreTrainedModel: its gradient_checkpointing_enable() (non-reentrant),
    not gpudiag's wrapping; one that checkpoints already is left as it was, said so."""
    calls: list[dict[str, object]] = []
    model = SimpleNamespace(supports_gradient_checkpointing=True, is_gradient_checkpointing=False,
                            gradient_checkpointing_enable=lambda **kw: calls.append(kw))
    record = ActivationCheckpointRecord()
    assert _hugging_face(model, record)  # type: ignore[arg-type]
    assert calls == [{"gradient_checkpointing_kwargs": {"use_reentrant": False}}]
    assert record.framework == "transformers" and record.unchanged() is None
    model.is_gradient_checkpointing = True
    again = ActivationCheckpointRecord()
    assert _hugging_face(model, again) and len(calls) == 1  # type: ignore[arg-type]
    assert again.unchanged() == "the script's SimpleNamespace checkpoints its layers already"
    assert not _hugging_face(nn.Linear(2, 2), ActivationCheckpointRecord())


def _memory_run(*, oom_step: int | None, peak_mib: float) -> RunResult:
    """A profiled CUDA script with its allocator's peak, dead of out-of-memory at `oom_step`
    (None: it ran its steps)."""
    stage = script_stage([] if oom_step is not None else [100.0] * 12, losses=[2.0, 1.9, 1.8],
                         remedies=RemedyEvidence())
    script = stage.facts.script
    assert script is not None
    script.memory = MemoryTimeline(device="cuda", peak_mib=[peak_mib] * 12,
                                   device_total_mib=81_920.0)
    if oom_step is not None:
        stage.status, stage.error = "error", "the script raised torch.OutOfMemoryError"
        script.memory.oom = OutOfMemory(device="cuda", step=oom_step, message="CUDA out of memory.")
    return script_run(stage, device="cuda")


def _fixed(**kwargs: float | int | None) -> RunResult:
    run = _memory_run(**kwargs)  # type: ignore[arg-type]
    script = run.stages[0].facts.script
    assert script is not None
    script.remedies.activation_checkpointing = ActivationCheckpointRecord(
        blocks=12, block="Block", container="Model.blocks", site="train.py:40")
    return run


def _diagnosed(code: str) -> RunResult:
    run = _memory_run(oom_step=0, peak_mib=16_000.0) if code == "GD404" else \
        _memory_run(oom_step=None, peak_mib=22_000.0)
    run.findings = [Finding(id=code, rule="r", severity="critical" if code == "GD404"
                            else "warning", stage="train.py", title=f"{code} seen",
                            fix="knobs", location="train.py:40")]
    return run


def test_a_script_that_died_of_out_of_memory_is_fixed_when_it_runs_its_steps() -> None:
    """GD404 plans activation checkpointing (and GD403's growth keeps its written fix); the
    runs without it die at step 0 too, the run with it ends its steps: measured, its time cost
    unmeasurable and said so, recommended where memory is the limit; never in the combined
    run (its time is a cost)."""
    run = _diagnosed("GD404")
    plan = plan_fixes(run)
    assert [r.name for r in plan.remedies] == ["activation-checkpointing"]
    assert "GD403" in NO_REMEDY
    runs = {label: _memory_run(oom_step=0, peak_mib=16_000.0) for label in BASELINE_RUNS}
    runs["activation-checkpointing"] = _fixed(oom_step=None, peak_mib=9_000.0)
    (fix,) = assess(run, plan, runs)
    assert fix.status == "measured" and fix.before_oom_step == 0 and fix.after_oom_step is None
    assert fix.after_peak_mib == 9_000.0 and fix.speedup is None and fix.after_ms == 100.0
    assert "died of out-of-memory at step 0; with it, it ran its 12 timed steps" in fix.note
    assert fix.location == "train.py:40" and recommended(fix) and passing([fix]) == []
    assert memory_cell(fix) == "out of memory at step 0 -> 8.79 GiB"
    run.fixes = [fix]
    text = "\n".join(fixes_markdown(run))
    assert "peak memory before -> after" in text and "time cost not measured" in text
    assert "where memory is the limit: at `train.py:40`: run each block through" in text
    runs["activation-checkpointing"] = _fixed(oom_step=3, peak_mib=15_000.0)
    (died,) = assess(run, plan, runs)
    assert not recommended(died)


def test_checkpointing_is_not_tried_where_the_loops_models_have_no_blocks() -> None:
    """The diagnosis looked at the loop's models: none has repeated blocks, so no run is spent
    on checkpointing (said); where it found some, or could not look, it is tried; forced,
    always."""
    run = _diagnosed("GD401")
    script = run.stages[0].facts.script
    assert script is not None
    script.owners = MemoryOwners(device="cuda", step=1, parameters=0, gradients=0,
                                 optimizer_state=0, models_looked=1)
    plan = plan_fixes(run)
    assert plan.remedies == [] and plan.skipped == [
        "activation-checkpointing: the 1 model(s) the training loop holds have no repeated "
        "blocks to checkpoint (an nn.ModuleList or nn.Sequential of two or more submodules of "
        "one class)"]
    assert [r.name for r in plan_fixes(run, forced=["activation-checkpointing"]).remedies] == [
        "activation-checkpointing"]
    script.owners.blocks = "12 `Block` blocks in `GPT.h`"
    assert [r.name for r in plan_fixes(run).remedies] == ["activation-checkpointing"]


def test_a_fix_that_frees_memory_is_judged_by_the_peak_with_its_time_as_the_cost() -> None:
    """Near capacity (GD401): 22 -> 11 GiB for 1.3x the step's time is worth making where
    memory is the limit (the table says the cost); a peak that did not fall is not, however
    fast; a CPU run (no allocator peak) cannot tell."""
    run = _diagnosed("GD401")
    plan = plan_fixes(run)
    assert [r.name for r in plan.remedies] == ["activation-checkpointing"]
    baseline = {label: _memory_run(oom_step=None, peak_mib=22_000.0) for label in BASELINE_RUNS}
    slower = _fixed(oom_step=None, peak_mib=11_000.0)
    slower.stages[0].iter_ms = [130.0] * 12
    (fix,) = assess(run, plan, {**baseline, "activation-checkpointing": slower})
    assert fix.speedup == pytest.approx(100 / 130) and recommended(fix)
    assert memory_cell(fix) == "21.48 GiB -> 10.74 GiB (-50%)"
    run.fixes = [fix]
    assert "costs +30% time" in "\n".join(fixes_markdown(run))
    same = _fixed(oom_step=None, peak_mib=21_500.0)
    (no_less,) = assess(run, plan, {**baseline, "activation-checkpointing": same})
    run.fixes = [no_less]
    assert not recommended(no_less)
    assert "it freed no memory at the peak" in "\n".join(fixes_markdown(run))
    cpu = MeasuredFix(remedy="activation-checkpointing", title="t", speedup=0.8,
                      after_ms=10.0, before_ms=8.0)
    assert not recommended(cpu) and memory_cell(cpu) == "-"


# Runs out of memory on a CPU the way a capped GPU does: more than BUDGET bytes kept for
# backward at once fails an allocation through the CPU allocator itself (the same error, the
# same path in gpudiag, as a real one); checkpointing keeps only each block's input.
OUT_OF_MEMORY_SCRIPT = """
    import torch
    from torch import nn

    BUDGET = 300_000
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        if sum(kept.values()) > BUDGET:
            torch.empty(2**50, dtype=torch.uint8)  # the CPU allocator's own failure
        return tensor

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        def forward(self, x):
            return x + self.down(torch.tanh(self.up(x)))

    model = nn.Sequential(*[Block() for _ in range(6)], nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 16)
    for step in range(20):
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
"""


@pytest.mark.slow
def test_try_fixes_after_an_out_of_memory_measures_what_makes_it_fit(tmp_path: Path) -> None:
    """The script dies of the CPU allocator's out-of-memory in its first step: GD404, and
    --try-fixes tries activation checkpointing anyway: the runs without it die too, the run
    with it trains its steps; the fix is named at the line that calls the model, and the
    script's exit code still passes through."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(OUT_OF_MEMORY_SCRIPT))
    with in_folder(tmp_path):
        done = invoke(["profile", "--no-plots", "--try-fixes", "--warmup", "2", "--timed", "4",
                       "--steps", "1", "--out", tmp_path / "run", "--unconfined-reruns", "--",
                       sys.executable, "train.py"])
    assert done.exit_code == 1, done.output
    run = load_run(tmp_path / "run")
    assert any(f.id == "GD404" for f in run.findings)
    (fix,) = [f for f in run.fixes if f.remedy == "activation-checkpointing"]
    assert fix.status == "measured" and fix.before_oom_step == 0, fix.note
    assert fix.after_oom_step is None and fix.after_ms, fix.note
    assert fix.location == f"train.py:{line_of(script, 'loss = model(x)')}"
    record = fix.evidence.activation_checkpointing
    assert record is not None and (record.blocks, record.container) == (6, "Sequential")
    assert recommended(fix)
