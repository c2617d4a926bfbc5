"""torch.compile under `gpudiag profile` (gpudiag/measure/profile/inscript/watches/compiled.py,
gpudiag/diagnose/gd9_compile.py), on scripts written for these tests: a compiled model fed a
new length every step (recompilations with Dynamo's guard and the call's line, the recompile
limit's fall back to eager, the compile time as a part of the run), a graph break (its reason
and line), and a script that never compiles."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import profile_script, script_line, script_run, script_stage, write_script

from gpudiag.diagnose.timeline import stage_account
from gpudiag.model.results import RunResult

# aot_eager: Dynamo and AOTAutograd as torch.compile runs them, without a C++ compiler.
RECOMPILING = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, backend="aot_eager", dynamic={dynamic})


    def train():
        for step in range(60):
            x = torch.randn(4, 8 + step % 12, 32)  # a new sequence length every step
            loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()


    train()
"""

def _profile(tmp_path: Path, body: str) -> tuple[RunResult, str, Path]:
    script = write_script(tmp_path / "train.py", body)
    profiled = profile_script(tmp_path, script)
    return profiled.ok(), profiled.output, script


@pytest.mark.heavy
def test_recompilations_are_named_with_the_guard_and_the_calls_line(tmp_path: Path) -> None:
    run, output, script = _profile(tmp_path, RECOMPILING.replace("{dynamic}", "False"))
    by_code = {f.id: f for f in run.findings}
    recompiles = by_code["GD901"]
    call = script_line(script, "loss = compiled(x)")
    assert recompiles.location == call
    assert recompiles.evidence["recompiles"] >= 6
    assert "size mismatch at index 1" in recompiles.evidence["recompile_reasons"][0]
    assert "mark_dynamic" in recompiles.fix and call in recompiles.fix
    # The compile time is a part of the run's account, the same one the finding prices.
    stage = run.stages[0]
    whole = stage_account(stage)
    assert whole is not None
    compiling = next(w for w in whole.works if w.kind == "compile")
    # Priced on the training loop (start-up apart), and so a share of the run's wall.
    assert recompiles.impact == whole.loop_share(compiling.extra_ms)
    assert recompiles.account is not None
    assert recompiles.account.share_of_wall == pytest.approx(
        compiling.extra_ms / whole.wall_ms, abs=1e-4)
    # Dynamo's default limit (8) is reached by 12 lengths: the rest of the run is eager.
    fallback = by_code["GD902"]
    assert fallback.location == call and fallback.evidence["recompile_limit"] == 8
    assert fallback.evidence["first_eager_step"] == 8
    assert "GD901" in output and "priced by" in (tmp_path / "run" / "report.md").read_text()


# Two compiled functions: a print inside one breaks its graph; the other sees a new sequence
# length every step, which Dynamo's automatic dynamic shapes absorb with one recompile.
BREAK_AND_DYNAMIC_SHAPES = """
    import torch
    from torch import nn

    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    encoder = torch.compile(nn.Sequential(nn.Linear(32, 64), nn.GELU()), backend="aot_eager")


    @torch.compile(backend="aot_eager")
    def forward(x):
        y = model(x).relu()
        print("a print inside the compiled function", end="\\r")
        return y.square().mean()


    for step in range(40):
        forward(torch.randn(8, 16)).backward()
        encoder(torch.randn(4, 8 + step % 12, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""


@pytest.mark.heavy
def test_a_graph_break_is_named_and_automatic_dynamic_shapes_are_not_a_finding(
        tmp_path: Path) -> None:
    run, _, script = _profile(tmp_path, BREAK_AND_DYNAMIC_SHAPES)
    breaks = next(f for f in run.findings if f.id == "GD903")
    assert "print" in breaks.title
    assert breaks.location == script_line(script, 'print("a print inside')
    compiles = run.stages[0].facts.script.compiles  # type: ignore[union-attr]
    # The length marked dynamic: the encoder recompiled once for it.
    assert compiles is not None and [e for e in compiles.events if e.recompile_reason]
    assert not [f for f in run.findings if f.id in ("GD901", "GD902")]
    # Dynamo's guards (exec'd from "<string>") are torch's work, never the user's lines.
    host = run.stages[0].facts.script.host  # type: ignore[union-attr]
    named = [line.location for line in host.lines] if host is not None else []
    assert not [loc for loc in named if loc.startswith("<")], named


# Forward only (an evaluation loop, its steps marked): a backward graph is one more C++ build
# of Inductor's, ~5 s of a CI core, for nothing this test asserts.
COMPILED_MODEL = """
    import torch
    from torch import nn
    import gpudiag

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


    @torch.compile
    def loss_of(x):
        h = model(x)
        scaled = torch.tanh(h) * 0.5 + h.sigmoid()
        return scaled.square().mean()


    with torch.no_grad():
        for step in range(40):
            with gpudiag.watch():
                loss_of(torch.randn(32, 64))
"""


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor on a CPU compiles C++: no compiler here")
@pytest.mark.heavy
def test_compiled_kernels_are_charged_to_the_lines_they_fused(
        tmp_path: Path, inductor_env: dict[str, str]) -> None:
    script = write_script(tmp_path / "train.py", COMPILED_MODEL)
    run = profile_script(tmp_path, script, "--compile-lines", env=inductor_env).ok()
    evidence = run.stages[0].evidence
    assert evidence is not None and evidence.attribution_note is not None
    assert "charged to the source lines of the operators they fused" in \
        evidence.attribution_note
    timed = {c.location: c for c in evidence.line_counts if c.device_ms > 0}
    fused = script_line(script, "scaled = torch.tanh(h)")
    assert fused in timed, sorted(timed)
    assert timed[fused].kind_ms  # its kernels' time, by kind


def test_a_shift_from_compiling_on_timed_steps_is_not_blamed_on_interference() -> None:
    from gpudiag.diagnose import evaluate
    from gpudiag.model.facts import CompileEvent, CompileFacts

    def stage(compiled_at: int | None) -> RunResult:
        events = [CompileEvent("forward", "model.py:10", 2.0, step=s, compile_id=f"0/{i}")
                  for i, s in enumerate([0] + ([compiled_at] if compiled_at else []))]
        times = [10.0] * 30
        times[2:7] = [40.0] * 5  # a slow block: steps 7-11
        run = script_run(script_stage(times, compiles=CompileFacts(
            events=events, seconds=2.0 * len(events))))
        run.findings = evaluate(run)
        return run

    compiled = next(f for f in stage(8).findings if f.id == "GD601")
    assert "torch.compile compiled on timed step(s) 8" in compiled.title
    assert "--warmup 9" in compiled.fix
    quiet = next(f for f in stage(None).findings if f.id == "GD601")
    assert "outside interference" in quiet.title
