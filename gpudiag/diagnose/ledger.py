"""One accounting of a profiled stage: every finding that prices time prices a part of one
whole. The run's wall time (gpudiag/diagnose/timeline.py) holds its start-up, its training
loop (steady steps, saves, periodic work, stalls), gpudiag's window and its exit; a steady
step (gpudiag/diagnose/host.py) holds its syncs, torch calls, DataLoader waits and host-only
work. A finding prices a share of the step or of the training loop (what a fix in the loop
can save, start-up apart), and each is also a share of the run's wall (times the steady
steps', or the loop's, share of it), so every finding of a stage carries its share of the
same wall, and those of different parts add up to at most all of it.

Each rule declares what it prices where it is declared (`@rule(..., prices=...)`): a part of
the step, a part of the training loop, nothing as the symptom of a cause another finding prices
(GD102's idle GPU, explained by a Python loop or host-only work: not counted twice), or no
part, saying why (the device's time, which the step's host account does not split; a risk).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

from gpudiag.diagnose.host import KIND_LABELS, StepAccount, step_account
from gpudiag.diagnose.timeline import (
    WORK_LABELS,
    RunAccount,
    WorkKind,
    describe,
    stage_account,
)
from gpudiag.diagnose.trials import steady_state
from gpudiag.model.facts import HostKind
from gpudiag.model.results import SEVERITY_RANK, Finding, FindingAccount, RunResult, StageResult

Whole = Literal["step", "loop"]


# What a rule prices, declared on the rule itself (`@rule(..., prices=...)`,
# gpudiag/diagnose/registry.py): the ledger reads each finding's declaration, so a new rule
# cannot be left out of the waterfalls by a list kept here.

@dataclass(frozen=True)
class StepPart:
    """Its impact is a share of the steady step: the step account's host work of `kind`."""

    kind: HostKind
    whole: ClassVar[Whole] = "step"

    def part(self, books: Ledger, finding: Finding) -> str:
        return self.kind

    def says(self) -> str:
        return (f"A share of a profiled script's steady step, its part "
                f"{KIND_LABELS[self.kind]!r} in the step's waterfall; through the steady "
                "steps' share of the run, also a share of the run's wall time.")


@dataclass(frozen=True)
class LoopParts:
    """Its impact is a share of the training loop: the run account's periodic work of one of
    `kinds` (the one at the finding's location, where several are)."""

    kinds: tuple[WorkKind, ...]
    whole: ClassVar[Whole] = "loop"

    def __post_init__(self) -> None:
        if not self.kinds:
            raise ValueError("a share of the training loop names the work it prices")

    def part(self, books: Ledger, finding: Finding) -> str:
        """The run account's part a run-priced finding names: its work's description."""
        works = books.whole.works if books.whole is not None else []
        candidates = [describe(w) for w in works if w.kind in self.kinds]
        named = [c for c in candidates if finding.location is not None and finding.location in c]
        return (named or candidates or [self.kinds[0]])[0]

    def says(self) -> str:
        work = " or ".join(WORK_LABELS[kind] for kind in self.kinds)
        return (f"A share of a profiled script's training loop, its part for {work} in the "
                "waterfall of the run's wall time (and so a share of that wall time).")


@dataclass(frozen=True)
class Symptom:
    """A symptom whose cause a finding of one of the rules `causes` names and prices: this one
    prices no part of its own (the time is not counted twice)."""

    causes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.causes:
            raise ValueError("a symptom names the rules that price its cause")

    def says(self) -> str:
        return (f"No part of its own: a symptom, priced by the cause it names "
                f"({', '.join(self.causes)}), so never counted twice.")


@dataclass(frozen=True)
class NoPart:
    """Its impact is no part of a profiled stage's accounts, for the reason `why`."""

    why: str

    def __post_init__(self) -> None:
        if not self.why.strip():
            raise ValueError("a rule that prices no part of the accounts says why")

    def says(self) -> str:
        return f"No part of a profiled script's waterfalls: {self.why}."


Prices = StepPart | LoopParts | Symptom | NoPart


def device_time(what: str) -> NoPart:
    """A price in the device's time, which the steady step's account (what the host's
    training thread did) does not split."""
    return NoPart(f"{what}, device time the step's account of host work does not split")


@dataclass
class Ledger:
    """A stage's two accounts: the run's wall (when its timeline was recorded) and the
    steady step (when its host samples were)."""

    step: StepAccount | None
    whole: RunAccount | None

    @property
    def steps_share(self) -> float | None:
        """The share of the run's wall time its ordinary steps' own work took."""
        return None if self.whole is None else self.whole.share(self.whole.steady_ms)

    def wall_share(self, whole: Whole, share: float) -> float | None:
        if whole == "loop":
            return (None if self.whole is None
                    else share * self.whole.loop_ms / self.whole.wall_ms if self.whole.wall_ms
                    else 0.0)
        steps = self.steps_share
        return None if steps is None else share * steps


