"""The input pipeline: waiting for data, pageable and unoverlapped host-to-device copies."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

from gpudiag.diagnose.common import data_wait_share, on_gpu, pct
from gpudiag.diagnose.host import HostLineTime, step_account
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.results import RunResult, StageResult

WAIT_WARNING, WAIT_CRITICAL = 0.10, 0.30
DATA_LINE_SHARE = 0.05  # of the step, in the data wait's host samples: the line is named
PAGEABLE_WARNING = 0.02
COPY_MIN_SHARE, COPY_MIN_OVERLAP = 0.05, 0.5


def _workers_now(workers: int | None) -> str:
    return (f"now {workers}" if workers is not None
            else "num_workers > 0; gpudiag does not see the script's loader settings")


def _data_line(stage: StageResult) -> HostLineTime | None:
    """Where the data wait's host samples land most: the Dataset's own line when it runs on
    the training thread (num_workers=0), else the loop's `for ... in loader` line."""
    account = step_account(stage)
    lines = account.lines_of("data", min_share=DATA_LINE_SHARE) if account else []
    return lines[0] if lines else None


@rule(
    "GD201", "input-bound", concern="input",
    summary="The step waits for the DataLoader.",
    why=("Time the training loop spends blocked in next(loader) is time the GPU has nothing to "
         "do; no model change helps until the pipeline keeps up."),
    fix=("More DataLoader workers, pin_memory=True, prefetch_factor, persistent_workers=True; "
         "precompute or cache per-sample work the dataset repeats every epoch; move "
         "per-sample CPU work to the GPU as batched tensor ops."),
    thresholds=(Threshold("warning_share", WAIT_WARNING, "a tenth of the step waiting for data"),
                Threshold("critical_share", WAIT_CRITICAL, "the loader sets the pace"),
                Threshold("line_share", DATA_LINE_SHARE,
                          "a line holding this share of the step in the data wait's host "
                          "samples is named")),
    references=("https://pytorch.org/docs/stable/data.html#multi-process-data-loading",),
)
def input_bound(run: RunResult) -> Iterator[Draft]:
    """Median data wait at least 10% of the median step; at the line the wait's host samples
    land on most, where a profiled script has them."""
    for stage in run.ok_stages():
        share = data_wait_share(stage)
        if share < WAIT_WARNING:
            continue
        wait = statistics.median(stage.phases_ms["data_wait"])
        loader = stage.facts.loader
        workers = None if loader is None else loader.num_workers
        line = _data_line(stage)
        where = ""
        if line is not None:
            code = f" (`{line.text}`)" if line.text else ""
            thread = ", on the training thread (num_workers=0)" if workers == 0 else ""
            where = (f"{line.location}{code} holds {line.ms('data'):.1f} ms of each step's "
                     f"wait{thread}. ")
        yield Draft(
            severity=severity_for(share, warning=WAIT_WARNING, critical=WAIT_CRITICAL),
            stage=stage.name,
            title=f"Waiting {wait:.1f} ms per step for data ({pct(share)} of the step)",
            location=None if line is None else line.location,
            impact=share,
            evidence={"data_wait_ms": round(wait, 2), "step_ms": stage.ms_per_iter,
                      "share": round(share, 3), "num_workers": workers,
                      "pin_memory": None if loader is None else loader.pin_memory,
                      "prefetch_factor": None if loader is None else loader.prefetch_factor,
                      "line_ms_per_step": None if line is None else round(line.ms("data"), 2)},
            fix=(f"{where}Give the DataLoader more workers ({_workers_now(workers)}), "
                 + ("pin_memory=True, " if on_gpu(run, stage) else "")
                 + "persistent_workers=True and prefetch_factor>=2; precompute or cache "
                 "per-sample work the dataset repeats every epoch."),
        )


@rule(
    "GD202", "pageable-copies", concern="input",
    summary="Host-to-device copies from pageable (unpinned) memory.",
    why=("A copy from pageable memory is staged through a driver buffer and cannot run "
         "asynchronously: non_blocking=True has no effect, and the host waits for it."),
    fix="pin_memory=True in the DataLoader (or tensor.pin_memory()), then .to(device, "
        "non_blocking=True).",
    thresholds=(Threshold("warning_share", PAGEABLE_WARNING, "2% of the step in pageable copies"),
                Threshold("critical_share", WAIT_CRITICAL, "the copies set the pace")),
)
def pageable_copies(run: RunResult) -> Iterator[Draft]:
    """Any HtoD copy from pageable memory in the profiled steps; warning from 2% of the step."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        count = ev.memcpy_per_step.get("HtoD-pageable", 0.0)
        if count <= 0 or not stage.ms_per_iter:
            continue
        ms = ev.memcpy_ms_per_step.get("HtoD-pageable", 0.0)
        share = ms / stage.ms_per_iter
        yield Draft(
            severity=severity_for(share, warning=PAGEABLE_WARNING, critical=WAIT_CRITICAL),
            stage=stage.name,
            title=f"{count:.0f} host-to-device copies per step from pageable memory ({ms:.2f} ms)",
            impact=share,
            evidence={"pageable_htod_per_step": round(count, 1),
                      "pageable_htod_ms_per_step": round(ms, 3), "share": round(share, 4)},
            fix=("Pin the host batches (DataLoader(pin_memory=True) or tensor.pin_memory()) and "
                 "copy with .to(device, non_blocking=True)."),
        )


@rule(
    "GD203", "copies-not-overlapped", concern="input",
    summary="Host-to-device copies that do not overlap compute.",
    why=("A copy on the compute stream runs between kernels: the GPU computes nothing while it "
         "moves the next batch. Pinned memory plus a separate copy stream hides the copy."),
    fix=("Prefetch batch N+1 on a side CUDA stream (pinned memory, non_blocking=True) while "
         "batch N computes, and make the compute stream wait on an event."),
    thresholds=(Threshold("min_copy_share", COPY_MIN_SHARE, "copies take 5% of the step"),
                Threshold("critical_share", WAIT_CRITICAL, "exposed copies set the pace"),
                Threshold("max_overlap", COPY_MIN_OVERLAP,
                          "less than half of the copy time overlaps")),
    references=("docs/field-cases.md#case-2 (a dual-stream pipelined DataLoader)",
                "https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers"),
)
def copies_not_overlapped(run: RunResult) -> Iterator[Draft]:
    """HtoD copies take at least 5% of the step and under half of that time overlaps a kernel."""
    for stage in run.stages_with_evidence():
        ev = stage.evidence
        assert ev is not None
        htod = sum(ms for kind, ms in ev.memcpy_ms_per_step.items() if kind.startswith("HtoD"))
        overlap = ev.htod_overlap_fraction
        if (not stage.ms_per_iter or overlap is None or overlap >= COPY_MIN_OVERLAP
                or htod / stage.ms_per_iter < COPY_MIN_SHARE):
            continue
        exposed = htod * (1 - overlap) / stage.ms_per_iter
        yield Draft(
            severity=severity_for(exposed, warning=COPY_MIN_SHARE, critical=WAIT_CRITICAL),
            stage=stage.name,
            title=(f"Host-to-device copies take {htod:.2f} ms per step and only {pct(overlap)} "
                   "of it overlaps compute"),
            impact=exposed,
            evidence={"htod_ms_per_step": round(htod, 3), "overlap_fraction": round(overlap, 3)},
            fix=("Copy the next batch on a side stream while this one computes: pinned memory, "
                 "with torch.cuda.stream(copy_stream): batch = batch.to(dev, non_blocking=True); "
                 "then torch.cuda.current_stream().wait_stream(copy_stream)."),
        )
