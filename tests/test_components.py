"""Framework components as evidence: the optimizer's implementation read from the live object
in a profiled script, named with its knob at the line that builds it, and the fused-optimizer
remedy's change to a constructor's arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import profile_script, script_line, write_script

from gpudiag.measure.profile.inscript.remedies import _faster
from gpudiag.measure.profile.inscript.watches.optimizers import implementation
from gpudiag.model.remedies import OptimizerSeen

# Two framework settings that cost most of a CPU step, each at its own line: AdamW's
# single-tensor step over 120 small tensors (~10 operators per tensor per step; over 300,
# fused=True measured 2.2x here), and a DataLoader whose 2 workers start and stop with every 4-batch
# epoch (~90 ms each time; persistent_workers=True measured 4.5x on the loop).
KNOBS_SCRIPT = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(60)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    data = TensorDataset(torch.randn(128, 8), torch.randn(128, 8))
    loader = DataLoader(data, batch_size=16, shuffle=True, num_workers=2)
    for epoch in range(6):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
"""


@pytest.mark.slow
def test_each_framework_knob_is_named_at_the_line_that_sets_it(tmp_path: Path) -> None:
    script = write_script(tmp_path / "train.py", KNOBS_SCRIPT)
    run = profile_script(tmp_path, script, "--warmup", "3", "--timed", "12").ok()
    (stage,) = run.stages
    assert stage.facts.script is not None
    found = {f.id: f for f in run.findings}

    # The optimizer, as built and as stepped.
    (seen,) = stage.facts.script.optimizers
    built = script_line(script, "opt = torch.optim.AdamW(")
    assert (seen.name, seen.implementation, seen.chosen) == ("AdamW", "single-tensor",
                                                             "foreach=False")
    assert seen.parameters == 120 and seen.fused_supported and seen.site == built
    assert seen.step_site == script_line(script, "opt.step()") and seen.steps == 48
    assert stage.evidence is not None and stage.evidence.optimizer_ops_per_step >= 120 * 5
    # Its 120 step counters (.item() every step) and the DataLoader's seeds (.item() at each
    # pass) are CPU tensors: no device sync.
    assert stage.evidence.syncs_per_step == 0 and "GD103" not in found
    optimizer = found["GD106"]
    assert optimizer.location == built and optimizer.severity != "info"
    assert f"AdamW(..., fused=True) at {built}" in optimizer.fix
    assert "foreach=False" in optimizer.fix
    # Priced as the step's host share in optimizer.step(), as sampled or profiled (~40% here;
    # a loaded machine's other work dilutes it).
    assert optimizer.account is not None and 0.15 < optimizer.account.share <= 1.0

    # The DataLoader, as built, passed over 6 times, each pass starting its workers anew.
    (use,) = stage.facts.script.loaders
    made = script_line(script, "loader = DataLoader(")
    assert use.training and use.site == made and use.passes == 6
    assert use.iterated_at == script_line(script, "for x, y in loader:")
    assert (use.settings.num_workers, use.settings.persistent_workers) == (2, False)
    assert [e.batches for e in use.epochs] == [8] * 6
    assert all(e.start_ms > 0 and e.end_ms > 0 for e in use.epochs[1:])
    restarts = found["GD204"]
    assert restarts.location == made and restarts.severity != "info"
    assert f"DataLoader(..., persistent_workers=True) at {made}" in restarts.fix
    assert restarts.account is not None and restarts.account.whole == "loop"
    # The restarts are the loader's: not "periodic work" at its for line, and the data
    # wait points to them.
    assert not [f for f in run.findings if f.id == "GD703" and f.location == use.iterated_at]
    if "GD201" in found:
        assert "persistent_workers=True" in found["GD201"].fix
        assert found["GD201"].impact < restarts.impact


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(4)) for _ in range(n)]