def ledger(stage: StageResult) -> Ledger | None:
    step, whole = step_account(stage), stage_account(stage)
    return None if step is None and whole is None else Ledger(step, whole)


def account_findings(run: RunResult, findings: list[Finding],
                     prices: Mapping[str, Prices]) -> None:
    """Each finding that prices a part of its stage's account (its rule's declaration, by code
    in `prices`) says which, and its share of the step and of the run's wall time
    (`Finding.account`)."""
    ledgers: dict[str, Ledger | None] = {}
    for finding in findings:
        declared = prices[finding.id]
        stage = run.stage(finding.stage) if finding.stage is not None else None
        if not isinstance(declared, (StepPart, LoopParts)) or stage is None \
                or finding.impact <= 0:
            continue
        if stage.name not in ledgers:
            ledgers[stage.name] = ledger(stage)
        books = ledgers[stage.name]
        if books is None:
            continue
        wall = books.wall_share(declared.whole, finding.impact)
        finding.account = FindingAccount(
            part=declared.part(books, finding), whole=declared.whole,
            share=round(finding.impact, 4),
            share_of_wall=None if wall is None else round(wall, 4),
            ms_per_step=round(finding.impact * books.step.step_ms, 2)
            if declared.whole == "step" and books.step is not None else None)


def rank(run: RunResult, findings: list[Finding]) -> None:
    """Most severe first, then by what each costs of one whole, the run's wall: a share of the
    step and one of the training loop are not comparable as they stand (a steady step's idle
    GPU is a small part of a loop that mostly restarts DataLoader workers)."""
    ledgers: dict[str, Ledger | None] = {}

    def of_wall(finding: Finding) -> float:
        if finding.account is not None and finding.account.share_of_wall is not None:
            return finding.account.share_of_wall
        stage = run.stage(finding.stage) if finding.stage is not None else None
        if stage is None:
            return finding.impact
        if stage.name not in ledgers:
            ledgers[stage.name] = ledger(stage)
        books = ledgers[stage.name]
        steps = books.steps_share if books is not None else None
        return finding.impact if steps is None else finding.impact * steps

    findings.sort(key=lambda f: (SEVERITY_RANK[f.severity], of_wall(f)), reverse=True)


def findings_by_part(run: RunResult, stage: StageResult) -> dict[str, list[str]]:
    """Part -> the codes of the findings that price it (step parts by host kind, run parts by
    their description), for the waterfalls."""
    found: dict[str, list[str]] = defaultdict(list)
    for finding in run.findings:
        entry = finding.account
        if finding.stage == stage.name and entry is not None \
                and finding.id not in found[entry.part]:
            found[entry.part].append(finding.id)
    return dict(found)


def timed_shares(run: RunResult) -> dict[str, float]:
    """Each finding's price on the basis `--try-fixes` measures a fix's saving on: the mean
    timed step, periodic saves and evaluations in it (gpudiag/diagnose/tryfix.py,
    `measured_fix`). A share of the training loop is that as it stands; a share of the steady
    step (any other price) counts only for the steady step's share of the mean one (the
    median timed step over the mean): on a script that saves every 5 steps, TF32's 77% of the
    steady step was 47% of the mean step, as measured. By rule code, the largest where a rule
    found several."""
    ordinary = {stage.name: _steady_over_mean(stage) for stage in run.stages}
    found: dict[str, float] = {}
    for finding in run.findings:
        share = finding.impact
        if finding.account is None or finding.account.whole == "step":
            share *= ordinary.get(finding.stage or "", 1.0)
        found[finding.id] = max(found.get(finding.id, 0.0), share)
    return found


def _steady_over_mean(stage: StageResult) -> float:
    steps = steady_state(stage.iter_ms)
    mean = statistics.fmean(steps) if steps else 0.0
    return min(1.0, statistics.median(steps) / mean) if mean > 0 else 1.0


def wall_shares(run: RunResult, stage: StageResult) -> dict[str, float]:
    """Finding code -> its share of the stage's run wall time (a symptom has no account: its
    cause carries the price); the parts these price are disjoint, so they add up to <= 1."""
    shares: dict[str, float] = {}
    for finding in run.findings:
        entry = finding.account
        if finding.stage != stage.name or entry is None:
            continue
        if entry.share_of_wall is not None:
            shares[finding.id] = shares.get(finding.id, 0.0) + entry.share_of_wall
    return shares
