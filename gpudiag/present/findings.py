"""Findings and rule documentation, rendered for markdown and the terminal. Pure functions."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gpudiag.diagnose import Rule
from gpudiag.diagnose.pricechecks import price_checks
from gpudiag.model.results import Finding, FindingAccount, RunResult
from gpudiag.present.tables import markdown_table

_STYLE = {"critical": "bold red", "warning": "yellow", "info": "dim"}


def _at_stake(finding: Finding) -> str:
    if finding.impact <= 0:
        return "risk, not time"
    # Priced on the training loop or the whole run (gpudiag/diagnose/timeline.py), or on the
    # steady step.
    whole = finding.account.whole if finding.account is not None else (
        "run" if "run_wall_ms" in finding.evidence else "step")
    stake = f"{finding.impact:.0%} of {_WHOLES[whole]}"
    # Each share is also one of the run's wall, the same whole for every finding
    # (gpudiag/diagnose/ledger.py).
    wall = finding.account.share_of_wall if finding.account is not None \
        and whole != "run" else None
    return f"{stake} ({wall:.1%} of the run's wall time)" if wall is not None else stake


_WHOLES = {"step": "the step", "loop": "the training loop", "run": "the run"}


def _account(account: FindingAccount) -> dict[str, float | str]:
    """The account as the evidence line shows it: part, its share of its whole, of the wall,
    and a step part's ms per step."""
    shown: dict[str, float | str] = {"part": account.part,
                                     f"share_of_{account.whole}": account.share}
    if account.share_of_wall is not None:
        shown["share_of_wall"] = account.share_of_wall
    if account.ms_per_step is not None:
        shown["ms_per_step"] = account.ms_per_step
    return shown


def _evidence(finding: Finding) -> dict[str, Any]:
    """What the finding saw, and last the part of the account it prices."""
    if finding.account is None:
        return finding.evidence
    return {**finding.evidence, "account": _account(finding.account)}


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def headline(run: RunResult) -> str | None:
    """The top finding in one sentence, or None when nothing material was found."""
    top = next((f for f in run.findings if f.severity != "info"), None)
    if top is None:
        return None
    where = f" at `{top.location}`" if top.location else ""
    return f"**{top.stage}: {top.title}**{where}. {top.fix}"


def blind_spots(run: RunResult) -> list[str]:
    """Stages the evidence-based rules could not look at, each with why ("stage: reason"):
    one that ran without a window, and one that failed (a script too short for any timed
    step: no rule judged it, which is no clean bill of health). Stages skipped by design (a
    ddp stage on one GPU) are listed under "Stages that did not run" instead."""
    return [f"{s.name}: {s.facts.evidence_missing}" if s.ok else
            f"{s.name}: the stage failed ({s.error or s.status})"
            for s in run.stages
            if (s.ok and s.evidence is None and s.facts.evidence_missing)
            or (s.status == "error" and not s.failed_after_timing)]


def failed_after_timing(run: RunResult) -> list[str]:
    """Stages judged though they failed after their timed steps (a script that raised after
    its window): how each failed, said beside the findings that come from its steps."""
    return [f"{s.name}: {s.error or 'the stage failed'}, after its {len(s.iter_ms)} timed "
            "steps and its profiler window: the findings are from those steps"
            for s in run.stages if s.failed_after_timing]


