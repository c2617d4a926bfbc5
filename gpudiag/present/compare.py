"""Renderers for comparisons and gate decisions: a rich table, markdown for pull requests."""

from __future__ import annotations

from rich import box
from rich.table import Table

from gpudiag.diagnose.compare import Comparison, MetricChange, StageComparison
from gpudiag.diagnose.gate import MAX_PROJECTED, TIME_METRICS, GateDecision, describe_change
from gpudiag.model.errors import ExitCode
from gpudiag.model.options import OnInconclusive
from gpudiag.model.results import Finding
from gpudiag.present.rows import DASH, fmt
from gpudiag.present.tables import markdown_table

_VERDICT_STYLE = {"faster": "green", "slower": "red", "no significant change": "",
                  "inconclusive": "yellow"}
_SHOWN_METRICS = ("ms/iter", "power", "energy/sample", "kernel-active", "peak memory")


def _pair(metric: MetricChange) -> str:
    if metric.before is None and metric.after is None:
        return DASH
    spec = ".3f" if metric.unit == "J" else ".0f" if metric.unit in ("MiB", "%", "W") else ".1f"
    text = f"{fmt(metric.before, spec)} -> {fmt(metric.after, spec)}"
    return text + (f" ({metric.ratio - 1:+.0%})" if metric.ratio is not None else "")


def _ratio_cells(s: StageComparison) -> list[str]:
    e = s.throughput
    if e is None:
        return [DASH, DASH, DASH]
    return [f"{e.ratio:.3f}x", f"{e.low:.3f} .. {e.high:.3f}" + ("*" if e.on_prior_alone else ""),
            f"{e.min_detectable:.1%}"]


def _device_cell(s: StageComparison) -> str:
    e = s.device
    if e is None:
        return DASH
    return (f"{e.ratio:.3f}x ({e.low:.3f} .. {e.high:.3f}" + ("*" if e.on_prior_alone else "")
            + ")")


def _counters_cell(s: StageComparison) -> str:
    if not s.counters:
        return DASH
    changed = s.counter_changes
    return f"{len(changed)} changed" if changed else f"{len(s.counters)} same"


def _samples_per_s(s: StageComparison) -> list[str]:
    return [fmt(s.before.samples_per_s if s.before else None, ",.1f"),
            fmt(s.after.samples_per_s if s.after else None, ",.1f")]


def _header(c: Comparison) -> list[str]:
    return ["stage", "before samples/s", "after samples/s", "throughput ratio",
            f"{c.confidence:.0%} CI", "detectable", "verdict", "device time ratio",
            "exact counters", *_SHOWN_METRICS]


def _row(s: StageComparison) -> list[str]:
    metrics = {m.name: m for m in s.metrics}
    return [s.stage, *_samples_per_s(s), *_ratio_cells(s), s.verdict, _device_cell(s),
            _counters_cell(s), *[_pair(metrics[name]) for name in _SHOWN_METRICS]]


def comparison_table(c: Comparison) -> Table:
    table = Table(title=f"{c.before_label} -> {c.after_label}", title_justify="left",
                  header_style="bold", box=box.SIMPLE_HEAD)
    for i, header in enumerate(_header(c)):
        table.add_column(header, justify="left" if i in (0, 6) else "right")
    for s in c.stages:
        table.add_row(*_row(s), style=_VERDICT_STYLE.get(s.verdict, ""))
    return table


def _differences(c: Comparison) -> list[str]:
    lines = []
    if c.env_differences or c.config_differences:
        lines += ["> **The runs differ in their setup** (ratios may reflect it, not the code):",
                  ">"]
        lines += [f"> - {name}: `{a}` vs `{b}`"
                  for name, a, b in [*c.env_differences, *c.config_differences]]
        lines.append("")
    return lines


def grouped_notes(c: Comparison) -> list[str]:
    """Per-stage notes, one line per distinct note ("all stages" when it applies to each)."""
    by_note: dict[str, list[str]] = {}
    for s in c.stages:
        if s.note:
            by_note.setdefault(s.note, []).append(s.stage)
    return [f"{'all stages' if len(names) == len(c.stages) > 1 else ', '.join(names)}: {note}"
            for note, names in by_note.items()]


def _finding_lines(title: str, findings: list[Finding]) -> list[str]:
    if not findings:
        return []
    lines = [f"**{title}** ({len(findings)})", ""]
    lines += [f"- {f.severity} {f.id} {f.stage}: {f.title}"
              + (f" (`{f.location}`)" if f.location else "") for f in findings]
    return [*lines, ""]


