"""`gpudiag run --trials N` (gpudiag/measure/trialrun.py): how it ends when no trial wrote a
run."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from gpudiag.measure.interrupts import Terminated
from gpudiag.model.errors import NothingMeasured
from gpudiag.model.options import RunOptions


@pytest.mark.parametrize(("stopped_by", "raised"), [
    (signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated), (None, NothingMeasured)])
def test_trials_that_wrote_nothing_end_as_interrupted_or_nothing_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped_by: int | None,
        raised: type[BaseException]) -> None:
    """No trial wrote a run (Ctrl-C while the first was starting, or every trial failed):
    an interruption stays one (130/143), a failure is 'nothing measured' (4), never a
    RuntimeError traceback with the regression code."""
    from gpudiag.measure import trialrun

    monkeypatch.setattr(trialrun.subprocess, "Popen", lambda *a, **k: None)
    monkeypatch.setattr(trialrun, "wait_child",
                        lambda _: (128 + stopped_by if stopped_by else 1, stopped_by))
    with pytest.raises(raised) as caught:
        trialrun.run_trials(RunOptions(), tmp_path, 2)
    assert type(caught.value) is raised