@pytest.mark.parametrize(("cls", "given", "after", "kept"), [
    (torch.optim.AdamW, {"foreach": False}, "fused=True", None),
    (torch.optim.SGD, {}, "fused=True", None),
    (torch.optim.AdamW, {"fused": True}, None, "built fused already"),
    # No fused RMSprop, and no foreach step for CPU tensors unless asked: left as it is.
    (torch.optim.RMSprop, {}, None, "no fused or foreach step for these tensors' devices"),
])
def test_the_fused_remedy_picks_the_fastest_step_the_tensors_allow(
        cls: type[Any], given: dict[str, Any], after: str | None, kept: str | None) -> None:
    arguments = {"params": iter(_params()), **given}
    note = OptimizerSeen(site="train.py:6", name=cls.__name__, before="default")
    _faster(cls, arguments, note)
    assert (note.after, note.kept) == (after, kept)
    assert isinstance(arguments["params"], list) and len(arguments["params"]) == 3  # read once
    optimizer = cls(**arguments)  # the arguments torch.optim is then given are valid
    assert implementation(optimizer)[0] == ("fused" if after or "fused" in given
                                            else "single-tensor")


def test_groups_and_named_parameters_are_kept_whole() -> None:
    groups = [{"params": (p for p in _params(2)), "lr": 0.1}, {"params": _params(1)}]
    arguments: dict[str, Any] = {"params": groups}
    note = OptimizerSeen(site=None, name="Adam", before="default")
    _faster(torch.optim.Adam, arguments, note)
    assert [len(g["params"]) for g in arguments["params"]] == [2, 1] and note.after
    assert torch.optim.Adam(**arguments).param_groups[0]["lr"] == 0.1
    named = {"params": [("w", torch.nn.Parameter(torch.randn(2)))]}
    _faster(torch.optim.AdamW, named, note := OptimizerSeen(None, "AdamW", "default"))
    assert note.after == "fused=True"


def test_an_optimizer_outside_torch_optim_is_unknown_not_single_tensor() -> None:
    class Custom(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1, "foreach": None})

        def step(self, closure: Any = None) -> None:
            return None

    assert implementation(Custom(_params()))[0] == "unknown"
    assert implementation(torch.optim.AdamW(_params()))[0] == "single-tensor"  # CPU default
    assert implementation(torch.optim.AdamW(_params(), foreach=True)) == ("foreach",
                                                                          "foreach=True")
    assert implementation(torch.optim.LBFGS(_params()))[0] == "unknown"


def test_the_steps_a_loop_means_to_make_are_read_from_its_source() -> None:
    """planned.py reads the loop around the step: nested `range` and DataLoader loops
    multiply; a `while` loop, a step under an `if`, or a bound that calls code says nothing."""
    import sys
    import types

    from torch.utils.data import DataLoader, TensorDataset

    from gpudiag.measure.profile.inscript.planned import planned_steps

    args = types.SimpleNamespace(epochs=3)
    loader = DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=2)  # 5 batches
    seen: list[tuple[int, str] | None] = []
    for _epoch in range(args.epochs):
        for _batch in loader:
            seen.append(planned_steps(sys._getframe()))
    assert seen[0] is not None and seen[0][0] == 15 and "the loops at" in seen[0][1]
    unknown: dict[str, tuple[int, str] | None] = {}
    while "while" not in unknown:
        unknown["while"] = planned_steps(sys._getframe())
    for step in range(10):
        if step % 2:
            unknown["if"] = planned_steps(sys._getframe())
    for _ in range(int("4")):
        unknown["call"] = planned_steps(sys._getframe())
    assert unknown == {"while": None, "if": None, "call": None}


def _one_epoch(loader: object, seen: list[tuple[int, str] | None]) -> None:
    import sys

    from gpudiag.measure.profile.inscript.planned import planned_steps

    for _batch in loader:  # type: ignore[attr-defined]
        seen.append(planned_steps(sys._getframe()))


def test_an_epoch_loop_around_the_call_of_a_loop_multiplies_it() -> None:
    """A step loop in train_epoch(), called from an epoch loop in main(): the epochs multiply
    the loader's batches (a short script's schedule is fitted to that count, issue 39); a
    `while` or an `if` in a loop around the call leaves it unknown, never one epoch's."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=2)  # 5 batches
    seen: list[tuple[int, str] | None] = []
    for _epoch in range(4):
        _one_epoch(loader, seen)
    assert seen[0] is not None and seen[0][0] == 20
    assert "x the loop at" in seen[0][1]
    unknown: list[tuple[int, str] | None] = []
    while not unknown:
        _one_epoch(loader, unknown)
    for epoch in range(3):
        if epoch:
            _one_epoch(loader, unknown)
    assert not any(unknown)
    once: list[tuple[int, str] | None] = []
    _one_epoch(loader, once)  # called once, not in a loop: one epoch is the run
    assert once[0] is not None and once[0][0] == 5
