"""Who holds a profiled script's memory, and what keeps growing tensors (issue 57): the scan of
the training loop's namespaces (gpudiag/measure/profile/inscript/heldtensors.py) on namespaces
and objects made here, the owners' arithmetic and the saved-tensor tally
(inscript/watches/owners.py), and one profile of a script that keeps each step's output, named
by GD403 at its append line, beside its twin that keeps a number."""

from __future__ import annotations

import collections
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import profile_command, script_line, script_run, script_stage, write_script

from gpudiag.measure.profile.inscript.heldtensors import (
    adding_line,
    kept_between,
    look,
    loop_namespaces,
)
from gpudiag.measure.profile.inscript.schedule import Schedule
from gpudiag.measure.profile.inscript.watches import StageDraft
from gpudiag.measure.profile.inscript.watches.owners import OwnersWatch, SavedCounter, settled
from gpudiag.model.facts import (
    KeptTensors,
    LoaderFacts,
    LoaderUse,
    MemoryOwners,
    SavedSite,
    ScriptFacts,
    StageFacts,
    StepTimeline,
)
from gpudiag.present.markdown import render_markdown

MIB = 2**20


class _Trainer:
    def __init__(self) -> None:
        self.preds: list[torch.Tensor] = []
        self.name = "trainer"


def _loop_body(history: list[torch.Tensor], trainer: _Trainer, out: torch.Tensor) -> None:
    """Stands for a training loop's body: the lines adding_line finds."""
    history.append(out.detach())
    trainer.preds.append(out)


def _step(space: dict[str, object], weight: torch.Tensor) -> None:
    """One step of a leaking loop over the namespace `space`."""
    out = torch.ones(256, 1024) * weight  # 1 MiB, with its graph
    _loop_body(space["history"], space["self"], out)  # type: ignore[arg-type]
    space["total"] = space["total"] + out.sum()  # type: ignore[operator]
    space["losses"].append(float(out.detach().sum()))  # type: ignore[attr-defined]
    space["window"].append(out.detach())  # type: ignore[attr-defined]


def test_the_containers_that_grew_between_two_looks_are_named_with_their_bytes() -> None:
    """A list gaining a detached 1 MiB tensor a step, an object's list gaining one with its
    graph, a total keeping its graph; a list of floats, a full deque and the same model
    weights are not growth."""
    weight = torch.ones(1, requires_grad=True)
    space: dict[str, object] = {
        "history": [], "self": _Trainer(), "total": torch.zeros(()), "losses": [],
        "window": collections.deque(maxlen=2), "weights": [weight], "__name__": "__main__"}
    for _ in range(3):
        _step(space, weight)
    before = look({"": space})
    for _ in range(5):
        _step(space, weight)
    kept = {k.name: k for k in kept_between(before, look({"": space}), (3, 8),
                                           _loop_body.__code__, "train.py:9")}
    assert set(kept) == {"history", "self.preds", "total"}
    history = kept["history"]
    assert (history.kind, history.tensors, history.added_per_step) == ("list of tensors", 8, 1.0)
    assert history.bytes_per_step == MIB and history.bytes == 8 * MIB
    assert not history.graph_kept and history.found_by == "append"
    assert history.location == f"tests/test_memory_owners.py:{_line('history.append(')}"
    preds = kept["self.preds"]
    # Added to as `trainer.preds` in the loop: no line of its own names `self.preds`.
    assert preds.graph_kept and preds.found_by == "loop" and preds.location == "train.py:9"
    total = kept["total"]
    assert total.kind == "tensor with its graph" and total.added_per_step >= 2
    assert total.bytes_per_step == 0.0 and total.graph_kept


def _line(text: str) -> int:
    source = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(source, 1) if text in line and "_line(" not in line)


def test_the_line_that_adds_is_found_in_the_loop_then_in_its_file() -> None:
    """`name.append(`, `name[k] =`, `name +=` in the loop's function; a helper elsewhere in the
    file ("name"); nothing: the loop's own line stands."""
    code = _loop_body.__code__
    at, how = adding_line("history", "list of tensors", code)
    assert how == "append" and at is not None and at.endswith(f":{_line('history.append(')}")
    at, how = adding_line("space", "dict of tensors", code)  # `space["total"] =` in _step
    assigned = _line('space["total"] =')
    assert how == "name" and at is not None and at.endswith(f":{assigned}")
    assert adding_line("nowhere", "list of tensors", code) == (None, "loop")
    assert adding_line("history", "list of tensors", None) == (None, "loop")


