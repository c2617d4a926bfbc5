"""One accounting of a profiled stage: every finding that prices time prices a part of one
whole. The run's wall time (gpudiag/diagnose/timeline.py) holds its start-up, its training
loop (steady steps, saves, periodic work, stalls), gpudiag's window and its exit; a steady
step (gpudiag/diagnose/host.py) holds its syncs, torch calls, DataLoader waits and host-only
work. A finding prices a share of the step or of the training loop (what a fix in the loop
can save, start-up apart), and each is also a share of the run's wall (times the steady
steps', or the loop's, share of it), so every finding of a stage carries its share of the
same wall, and those of different parts add up to at most all of it.

A finding that names a symptom of another's cause (GD102's idle GPU, explained by a Python
loop or host-only work) prices the same part as its cause: it is not counted twice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from gpudiag.diagnose.host import StepAccount, step_account
from gpudiag.diagnose.timeline import RunAccount, describe, stage_account
from gpudiag.model.facts import HostKind
from gpudiag.model.results import SEVERITY_RANK, Finding, FindingAccount, RunResult, StageResult

Whole = Literal["step", "loop"]

# The part of its stage's account each time-pricing rule's impact is a share of.
STEP_PARTS: dict[str, HostKind] = {
    "GD101": "torch",  # a Python loop's launches
    "GD103": "sync",  # device syncs
    "GD105": "python",  # host-only work by line
    "GD106": "torch",  # the optimizer's per-tensor step (its own line: not a loop's)
    "GD201": "data",  # waiting for the DataLoader
}
RUN_PARTS: dict[str, tuple[str, ...]] = {
    "GD204": ("data",),  # the training DataLoader's stalls: its workers restarting
    "GD701": ("save",),  # checkpoint saves
    "GD703": ("loop", "other"),  # periodic work that is not a save
    "GD901": ("compile",),  # torch.compile's recompilations
}
SYMPTOMS = frozenset({"GD102"})  # priced by the cause its finding names


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


def account_findings(run: RunResult, findings: list[Finding]) -> None:
    """Each finding that prices a part of its stage's account says which, and its share of
    the step and of the run's wall time (`Finding.account`)."""
    ledgers: dict[str, Ledger | None] = {}
    for finding in findings:
        whole: Whole | None = ("step" if finding.id in STEP_PARTS else
                               "loop" if finding.id in RUN_PARTS else None)
        stage = run.stage(finding.stage) if finding.stage is not None else None
        if whole is None or stage is None or finding.impact <= 0:
            continue
        if stage.name not in ledgers:
            ledgers[stage.name] = ledger(stage)
        books = ledgers[stage.name]
        if books is None:
            continue
        wall = books.wall_share(whole, finding.impact)
        finding.account = FindingAccount(
            part=STEP_PARTS[finding.id] if whole == "step" else _run_part(books, finding),
            whole=whole, share=round(finding.impact, 4),
            share_of_wall=None if wall is None else round(wall, 4),
            ms_per_step=round(finding.impact * books.step.step_ms, 2)
            if whole == "step" and books.step is not None else None)


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


def _run_part(books: Ledger, finding: Finding) -> str:
    """The run account's part a run-priced finding names: its work's description."""
    works = books.whole.works if books.whole is not None else []
    kinds = RUN_PARTS[finding.id]
    candidates = [describe(w) for w in works if w.kind in kinds]
    named = [c for c in candidates if finding.location is not None and finding.location in c]
    return (named or candidates or [kinds[0]])[0]


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


def wall_shares(run: RunResult, stage: StageResult) -> dict[str, float]:
    """Finding code -> its share of the stage's run wall time (symptoms left out: their
    cause carries the price); the parts these price are disjoint, so they add up to <= 1."""
    shares: dict[str, float] = {}
    for finding in run.findings:
        entry = finding.account
        if finding.stage != stage.name or finding.id in SYMPTOMS or entry is None:
            continue
        if entry.share_of_wall is not None:
            shares[finding.id] = shares.get(finding.id, 0.0) + entry.share_of_wall
    return shares
