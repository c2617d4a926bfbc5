"""Framework components as evidence: the optimizer's implementation read from the live object
in a profiled script, named with its knob at the line that builds it, and the fused-optimizer
remedy's change to a constructor's arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import profile_script, script_line, write_script

from gpudiag.measure.profile.inscript.components import implementation
from gpudiag.measure.profile.inscript.remedies import _faster
from gpudiag.model.remedies import OptimizerSeen

# A model of 300 small parameter tensors under AdamW's single-tensor step: ~10 operators per
# tensor per step, most of the step on a CPU (fused=True measured 2.2x here).
PER_TENSOR_SCRIPT = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(150)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    x = torch.randn(4, 8)
    for step in range(24):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.slow
def test_a_per_tensor_optimizer_is_named_at_its_constructor_with_fused(tmp_path: Path) -> None:
    script = write_script(tmp_path / "train.py", PER_TENSOR_SCRIPT)
    run = profile_script(tmp_path, script, "--warmup", "3", "--timed", "12").ok()
    (stage,) = run.stages
    assert stage.facts.script is not None
    (seen,) = stage.facts.script.optimizers
    built = script_line(script, "opt = torch.optim.AdamW(")
    assert (seen.name, seen.implementation, seen.chosen) == ("AdamW", "single-tensor",
                                                             "foreach=False")
    assert seen.parameters == 300 and seen.fused_supported and seen.site == built
    assert seen.step_site == script_line(script, "opt.step()") and seen.steps == 24
    assert stage.evidence is not None and stage.evidence.optimizer_ops_per_step >= 300 * 5
    top = run.findings[0]
    assert top.id == "GD106" and top.location == built and top.severity != "info"
    assert f"AdamW(..., fused=True) at {built}" in top.fix and "foreach=False" in top.fix
    # Priced as a bound no larger than the step's host time in the opt.step() line.
    assert top.account is not None and 0.3 < top.account.share <= 1.0
    assert top.evidence["measured_by"] in ("host samples", "the profiler window")


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
