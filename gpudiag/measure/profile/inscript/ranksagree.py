"""The ranks of a job close their profiler windows after the same step. Each rank's window has
a budget (model/config.py, WINDOW_BUDGET_S), which its own host time spends: left to itself, a
rank would close its window a step before another, and closing (torch's collection and
export, seconds) would hold it from the next all-reduce while the other, still profiled,
waited for it there, which reads as communication or a straggler. So at the end of each
profiled step every rank votes, in a file in the parts folder its ranks on this machine share,
and the window goes on only where every rank wants it to.

A vote that does not come (a rank on another machine, whose parts folder is its own; a rank
that ended) is waited for VOTE_TIMEOUT_S; then every rank, having waited alike, profiles its
steps whole, as all did before the budget."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from gpudiag.measure.profile.protocol import window_vote_name
from gpudiag.model.atomic import write_text_atomic

VOTE_TIMEOUT_S = 30.0
_POLL_S = 0.001  # ranks reach a step's end within milliseconds of each other (its all-reduce)


def window_goes_on(folder: Path, step: int, rank: int, world: int, wants: bool,
                   timeout_s: float = VOTE_TIMEOUT_S) -> bool | None:
    """Whether every rank of `world` wants a further profiled step after `step`, `wants`
    being this rank's vote; None where a vote did not come within `timeout_s`."""
    write_text_atomic(folder / window_vote_name(step, rank), "1" if wants else "0")
    deadline = time.monotonic() + timeout_s
    votes: dict[int, bool] = {}
    while True:
        for other in range(world):
            if other not in votes:
                with contextlib.suppress(FileNotFoundError):  # not yet voted
                    votes[other] = (folder / window_vote_name(step, other)).read_text() == "1"
        if len(votes) == world:
            return all(votes.values())
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