def test_a_loop_in_a_function_is_read_in_its_locals_and_its_module_globals() -> None:
    locals_ = {"history": [torch.ones(2)]}
    globals_ = {"saved": {"a": torch.ones(4)}}
    frame = types.SimpleNamespace(f_code=_loop_body.__code__, f_locals=locals_, f_globals=globals_)
    spaces = loop_namespaces(frame)  # type: ignore[arg-type]
    found = look(spaces)
    assert set(found) == {"history", "globals:saved"}
    assert found["globals:saved"].kind == "dict of tensors" and found["globals:saved"].bytes == 16
    module = types.SimpleNamespace(f_code=compile("pass", "train.py", "exec"), f_locals=globals_,
                                   f_globals=globals_)
    assert set(look(loop_namespaces(module))) == {"saved"}  # type: ignore[arg-type]


def _owners(peak: int | None) -> MemoryOwners:
    return MemoryOwners(device="cuda" if peak else "cpu", step=13, parameters=100 * MIB,
                        gradients=100 * MIB, optimizer_state=200 * MIB, activations=300 * MIB,
                        peak=peak)


def test_the_temporaries_are_the_peak_less_every_owner() -> None:
    """The device's peak less the parameters, gradients, optimizer state, saved activations,
    the training batch and what the script keeps on the device (a list on the host holds
    none of it); a CPU has no peak, so no temporaries."""
    training = LoaderUse(site=None, settings=LoaderFacts(num_workers=0, pin_memory=False),
                         training=True, batch_bytes=10 * MIB)
    evaluation = LoaderUse(site=None, settings=LoaderFacts(num_workers=0, pin_memory=False),
                           batch_bytes=99 * MIB)
    kept = [KeptTensors(name="history", kind="list of tensors", location="train.py:9",
                        steps=(4, 40), tensors=36, added_per_step=1.0, bytes=40 * MIB,
                        bytes_per_step=MIB, graph_kept=False, device="cuda"),
            KeptTensors(name="on_host", kind="list of tensors", location="train.py:10",
                        steps=(4, 40), tensors=36, added_per_step=1.0, bytes=80 * MIB,
                        bytes_per_step=2 * MIB, graph_kept=False, device="cpu"),
            KeptTensors(name="total", kind="tensor with its graph", location=None,
                        steps=(4, 40), tensors=900, added_per_step=25.0, bytes=4,
                        bytes_per_step=0.0, graph_kept=True)]
    whole = settled(_owners(peak=1000 * MIB), [evaluation, training], kept)
    assert (whole.inputs, whole.kept) == (10 * MIB, 40 * MIB)
    assert whole.temporaries == (1000 - 100 - 100 - 200 - 300 - 10 - 40) * MIB
    assert settled(_owners(peak=500 * MIB), [], []).temporaries == 0  # owners past the peak
    cpu = settled(_owners(peak=None), [], [])
    assert cpu.temporaries is None and cpu.inputs is None and cpu.kept is None


def test_saved_tensors_are_counted_once_each_without_the_parameters() -> None:
    """A linear layer saves its input and weight, the ReLU its output, the next linear that
    same output again: the activations are the input and the output, once each."""
    first, second = torch.nn.Linear(64, 128), torch.nn.Linear(128, 4)
    skip = {(p.device.type, p.untyped_storage().data_ptr())
            for p in [*first.parameters(), *second.parameters()]}
    counter = SavedCounter(skip)
    x = torch.randn(32, 64)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        second(torch.relu(first(x))).sum().backward()
    assert counter.bytes == (32 * 64 + 32 * 128) * 4 and counter.tensors == 2
    (site,) = counter.largest()
    assert site.location == f"tests/test_memory_owners.py:{_line('second(torch.relu(')}"
    assert counter.seconds > 0


class _Clock:
    def __init__(self, schedule: Schedule) -> None:
        self.steps, self.host_marks, self.schedule = 0, [0.0], schedule
        self.loop_code = None