def comparison_markdown(c: Comparison) -> str:
    out = [f"## gpudiag compare: {c.before_label} -> {c.after_label}", ""]
    out += _differences(c)
    out += markdown_table(_header(c), [_row(s) for s in c.stages],
                          right=[False, *[True] * 5, False, *[True] * 7])
    out.append("")
    out.append("Throughput ratio is after over before (above 1: faster), with its "
               f"{c.confidence:.0%} interval; "
               "*detectable* is the smallest change this data could detect (80% power). "
               "Intervals pool the trials' own spread with what is known of this machine's "
               "(a calibration, or the device kind's built-in floor); one marked * has a "
               "single trial on a side, so its spread between processes is that prior alone: "
               "compare runs made with `--trials` to measure it.")
    out.append("")
    out.append("*Device time* is kernel time per step from the evidence window (above 1: "
               "less of it); *exact counters* are counted per step and compared exactly.")
    changes = [f"- {s.stage}: {describe_change(ch)}" for s in c.stages
               for ch in s.counter_changes]
    if changes:
        out += ["", "**Exact counters that changed**", "", *changes]
    notes = grouped_notes(c)
    if notes:
        out += ["", *[f"- {line}" for line in notes]]
    out.append("")
    out += _finding_lines("Findings resolved", c.findings_resolved)
    out += _finding_lines("New findings", c.findings_new)
    out += _finding_lines("Findings persisting", c.findings_persisting)
    out += _finding_lines("Seen in some trials of a side only (near their thresholds: neither "
                          "new nor resolved)", c.findings_unsteady)
    return "\n".join(out).rstrip() + "\n"


_HEADLINE = {
    "pass": "PASS: no stage regressed beyond its limits.",
    "regression": "REGRESSION: a stage regressed beyond its limit.",
    "inconclusive": "INCONCLUSIVE: the data cannot tell within the limits.",
    "failed": "FAILED: the head's run broke where the base's ran (exit 5).",
}


def gate_lines(decision: GateDecision, on_inconclusive: OnInconclusive = "pass") -> list[str]:
    """The gate's verdict as plain lines: each instrument's verdict per stage, the exact
    counters that changed and where, what the gate could not see, and new findings."""
    lines = [_HEADLINE[decision.outcome]]
    if decision.measured_nothing:
        lines[0] = (f"NOTHING MEASURED: no stage ran on either side (exit "
                    f"{ExitCode.NOTHING_MEASURED.value}); why is below.")
    elif decision.outcome == "inconclusive":
        lines[0] += (" Passing under --on-inconclusive pass." if on_inconclusive == "pass"
                     else " Failing under --on-inconclusive fail (exit 3).")
    for g in decision.stages:
        more = (f" (about {g.trials_needed} trials per side would tell)"
                if g.trials_needed and g.trials_needed < MAX_PROJECTED and not g.drift else "")
        lines.append(f"  {g.outcome:>12}  {g.stage} [{g.metric}]: {g.reason}{more}")
    if decision.stopped:
        lines.append("Trials:")
        lines += [f"  {line}" for line in decision.stopped]
    gated = {(g.stage, g.metric) for g in decision.stages}
    ungated = [(stage, c) for stage, c in decision.changes if (stage, c.name) not in gated]
    if ungated:
        lines.append("Exact counters that changed (no limit set on them; reported, not gated):")
        lines += [f"  {stage}: {describe_change(c)}" for stage, c in ungated]
    if decision.unseen:
        lines.append("What this gate could not see:")
        lines += [f"  {line}" for line in decision.unseen]
    if decision.priors:
        lines.append("Between-process spread (the prior, and pooled with these trials):")
        lines += [f"  {line}" for line in decision.priors]
    if decision.new_findings:
        # Without a regression they explain nothing: one run's finding near its threshold
        # can be absent from the next (an A/A gate of nanoGPT listed a GD703 at 12%).
        lines.append("New findings since the baseline (likely causes):"
                     if decision.outcome in ("regression", "failed") else
                     "New findings since the baseline (no regression to explain: findings near "
                     "a threshold come and go between runs of the same code):")
        lines += [f"  {f.severity} {f.id} {f.stage}: {f.title}"
                  + (f" at {f.location}" if f.location else "") for f in decision.new_findings]
    return lines


def gate_round_line(decision: GateDecision, per_side: int, wanted: int) -> str:
    """`gate --base-ref`'s progress after a round: each timed instrument's verdict so far, and
    whether it goes on."""
    states = ", ".join(f"{g.stage} {g.metric} time {g.outcome}" for g in decision.stages
                       if g.metric in TIME_METRICS)
    return (f"gate: {per_side} a side: {states}"
            + (f"; going to {wanted}" if wanted > per_side else "; stopping"))


STOPPED_BY = {129: "SIGHUP (the terminal or connection closed)", 130: "SIGINT (Ctrl-C)",
              143: "SIGTERM (a CI job's timeout, or kill)"}


def stopped_gate_markdown(exit_code: int, base_trials: int, head_trials: int) -> str:
    """gate.md of a gate stopped before it decided: what stopped it and what it had."""
    by = STOPPED_BY.get(exit_code, f"a signal (exit {exit_code})")
    return (f"## gpudiag gate: STOPPED\n\nStopped by {by} after {base_trials} base and "
            f"{head_trials} head trial(s), before it decided: no verdict (exit {exit_code}). "
            "The trials that finished are in base/ and head/ beside this file.\n")


def gate_markdown(decision: GateDecision, c: Comparison,
                  on_inconclusive: OnInconclusive = "pass") -> str:
    title = "NOTHING MEASURED" if decision.measured_nothing else decision.outcome.upper()
    out = [f"## gpudiag gate: {title}", "", "```",
           *gate_lines(decision, on_inconclusive), "```", ""]
    return "\n".join(out) + comparison_markdown(c)
