"""Advice that fits the code: every rule's fix, on scripts it was not written for, names only
the operators, modules and settings the run's own evidence says the script used.

Each fix is walked over every committed run under reports/examples/ (today's rules on it) and
every firing case of tests/test_rules.py::CASES. A small declared vocabulary says, for each
piece of advice that presumes something about the code, what the run must show for it to fit:
scaled_dot_product_attention needs attention in the kernels; "write all elements with one op"
(masked_scatter) needs a line that writes, not one that reduces; "CUDA graphs or torch.compile"
for a script compiled already must name the compile mode; "more workers" needs a loader whose
--try-fixes did not measure workers slower; no_sync needs DDP, reshard_after_forward FSDP2,
anomaly detection its setting on."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_rules import CASES, gd101, gd102, gd104, gd105, gd201, make_evidence, make_run, make_stage

from gpudiag.diagnose import evaluate
from gpudiag.model.facts import HostSamples, ScriptFacts
from gpudiag.model.results import Finding, LineCount, MeasuredFix, RunResult, StageResult
from gpudiag.model.runfile import load_run

EXAMPLES = Path(__file__).resolve().parent.parent / "reports" / "examples"
RUNS = sorted(p.parent for p in EXAMPLES.rglob("run.json"))
REDUCTION = re.compile(r"\.(item|max|min|sum|mean|norm|amax|amin|abs|any|all)\(")
SUBSCRIPT_WRITE = re.compile(
    r"\]\s*(?:[-+*/]?=)(?!=)|\.(copy_|index_put_|scatter_|masked_scatter)\(")


def _stage(run: RunResult, finding: Finding) -> StageResult | None:
    return run.stage(finding.stage) if finding.stage is not None else None


def _line_text(stage: StageResult | None, location: str | None) -> str | None:
    script = stage.facts.script if stage is not None else None
    host = script.host if script is not None else None
    return host.text.get(location or "") if host is not None else None


NEAR_LINES = 3  # a hand-written attention's softmax sits this close to its matmuls


def _lines_of(ev_lines: list[LineCount], kind: str) -> set[tuple[str, int]]:
    found = set()
    for line in ev_lines:
        path, _, number = line.location.rpartition(":")
        if line.kind_ms.get(kind) and number.isdigit():
            found.add((path, int(number)))
    return found


def _attention(run: RunResult, stage: StageResult | None, _: Finding) -> str | None:
    """Attention: a fused attention kernel, or a softmax a few lines from matmuls of the same
    file (a classifier's loss, log_softmax alone, is not one); with no line's kinds on record
    (compiled code), any softmax."""
    ev = stage.evidence if stage is not None else None
    if ev is None:
        return "attention advice for a step with no kernels on record"
    softmax, matmul = _lines_of(ev.line_counts, "softmax"), _lines_of(ev.line_counts, "matmul")
    if ev.device_ms_by_kind.get("attention") or (not softmax and ev.device_ms_by_kind.get(
            "softmax")) or any(p == q and abs(a - b) <= NEAR_LINES
                               for p, a in softmax for q, b in matmul):
        return None
    return "attention advice for a step with no softmax beside matmuls"


def _writes(run: RunResult, stage: StageResult | None, finding: Finding) -> str | None:
    text = _line_text(stage, finding.location)
    if text is None or SUBSCRIPT_WRITE.search(text) or not REDUCTION.search(text):
        return None  # a write, or a line not known: the write loop's advice may fit
    return f"per-element write advice for a line that reduces: `{text}`"


def _not_compiled(run: RunResult, stage: StageResult | None, finding: Finding) -> str | None:
    script = stage.facts.script if stage is not None else None
    compiled = script is not None and bool(script.compiled_graphs or (
        script.compiles is not None and script.compiles.events))
    if not compiled or "reduce-overhead" in finding.fix:
        return None
    return "'use torch.compile' for a script compiled already (name the compile mode)"


def _workers_help(run: RunResult, stage: StageResult | None, _: Finding) -> str | None:
    slower = [f for f in run.fixes if f.remedy == "loader" and f.status == "measured"
              and not f.changed_nothing and f.speedup is not None and f.speedup < 1.0]
    return None if not slower else \
        f"more DataLoader workers, which --try-fixes measured {slower[0].speedup:.2f}x"


def _ddp(run: RunResult, stage: StageResult | None, _: Finding) -> str | None:
    ev = stage.evidence if stage is not None else None
    script = stage.facts.script if stage is not None else None
    collectives = stage is not None and (
        stage.facts.ddp is not None or stage.facts.ddp_job is not None
        or (ev is not None and ev.collective_calls_per_step > 0))
    if not collectives:
        return "DDP advice (no_sync) for a run with no collectives"
    if script is not None and script.fsdp is not None:
        return "DDP advice (no_sync) for an FSDP2 job"
    return None


def _fsdp(run: RunResult, stage: StageResult | None, _: Finding) -> str | None:
    script = stage.facts.script if stage is not None else None
    return None if script is not None and script.fsdp is not None else \
        "FSDP2 advice for a script that sharded nothing"


def _anomaly(run: RunResult, stage: StageResult | None, _: Finding) -> str | None:
    script = stage.facts.script if stage is not None else None
    on = script is not None and any(d.kind == "anomaly-detection" for d in script.debug)
    return None if on else "anomaly detection advice for a script that never turned it on"


@dataclass(frozen=True)
class Advice:
    """A piece of advice (its words in a fix) and what the run must show for it to fit: a
    check that says why it does not, or None."""

    words: re.Pattern[str]
    fits: Callable[[RunResult, StageResult | None, Finding], str | None]


VOCABULARY = (
    Advice(re.compile(r"scaled_dot_product_attention"), _attention),
    Advice(re.compile(r"masked_scatter|write all elements"), _writes),
    # Advice to compile (or capture) the step, not advice about compiling (dynamic=True).
    Advice(re.compile(r"torch\.compile or capturing|CUDA graphs? or torch\.compile|"
                      r"torch\.compile or CUDA graphs|"
                      r"\(torch\.compile\)"), _not_compiled),
    Advice(re.compile(r"num_workers=|more workers"), _workers_help),
    Advice(re.compile(r"no_sync\(\)"), _ddp),
    Advice(re.compile(r"reshard_after_forward"), _fsdp),
    Advice(re.compile(r"detect_anomaly"), _anomaly),
)


def misfits(run: RunResult) -> list[str]:
    """'CODE at LOCATION: why' for each finding whose fix presumes what the run lacks."""
    found = []
    for finding in evaluate(run):
        stage = _stage(run, finding)
        for advice in VOCABULARY:
            if advice.words.search(finding.fix):
                why = advice.fits(run, stage, finding)
                if why is not None:
                    found.append(f"{finding.id} at {finding.location}: {why}")
    return found


def _id(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))


@pytest.mark.parametrize("run_dir", RUNS, ids=_id)
def test_the_advice_on_a_committed_run_fits_its_code(run_dir: Path) -> None:
    assert not misfits(load_run(run_dir))


@pytest.mark.parametrize("code", sorted(CASES))
def test_the_advice_on_a_rules_case_fits_its_code(code: str) -> None:
    assert not misfits(CASES[code].fires())


def _script(run: RunResult, stage: str, **facts: object) -> RunResult:
    """`run` with its stage `stage` a profiled script's, with `facts`."""
    found = run.stage(stage)
    assert found is not None
    found.facts.script = ScriptFacts(steps=60, warmup=5, timed=30,
                                     step_clock="optimizer.step()", **facts)  # type: ignore[arg-type]
    return run


def _text(location: str, text: str) -> HostSamples:
    return HostSamples(period_ms=10.0, samples=0, steady_steps=0, steady_wall_ms=0.0,
                       sampled_ms=0.0, text={location: text})


# Scripts the rules were not written for: a per-parameter gradient statistic read in a loop,
# a per-element write loop, and a compiled script whose GPU starves between short kernels.
UNRELATED: dict[str, tuple[Callable[[], RunResult], str, str]] = {
    "gradient-maxima-loop": (
        lambda: _script(gd101(), "full-loop", host=_text(
            "model.py:42", "stats.append(p.grad.abs().max().item())")),
        "GD101", "torch._foreach_norm"),
    "prompt-write-loop": (
        lambda: _script(gd101(), "full-loop", host=_text(
            "model.py:42", "x[i, slots[i, j], :] = self.prompt[j]")),
        "GD101", "masked_scatter"),
    "compiled-starved": (lambda: _script(gd102(excess=0.5), "full-loop", compiled_graphs=1),
                         "GD102", 'mode="reduce-overhead"'),
    "compiled-short-kernels": (lambda: _script(gd104(kernels=500), "train", compiled_graphs=1),
                               "GD104", 'mode="reduce-overhead"'),
    "host-work-workers-slower": (lambda: _workers_slower(gd105(share=0.4)), "GD105",
                                 "measured 0.17x"),
}


def _workers_slower(run: RunResult) -> RunResult:
    """`run` whose --try-fixes measured more DataLoader workers 6x slower (an in-memory
    TensorDataset: handing batches over costs more than making them)."""
    run.fixes = [MeasuredFix(remedy="loader", title="DataLoader workers", findings=["GD201"],
                             before_ms=10.0, after_ms=60.0, speedup=1 / 6)]
    return run


def _cnn() -> RunResult:
    """A convolutional step: matmuls (convolutions) and BatchNorm, a cross-entropy loss's
    log_softmax, no attention anywhere."""
    lines = [LineCount("model.py:20", "forward", kind_ms={"norm": 45.0, "matmul": 40.0}),
             LineCount("model.py:21", "forward", kind_ms={"elementwise": 13.0}),
             LineCount("train.py:30", "<module>", kind_ms={"softmax": 2.0})]  # the loss
    ev = make_evidence(idle_fraction=0.05, line_counts=lines, device_ms_by_kind={
        "matmul": 40.0, "norm": 45.0, "elementwise": 13.0, "softmax": 2.0})
    return make_run(make_stage("train", evidence=ev))


# Two scripts issue 55 found misadvised: a CNN told to call scaled_dot_product_attention (its
# only softmax is the loss's), and a loader told to take more workers after --try-fixes
# measured them 6x slower.
MISADVISED_BEFORE: dict[str, Callable[[], RunResult]] = {
    "cnn-attention-advice": _cnn,
    "loader-workers-slower": lambda: _workers_slower(gd201(share=0.3)),
}


@pytest.mark.parametrize("name", sorted(MISADVISED_BEFORE))
def test_scripts_once_misadvised_get_advice_that_fits(name: str) -> None:
    assert not misfits(MISADVISED_BEFORE[name]())


@pytest.mark.parametrize("name", sorted(UNRELATED))
def test_the_advice_names_what_the_code_at_the_line_does(name: str) -> None:
    make, code, named = UNRELATED[name]
    run = make()
    assert not misfits(run)
    (finding,) = [f for f in evaluate(run) if f.id == code]
    assert named in finding.fix, finding.fix
