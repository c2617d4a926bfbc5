"""The rule registry: a rule is declared data (code, name, concern, thresholds, why, fix) plus a
pure check of a RunResult. Rule modules register themselves when imported."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gpudiag.diagnose.ledger import Prices, account_findings, rank
from gpudiag.model.results import SEVERITY_RANK, Finding, RunResult, Severity

Check = Callable[[RunResult], Iterator["Draft"]]


@dataclass(frozen=True)
class Threshold:
    name: str
    value: float
    why: str


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    concern: str
    summary: str  # one line: what it detects
    why: str  # why it matters
    fix: str  # the general remedy; findings carry the specific one
    prices: Prices  # which part of a profiled stage's accounts its impact is a share of
    thresholds: tuple[Threshold, ...]
    references: tuple[str, ...]
    check: Check

    def limit(self, name: str) -> float:
        return next(t.value for t in self.thresholds if t.name == name)


@dataclass
class Draft:
    """What a check yields; the registry turns it into a Finding with the rule's id and name."""

    severity: Severity
    stage: str | None
    title: str
    evidence: dict[str, Any]
    impact: float
    fix: str
    location: str | None = None


_RULES: dict[str, Rule] = {}


def rule(code: str, name: str, *, concern: str, summary: str, why: str, fix: str,
         prices: Prices, thresholds: tuple[Threshold, ...] = (),
         references: tuple[str, ...] = ()) -> Callable[[Check], Check]:
    """Register a check as rule `code`. `prices` has no default: a rule says which part of a
    profiled stage's accounts its findings price (gpudiag/diagnose/ledger.py), or why none,
    so no rule that prices time is left out of the waterfalls unseen."""

    def register(check: Check) -> Check:
        if code in _RULES or any(r.name == name for r in _RULES.values()):
            raise ValueError(f"rule {code} {name} registered twice")
        _RULES[code] = Rule(code=code, name=name, concern=concern, summary=summary, why=why,
                            fix=fix, prices=prices, thresholds=thresholds,
                            references=references, check=check)
        return check

    return register


def all_rules() -> list[Rule]:
    """Every registered rule (importing gpudiag.diagnose registers the built-in ones)."""
    return sorted(_RULES.values(), key=lambda r: r.code)


def find_rule(key: str) -> Rule | None:
    """By code (GD101, case-insensitive) or kebab name."""
    return next((r for r in all_rules() if key.upper() == r.code or key == r.name), None)


def evaluate(run: RunResult) -> list[Finding]:
    """Every rule over the run; findings ranked most severe, then most impact, first."""
    findings: list[Finding] = []
    for r in all_rules():
        for draft in r.check(run):
            findings.append(Finding(id=r.code, rule=r.name, **dataclasses.asdict(draft)))
    findings.sort(key=lambda f: (SEVERITY_RANK[f.severity], f.impact), reverse=True)
    account_findings(run, findings, {r.code: r.prices for r in _RULES.values()})
    rank(run, findings)
    return findings


def severity_for(impact: float, *, warning: float, critical: float = 1.1,
                 cap: Severity = "critical") -> Severity:
    """info below `warning`, critical from `critical`; never above `cap`."""
    level: Severity = ("critical" if impact >= critical else
                       "warning" if impact >= warning else "info")
    return level if SEVERITY_RANK[level] <= SEVERITY_RANK[cap] else cap
