"""Live progress of a run on the terminal: a bar per stage and per evidence window, fed by the
runner's listener calls (gpudiag.measure.runner.ProgressListener)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column as ProgressColumn

from gpudiag.model.results import StageResult


class LiveProgress:
    """Progress bars on stderr, one per stage, fed by the runner's listener calls."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", table_column=ProgressColumn(min_width=15,
                                                                          no_wrap=True)),
            BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[note]}", table_column=ProgressColumn(no_wrap=True)),
            console=console,
        )
        self.tasks: dict[str, TaskID] = {}

    def stage_started(self, name: str, title: str, planned_steps: int) -> None:
        self.tasks[name] = self.progress.add_task(name, total=planned_steps, note="")

    def step_done(self, name: str, done: int) -> None:
        task = self.tasks[name]
        total = self.progress.tasks[task].total or 0
        self.progress.update(task, completed=done, total=max(total, done))

    def stage_finished(self, result: StageResult) -> None:
        task = self.tasks.get(result.name)
        if task is None:
            return
        note = (f"{result.ms_per_iter:.1f} ms/iter" if result.ok and result.ms_per_iter
                else f"{result.status}: {result.error}")
        done = self.progress.tasks[task].total if result.ok else None  # a stop: where it was
        self.progress.update(task, completed=done, note=note)

    def evidence_started(self, name: str) -> None:
        self.tasks[f"evidence {name}"] = self.progress.add_task(
            f"evidence {name}", total=None, note="profiler window")

    def evidence_finished(self, name: str) -> None:
        task = self.tasks[f"evidence {name}"]
        self.progress.update(task, total=1, completed=1, note="done")