def diagnosis_markdown(run: RunResult) -> list[str]:
    lines = ["## Diagnosis", ""]
    material = [f for f in run.findings if f.severity != "info"]
    observations = [f for f in run.findings if f.severity == "info"]
    top = headline(run)
    unseen = blind_spots(run)
    if top is not None:
        lines += [top, ""]
    elif unseen:
        lines += ["No warning-level finding in what gpudiag could see; it could not see "
                  "everything, so this is not a clean bill of health:", ""]
    else:
        lines += ["No warning-level finding: no rule saw a material cost in these stages.", ""]
    if unseen:
        lines += [f"- **No evidence for {line}**" for line in unseen]
        lines.append("")
    if failed := failed_after_timing(run):
        lines += [f"- **{line}**" for line in failed]
        lines.append("")
    for i, f in enumerate(material, 1):
        lines.append(f"### {i}. {f.severity}: {f.id} {f.rule} ({f.stage})")
        lines += ["", f.title, ""]
        if f.location:
            lines.append(f"- Where: `{f.location}`")
        lines.append(f"- At stake: {_at_stake(f)}")
        lines.append("- Evidence: " + "; ".join(f"{k} = {_value(v)}"
                                               for k, v in _evidence(f).items()))
        lines += [f"- Fix: {f.fix}", ""]
    if observations:
        lines += ["Observations (information, no action needed):", ""]
        lines += [f"- {f.id} {f.rule} ({f.stage}): {f.title}"
                  + (f" at `{f.location}`" if f.location else "") for f in observations]
        lines.append("")
    lines.append("`gpudiag rules CODE` explains a rule: what it detects, thresholds, why, fix.")
    lines.append("")
    return lines


def findings_panel(run: RunResult) -> Panel:
    parts: list[Any] = []
    material = [f for f in run.findings if f.severity != "info"]
    for f in material:
        text = Text()
        text.append(f"{f.severity} {f.id} ", style=_STYLE[f.severity])
        text.append(f"{f.stage}: ", style="bold")
        text.append(f.title)
        where = f"at {f.location} · " if f.location else ""
        text.append(f"\n   {where}{_at_stake(f)}", style="cyan")
        text.append(f"\n   fix: {f.fix}", style="green")
        parts.append(text)
    info = [f for f in run.findings if f.severity == "info"]
    unseen = blind_spots(run)
    if not material:
        parts.append(Text("No warning-level findings in what gpudiag could see."
                          if unseen else "No warning-level findings.",
                          style="yellow" if unseen else "green"))
    for line in unseen:
        parts.append(Text(f"no evidence for {line}", style="yellow"))
    for line in failed_after_timing(run):
        parts.append(Text(line, style="yellow"))
    if info:
        parts.append(Text(f"{len(info)} observation(s) at information level in report.md.",
                          style="dim"))
    return Panel(Group(*parts), title="Diagnosis", title_align="left")


def rules_table(rules: list[Rule]) -> Table:
    table = Table(title="Rules", title_justify="left", header_style="bold")
    for column in ("code", "name", "concern", "detects"):
        table.add_column(column)
    for r in rules:
        table.add_row(r.code, r.name, r.concern, r.summary)
    return table


def rule_sections(r: Rule) -> list[tuple[str, str]]:
    """A rule's documentation as (heading, text) sections, for every renderer."""
    thresholds = "\n".join(f"- {t.name} = {t.value:g}: {t.why}" for t in r.thresholds)
    detects = " ".join((r.check.__doc__ or r.summary).split())
    sections = [("What it detects", detects), ("Thresholds", thresholds or "-"),
                ("What it prices", r.prices.says()),
                ("Its price against the measured saving", price_checks(r.code)),
                ("Why it matters", r.why),
                ("How to fix", r.fix)]
    if r.references:
        sections.append(("References", "\n".join(f"- {ref}" for ref in r.references)))
    return sections


def rule_panel(r: Rule) -> Panel:
    body = Text()
    for heading, text in rule_sections(r):
        body.append(f"{heading}\n", style="bold")
        body.append(f"{text}\n\n")
    return Panel(body, title=f"{r.code} {r.name} ({r.concern})", title_align="left")


def rules_markdown(rules: list[Rule]) -> str:
    out = ["# gpudiag rules", "",
           "Generated from the rule registry by `gpudiag rules --markdown`; a test fails when "
           "this file is stale.", ""]
    out += markdown_table(["code", "name", "concern", "detects"],
                          [[f"[{r.code}](#{r.code.lower()}-{r.name})", r.name, r.concern,
                            r.summary] for r in rules], right=4)
    for r in rules:
        out += ["", f"## {r.code} {r.name}", "", f"Concern: {r.concern}. {r.summary}"]
        for heading, text in rule_sections(r):
            out += ["", f"### {heading}", "", text]
    return "\n".join(out) + "\n"