def test_the_watch_counts_one_steps_owners_and_looks_twice_for_growth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The owners watch over a loop run here (its step boundaries where optimizer.step()
    would give them): the window's first step's saved tensors and its parameters, gradients
    and Adam's two moments; the list gaining a step's output between the looks at steps 2
    and 9. (Whatever an earlier test in this worker compiled: Dynamo's counters are the
    process's.)"""
    monkeypatch.setattr("gpudiag.measure.profile.inscript.watches.owners.compiled", lambda: False)
    clock = _Clock(Schedule(warmup=3, timed=4, evidence_steps=1))
    watch = OwnersWatch(clock)
    model = torch.nn.Linear(16, 256)
    opt = torch.optim.Adam(model.parameters())
    outputs: list[torch.Tensor] = []
    for _ in range(12):
        x = torch.randn(32, 16)
        out = model(x)
        out.square().mean().backward()
        opt.step()
        watch._stepped(opt)
        clock.steps += 1
        watch.step_ended()
        opt.zero_grad()
        outputs.append(out.detach())
    timeline = StepTimeline(step_ms=[1.0] * 12)
    script = ScriptFacts(steps=12, warmup=3, timed=4, step_clock="optimizer.step()")
    watch.fill(StageDraft(facts=StageFacts(script=script), script=script, timeline=timeline,
                          timed=range(3, 7)))
    owners = script.owners
    assert owners is not None and owners.step == 7 and owners.device == "cpu"
    weights = (16 * 256 + 256) * 4
    assert (owners.parameters, owners.gradients) == (weights, weights)
    assert owners.optimizer_state == 2 * weights + 2 * 4  # exp_avg, exp_avg_sq, 2 step counts
    assert owners.activations == (32 * 16 + 32 * 256) * 4 and owners.temporaries is None
    squared, linear = owners.activation_sites  # square() saved `out`, the layer its input
    assert squared.location.endswith(f":{_line('out.square().mean().backward()')}")
    assert linear.location.endswith(f":{_line('out = model(x)')}") and linear.bytes == 32 * 16 * 4
    (kept,) = script.kept
    assert (kept.name, kept.steps, kept.added_per_step) == ("outputs", (2, 9), 1.0)
    assert kept.bytes_per_step == 32 * 256 * 4 and kept.found_by == "append"
    assert kept.location == f"tests/test_memory_owners.py:{_line('outputs.append(')}"
    assert owners.kept == kept.bytes
    assert owners.models_looked == 1 and owners.blocks is None  # a Linear: no blocks


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def test_the_loops_models_are_looked_at_for_the_blocks_checkpointing_would_wrap() -> None:
    """What GD401/GD404's knob names, and what --try-fixes skips without: the repeated blocks
    of the models the loop holds."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _Block(), _Block(), _Block())
    head = torch.nn.Linear(8, 1)
    owners = MemoryOwners(device="cpu", step=1, parameters=0, gradients=0, optimizer_state=0)
    OwnersWatch(_Clock(Schedule(warmup=3, timed=4, evidence_steps=1)))._blocks(owners)
    assert owners.models_looked == 2 and owners.blocks == "3 `_Block` blocks in `Sequential`"
    assert model is not None and head is not None  # the loop's namespace holds them


@pytest.mark.parametrize(("where", "steps"), [("forward", (2, 8)), ("after its step", (2, 7))])
def test_a_script_dying_of_out_of_memory_before_the_second_look_is_looked_at_in_its_failure(
        where: str, steps: tuple[int, int]) -> None:
    """The first look at step 2, the out-of-memory long before the window's end (the second
    look's step): the failure's traceback holds the loop's frame, looked at there, so GD404
    can name what the script keeps (issue 57: kept_logits capped died at step 22, its window
    at 35, and GD404 could only say "memory grew"). One tensor a step either way: a failure in
    the next step's forward (before its boundary) is counted as at that boundary, one after the
    step's boundary as at it."""
    clock = _Clock(Schedule(warmup=3, timed=30, evidence_steps=1))
    watch = OwnersWatch(clock)
    model = torch.nn.Linear(16, 256)
    opt = torch.optim.Adam(model.parameters())
    logits: list[torch.Tensor] = []
    try:
        for step in range(12):
            if where == "forward" and step == 7:  # this step's forward does not fit
                torch.empty(2**50, dtype=torch.uint8)  # the CPU allocator's own failure
            out = model(torch.randn(32, 16))
            out.square().mean().backward()
            opt.step()
            clock.steps += 1
            watch.step_ended()
            opt.zero_grad()
            if where == "after its step" and step == 6:
                torch.empty(2**50, dtype=torch.uint8)
            logits.append(out.detach())
    except RuntimeError as error:
        watch.crashed(error)
    script = ScriptFacts(steps=7, warmup=3, timed=30, step_clock="optimizer.step()")
    watch.fill(StageDraft(facts=StageFacts(script=script), script=script,
                          timeline=StepTimeline(step_ms=[1.0] * 7), timed=range(3, 7)))
    (kept,) = script.kept
    assert (kept.name, kept.steps, kept.added_per_step) == ("logits", steps, 1.0)
    assert kept.location == f"tests/test_memory_owners.py:{_line('logits.append(')}"
    other = OwnersWatch(_Clock(Schedule(warmup=3, timed=30, evidence_steps=1)))
    other.crashed(ValueError("not memory"))  # nothing looked at: no first look, no failure
    assert other.kept == []


def test_the_report_shows_the_owners_by_role_and_what_grows() -> None:
    owners = settled(_owners(peak=1000 * MIB), [], [])
    owners.activation_sites = [SavedSite("train.py:12", 300 * MIB, 24)]
    kept = KeptTensors(name="history", kind="list of tensors", location="train.py:20",
                       steps=(4, 40), tensors=36, added_per_step=1.0, bytes=36 * MIB,
                       bytes_per_step=MIB, graph_kept=True, device="cuda")
    report = render_markdown(script_run(script_stage([10.0] * 30, owners=owners, kept=[kept])))
    section = report[report.index("### Memory owners: train.py"):]
    assert "| activations saved for backward | 300.0 | 30% |" in section
    assert "| temporaries (the peak less the others) | 300.0 | 30% |" in section
    assert "`train.py:12` 300.0 MiB (24 tensors)" in section
    assert ("`history` (a list of tensors at `train.py:20`, on the cuda): +1 tensor, 1.0 MiB "
            "a step, with their autograd graphs") in section
    assert "### Memory owners" not in render_markdown(script_run(script_stage([10.0] * 30)))


LEAK = """
    import torch
    from torch import nn

    torch.set_num_threads(1)  # two of these at once on a 2-core machine
    model = nn.Linear(32, 1024)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader(torch.randn(1024 * 40, 32), batch_size=1024)
    history = []
    for x in data:
        out = model(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        history.append({kept})
"""


@pytest.mark.slow
def test_a_script_keeping_each_steps_output_is_named_at_its_append(tmp_path: Path) -> None:
    """4 MiB kept a step for 40 steps (a CPU's resident set grows): GD403 at the append line,
    naming the list and its bytes a step within 25%, with the step's owners; its twin keeping
    a number gets none. Both in one job (a stage per process), at once: one profile's cost."""
    leak = write_script(tmp_path / "leak.py", LEAK.format(kept="out.detach()"))
    write_script(tmp_path / "twin.py", LEAK.format(kept="out.sum().item()"))
    run = profile_command(
        tmp_path, ["sh", "-c", f"{sys.executable} leak.py & {sys.executable} twin.py; wait"],
        "--warmup", "3", "--timed", "6", "--evidence-steps", "1", "--telemetry", "off").ok()
    stages = {stage.name: stage for stage in run.stages}
    (finding,) = [f for f in run.findings if f.id == "GD403"]
    append = script_line(leak, "history.append(out.detach())")
    assert finding.stage == "leak.py" and finding.location == append
    assert f"`history` (a list at {append}) gains 1 tensor" in finding.title
    assert finding.evidence["kept"]["mib_per_step"] == pytest.approx(4.0, rel=0.25)
    script = stages["leak.py"].facts.script
    assert script is not None and script.owners is not None
    owners = script.owners
    assert owners.parameters == (32 * 1024 + 1024) * 4 == owners.gradients
    assert owners.inputs == 1024 * 32 * 4 and owners.activations
    assert owners.kept == script.kept[0].bytes and owners.temporaries is None
    twin = stages["twin.py"].facts.script
    assert twin is not None and not twin.kept and twin.owners is not None
