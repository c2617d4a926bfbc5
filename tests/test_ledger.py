"""One accounting per profiled stage (gpudiag/diagnose/ledger.py): every finding that prices time
prices a part of the same whole, says its share of the run's wall time, and the findings of a
stage add up to at most all of it; the waterfalls name the findings beside the parts they
price; a rule says where it is declared what it prices, so none is left out of them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import script_run, script_stage
from test_rules import CASES
from test_timeline import _timeline

from gpudiag.diagnose import all_rules, evaluate, find_rule, registry
from gpudiag.diagnose.ledger import (
    LoopParts,
    NoPart,
    StepPart,
    Symptom,
    ledger,
    wall_shares,
)
from gpudiag.diagnose.registry import Draft, rule
from gpudiag.diagnose.timeline import stage_account
from gpudiag.model.facts import HostLine, HostSamples
from gpudiag.model.results import Evidence, FindingAccount, RunResult, StageResult
from gpudiag.model.runfile import RunFileError, load_run, save_run
from gpudiag.present.waterfall import markdown_sections

EXAMPLES = Path(__file__).resolve().parent.parent / "reports" / "examples"
RECORDED = sorted([*EXAMPLES.rglob("run.json"),
                   Path(__file__).resolve().parent / "data" / "h100-dgca-run.json"])
PROFILED = sorted(p.parent for p in EXAMPLES.rglob("run.json")
                  if '"timeline"' in p.read_text() or '"host"' in p.read_text())


def _run(stage: StageResult) -> RunResult:
    run = script_run(stage)
    run.findings = evaluate(run)
    return run


def _script_stage(host: HostSamples | None = None, **planted: float) -> StageResult:
    timeline = _timeline(**planted)  # type: ignore[arg-type]
    return script_stage(timeline.step_ms[1:36], steps=200, timeline=timeline, host=host)


def test_a_save_and_an_evaluation_are_priced_on_one_wall_and_named_in_the_waterfall() -> None:
    stage = _script_stage(eval_every=10, eval_ms=218.0, save_every=7, save_ms=60.0,
                          after_ms=2.0)
    run = _run(stage)
    whole = stage_account(stage)
    assert whole is not None
    by_code = {f.id: f for f in run.findings}
    assert {"GD701", "GD703"} <= set(by_code)
    truth = {"GD701": 60.0 * (199 // 7), "GD703": 218.0 * (199 // 10)}
    for code, planted in truth.items():
        account = by_code[code].account
        assert account is not None and account.whole == "loop"
        assert account.share == pytest.approx(planted / whole.loop_ms, rel=0.05)
        assert account.share_of_wall == pytest.approx(planted / whole.wall_ms, rel=0.05)
    assert sum(wall_shares(run, stage).values()) <= 1.0
    report = "\n".join(markdown_sections(run))
    assert "priced by" in report
    save_row = next(line for line in report.splitlines() if line.startswith("| checkpoint saves"))
    loop_row = next(line for line in report.splitlines() if line.startswith("| DataLoader loop"))
    assert save_row.endswith("| GD701 |") and loop_row.endswith("| GD703 |")


def test_a_step_finding_is_a_share_of_the_run_through_the_steady_steps_share() -> None:
    # Host-only work at one line, 40% of a 23 ms step, in a run that also evaluates.
    steps, step_ms = 150, 23.0
    host = HostSamples(period_ms=10.0, samples=300, steady_steps=steps,
                       steady_wall_ms=steps * step_ms, sampled_ms=steps * step_ms,
                       kind_ms={"python": 0.4 * steps * step_ms, "torch": 0.6 * steps * step_ms},
                       lines=[HostLine("train.py:40", "<module>", "python",
                                       0.4 * steps * step_ms),
                              HostLine("train.py:41", "<module>", "torch",
                                       0.6 * steps * step_ms)])
    stage = _script_stage(host, eval_every=20, eval_ms=300.0)
    stage.evidence = Evidence(steps=3, step_ms=step_ms, backend="cpu")
    run = _run(stage)
    books = ledger(stage)
    assert books is not None and books.steps_share is not None
    host_work = next(f for f in run.findings if f.id == "GD105")
    account = host_work.account
    assert account is not None and account.part == "python" and account.whole == "step"
    assert account.share == pytest.approx(0.4, abs=0.01)
    assert account.share_of_wall == pytest.approx(0.4 * books.steps_share, abs=0.002)
    assert account.ms_per_step == pytest.approx(0.4 * step_ms, rel=0.03)
    assert sum(wall_shares(run, stage).values()) <= 1.0
    report = "\n".join(markdown_sections(run))
    python_row = next(line for line in report.splitlines() if line.startswith("| Python"))
    assert python_row.endswith("| GD105 |")


@pytest.mark.parametrize("run_dir", PROFILED, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_findings_of_a_recorded_stage_add_up_to_at_most_its_wall(run_dir: Path) -> None:
    run = load_run(run_dir)
    run.findings = evaluate(run)
    for stage in run.ok_stages():
        shares = wall_shares(run, stage)
        assert sum(shares.values()) <= 1.0 + 1e-6, (stage.name, shares)
        books = ledger(stage)
        for finding in run.findings:
            account = finding.account
            if finding.stage != stage.name or account is None:
                continue
            assert books is not None
            if account.whole == "step" and books.steps_share is not None:
                assert account.share_of_wall == pytest.approx(
                    account.share * books.steps_share, abs=1e-3)


def test_a_schema_3_account_in_the_evidence_becomes_the_findings_account(tmp_path: Path) -> None:
    """Schema 3 kept the account in the finding's evidence, untyped; read, it is the typed
    `Finding.account` (the evidence keeps the rest), and report.md shows it as before."""
    committed = EXAMPLES / "h100-periodic" / "eval20" / "run.json"
    data = json.loads(committed.read_text())
    assert data["schema_version"] == 3
    run = load_run(committed)
    data_wait, loop = (next(f for f in run.findings if f.id == code) for code in ("GD201",
                                                                              "GD703"))
    assert data_wait.account == FindingAccount(part="data", whole="step", share=0.4033,
                                               share_of_wall=0.0404, ms_per_step=1.49)
    assert loop.account is not None and loop.account.whole == "run"
    assert loop.account.share == loop.account.share_of_wall == 0.1629
    assert loop.account.part.startswith("DataLoader loop at periodic_eval.py:48")
    assert "account" not in data_wait.evidence and "account" not in loop.evidence
    # Written again, it is schema 4's own key and reads back the same.
    save_run(run, tmp_path / "run.json")
    again = json.loads((tmp_path / "run.json").read_text())
    finding = next(f for f in again["findings"] if f["id"] == "GD201")
    assert finding["account"]["share"] == 0.4033 and "account" not in finding["evidence"]
    assert load_run(tmp_path).findings == run.findings


def test_a_schema_3_account_that_is_no_account_is_refused_naming_it(tmp_path: Path) -> None:
    data = json.loads((EXAMPLES / "h100-periodic" / "eval20" / "run.json").read_text())
    finding = next(i for i, f in enumerate(data["findings"]) if f["id"] == "GD201")
    data["findings"][finding]["evidence"]["account"]["share_of_step"] = "most"
    (tmp_path / "run.json").write_text(json.dumps(data))
    with pytest.raises(RunFileError, match=rf"findings\[{finding}\]\.account\.share") as info:
        load_run(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("framework", "hook", "knob"), [
    ("transformers", None, 'TrainingArguments(..., eval_steps=<more steps>, or '
                           'eval_strategy="epoch"'),
    ("lightning", "Model.val_dataloader", "Trainer(val_check_interval=<more steps>"),
    (None, None, None),
])
def test_a_frameworks_evaluation_is_named_with_its_knob(
        framework: str | None, hook: str | None, knob: str | None) -> None:
    """An evaluation loop the Trainer runs (its loader built by transformers' Trainer, or by
    the script's Lightning hook) names the setting that runs it this often; a script's own
    evaluation loop has no such knob."""
    from gpudiag.model.facts import LoaderEpoch, LoaderFacts, LoaderUse

    stage = _script_stage(eval_every=10, eval_ms=218.0)
    assert stage.facts.script is not None and stage.facts.script.timeline is not None
    loop = stage.facts.script.timeline.loops[0]
    stage.facts.script.loaders = [LoaderUse(
        site=None, settings=LoaderFacts(num_workers=0, pin_memory=False),
        iterated_at=loop.location, passes=19, epochs=[LoaderEpoch(step=10, start_ms=1.0)],
        framework=framework, hook=hook, edit_at="train.py:12" if framework else None)]
    (evaluation,) = [f for f in _run(stage).findings if f.id == "GD703"]
    if knob is None:
        assert "It is the Trainer's" not in evaluation.fix and "Lightning" not in evaluation.fix
    else:
        assert knob in evaluation.fix
    if framework == "transformers":
        assert "at train.py:12" in evaluation.fix


def _unpriced(run: RunResult) -> list[str]:
    """The findings that price time on a stage with an account yet sit in no part of it,
    though their rule does not declare that it prices no part (a symptom, or no part, with
    why); and those whose account is not the whole their rule declares."""
    wrong = []
    for finding in run.findings:
        stage = run.stage(finding.stage) if finding.stage is not None else None
        if finding.impact <= 0 or stage is None or ledger(stage) is None:
            continue
        found = find_rule(finding.id)
        assert found is not None
        declared = found.prices
        whole = declared.whole if isinstance(declared, (StepPart, LoopParts)) else None
        account = finding.account
        if (account.whole if account is not None else None) != whole:
            wrong.append(f"{finding.id} on {stage.name}: {declared} -> {account}")
    return wrong


def _every_run() -> Iterator[RunResult]:
    """Every rule's firing case and near misses (tests/test_rules.py), and every recorded run."""
    for case in CASES.values():
        yield from (make() for make in (case.fires, *case.near_misses))
    yield from (load_run(path) for path in RECORDED)


def test_every_finding_that_prices_time_is_in_the_waterfall_or_says_why_not() -> None:
    """A rule that prices time on a profiled stage is in that stage's waterfall, through its
    declaration alone, unless it declares that it prices no part of it (and why)."""
    wrong, priced = [], set()
    for run in _every_run():
        run.findings = evaluate(run)
        wrong += _unpriced(run)
        priced |= {f.id for f in run.findings if f.account is not None}
    assert not wrong, "\n".join(wrong)
    # Not vacuous: every rule that declares a part was seen pricing it.
    declaring = {r.code for r in all_rules() if isinstance(r.prices, (StepPart, LoopParts))}
    assert declaring <= priced, declaring - priced


def test_a_symptoms_causes_are_rules_that_price_a_part() -> None:
    for r in all_rules():
        if isinstance(r.prices, Symptom):
            for cause in r.prices.causes:
                found = find_rule(cause)
                assert found is not None and isinstance(found.prices, (StepPart, LoopParts)), (
                    r.code, cause)


def _throwaway(*, share: float) -> Iterator[Draft]:
    """A throwaway rule's check: host-only work at one line, `share` of the step."""
    yield Draft(severity="warning", stage="train.py", title="throwaway", evidence={},
                impact=share, fix="-", location="train.py:40")


def test_a_rule_declared_without_what_it_prices_is_refused() -> None:
    with pytest.raises(TypeError, match="prices"):
        rule("GD198", "throwaway", concern="launch",  # type: ignore[call-arg]
             summary="A throwaway rule.", why="a test", fix="none")
    with pytest.raises(ValueError, match="says why"):
        NoPart(" ")
    with pytest.raises(ValueError, match="names the work"):
        LoopParts(())
    assert find_rule("GD198") is None


def test_a_new_rule_is_in_the_waterfall_by_its_declaration_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No list to add it to: a rule registered with `prices=StepPart("python")` is named beside
    the step's Python part, and priced on the run's wall."""
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    rule("GD198", "throwaway", concern="launch", summary="A throwaway rule.", why="a test",
         fix="none", prices=StepPart("python"))(lambda run: _throwaway(share=0.3))
    steps, step_ms = 150, 23.0
    host = HostSamples(period_ms=10.0, samples=300, steady_steps=steps,
                       steady_wall_ms=steps * step_ms, sampled_ms=steps * step_ms,
                       kind_ms={"python": 0.4 * steps * step_ms, "torch": 0.6 * steps * step_ms},
                       lines=[HostLine("train.py:40", "<module>", "python",
                                       0.4 * steps * step_ms)])
    run = _run(_script_stage(host, eval_every=20, eval_ms=300.0))
    (found,) = [f for f in run.findings if f.id == "GD198"]
    assert found.account is not None and found.account.part == "python"
    assert found.account.share_of_wall is not None and not _unpriced(run)
    python_row = next(line for line in "\n".join(markdown_sections(run)).splitlines()
                      if line.startswith("| Python"))
    assert "GD198" in python_row.rsplit("|", 2)[-2]
