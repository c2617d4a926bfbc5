"""The input pipeline: waiting for data, pageable and unoverlapped host-to-device copies."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass

from gpudiag.diagnose.common import data_wait_share, on_gpu, pct
from gpudiag.diagnose.host import HostLineTime, step_account
from gpudiag.diagnose.ledger import LoopParts, StepPart, device_time
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.diagnose.timeline import stage_account
from gpudiag.model.facts import LoaderUse
from gpudiag.model.results import SEVERITY_RANK, RunResult, Severity, StageResult

WAIT_WARNING, WAIT_CRITICAL = 0.10, 0.30
# Below either floor a data wait is information, whatever its share of a short step: a batch
# handed over by a worker process costs about this much itself (issue 55: 0.1-0.2 ms batches
# of an in-memory TensorDataset took 6x longer with workers), and waits adding up to this
# little of the training loop are not worth a change.
MIN_WAIT_MS = 1.0
MIN_LOOP_SHARE = 0.02
# The functions a sample charged to the script's own dataset code runs in: time there is the
# script's per-sample work, which workers can run in parallel.
DATASET_METHODS = ("__getitem__", "__getitems__", "__iter__", "__next__", "collate_fn")
# What the DataLoader does where it fetches on the training thread with no dataset code of
# the script's or of a library's, and what to do instead.
BATCHED = ("indexing in-memory tensors one sample at a time and collating them. Workers add a "
           "process hand-off per batch instead; index whole batches: DataLoader(dataset, "
           "sampler=BatchSampler(RandomSampler(dataset), batch_size, drop_last=False), "
           "batch_size=None) indexes a TensorDataset once per batch, or slice the tensors in "
           "the loop (`x[perm[i:i + batch_size]]`).")
DATA_LINE_SHARE = 0.05  # of the step, in the data wait's host samples: the line is named
PAGEABLE_WARNING = 0.02
COPY_MIN_SHARE, COPY_MIN_OVERLAP = 0.05, 0.5


RESTART_INFO, MIN_PASSES = 0.03, 2
SYMPTOM_RANK = 0.99  # GD201's impact, of GD204's, when restarting workers explain the wait


@dataclass
class Restarts:
    """A training DataLoader whose workers start and stop with every pass over it."""

    loader: LoaderUse
    restarts: int  # passes after the first
    # A pass's start, the previous one's end, and the waits of its first batches (one from
    # each new worker) beyond the usual wait.
    ms_per_restart: float
    usual_wait_ms: float  # a batch's wait from workers already running
    loop_ms: float | None  # the training loop's wall time (start-up, window, exit apart)
    wall_ms: float | None  # the run's

    @property
    def total_ms(self) -> float:
        return self.ms_per_restart * self.restarts

    @property
    def loop_share(self) -> float:
        return min(1.0, self.total_ms / self.loop_ms) if self.loop_ms else 0.0


def worker_restarts(stage: StageResult) -> Restarts | None:
    """The training loader of a profiled script that starts its workers anew every pass
    (num_workers > 0 without persistent_workers), passed over at least twice."""
    script = stage.facts.script
    timeline = script.timeline if script is not None else None
    if script is None or timeline is None:
        return None
    waits = timeline.data_wait_ms
    for use in script.loaders:
        workers = use.settings.num_workers
        if (not use.training or workers <= 0 or use.settings.persistent_workers
                or use.passes < MIN_PASSES):
            continue
        # A pass's first `workers` batches come from workers just started (each makes its
        # first batch); its first step's wait also holds the pass's start and the previous
        # pass's end (the recorder counts both as the loader's time). Later batches wait as
        # a kept worker would: the usual wait.
        first = [range(e.step, min(e.step + min(e.batches, workers), len(waits)))
                 for e in use.epochs]
        warming = {i for steps in first for i in steps}
        usual = statistics.median([w for i, w in enumerate(waits) if i not in warming
                                   and i > 0] or [0.0])
        per = [sum(max(0.0, waits[i] - usual) for i in steps) for steps in first[1:] if steps]
        if not per:
            continue
        whole = stage_account(stage)
        return Restarts(use, use.passes - 1, statistics.fmean(per), usual,
                        whole.loop_ms if whole is not None else None,
                        whole.wall_ms if whole is not None else None)
    return None


def restarts_severity(found: Restarts) -> Severity:
    """Graded on the training loop, whatever the start-up's share of a short run."""
    return severity_for(found.loop_share, warning=WAIT_WARNING, critical=WAIT_CRITICAL)


def _loader_line(use: LoaderUse) -> str:
    """Where its settings are made: the script's DataLoader(...) line, or a framework's."""
    if use.framework == "transformers":
        return ("TrainingArguments(..., dataloader_persistent_workers=True)"
                + (f" at {use.edit_at}" if use.edit_at else ""))
    if use.hook is not None:
        return f"DataLoader(..., persistent_workers=True) in {use.hook}()"
    return "DataLoader(..., persistent_workers=True)" + (f" at {use.site}" if use.site else "")


@rule(
    "GD204", "loader-worker-restarts", concern="input",
    summary="The training DataLoader starts and stops its worker processes every epoch.",
    why=("Without persistent_workers, each `for batch in loader` starts num_workers new "
         "processes (each gets a copy of the dataset and imports what it needs), waits for "
         "their first batch, and shuts them down when the pass ends. With short epochs that is "
         "most of the loop; more workers make it worse."),
    fix=("DataLoader(..., persistent_workers=True) where the loader is built (transformers: "
         "TrainingArguments(dataloader_persistent_workers=True)); the workers then live for the "
         "whole run and only reset between passes."),
    prices=LoopParts(("data",)),
    thresholds=(Threshold("min_passes", MIN_PASSES, "a loader passed over once restarts never"),
                Threshold("info_share", RESTART_INFO, "of the training loop, reported at all"),
                Threshold("warning_share", WAIT_WARNING, "a tenth of the loop"),
                Threshold("critical_share", WAIT_CRITICAL, "the restarts set the loop's pace")),
    references=("https://pytorch.org/docs/stable/data.html#torch.utils.data.DataLoader "
                "(persistent_workers)",),
)
def loader_worker_restarts(run: RunResult) -> Iterator[Draft]:
    """A profiled script's training loader with workers and no persistent_workers, passed over
    at least twice: each later pass's start, the previous pass's end, and the waits of its
    first batch from each new worker beyond the usual wait, measured in the script; priced as
    a share of the training loop (the run's wall less start-up, gpudiag's window and the
    exit): what persistent workers save, which still make each pass's first batches at the
    usual wait."""
    for stage in run.ok_stages():
        found = worker_restarts(stage)
        if found is None or found.loop_share < RESTART_INFO:
            continue
        use = found.loader
        wall_share = min(1.0, found.total_ms / found.wall_ms) if found.wall_ms else 0.0
        yield Draft(
            severity=restarts_severity(found),
            stage=stage.name, location=use.edit_at or use.site,
            title=(f"The training DataLoader{f' at {use.site}' if use.site else ''} restarts its "
                   f"{use.settings.num_workers} workers on each of {use.passes} passes: "
                   f"{found.ms_per_restart:.0f} ms each time, {found.total_ms:,.0f} ms in all, "
                   f"{pct(found.loop_share)} of the training loop "
                   f"({pct(wall_share)} of the run)"),
            impact=found.loop_share,
            evidence={"num_workers": use.settings.num_workers, "persistent_workers": False,
                      "passes": use.passes, "batches_per_pass": use.epochs[0].batches,
                      "ms_per_restart": round(found.ms_per_restart, 1),
                      "start_ms_median": round(statistics.median(
                          e.start_ms for e in use.epochs[1:]), 1),
                      "end_ms_median": round(statistics.median(
                          e.end_ms for e in use.epochs[:-1]), 1),
                      "first_batch_ms_median": round(statistics.median(
                          e.first_batch_ms for e in use.epochs[1:]), 1),
                      "usual_wait_ms": round(found.usual_wait_ms, 2),
                      "restarts_ms": round(found.total_ms, 1),
                      "loop_ms": None if found.loop_ms is None else round(found.loop_ms, 1),
                      "loop_share": round(found.loop_share, 4),
                      "built_at": use.site, "iterated_at": use.iterated_at,
                      "price": "measured: each pass's start, the previous pass's end, and its "
                               "first batches' waits beyond the usual wait"},
            fix=(f"{_loader_line(use)}: the workers are started once and reset between passes "
                 f"instead of {found.restarts} restarts. `gpudiag profile --try-fixes` "
                 "measures it on this script."))


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
    prices=StepPart("data"),
    thresholds=(Threshold("warning_share", WAIT_WARNING, "a tenth of the step waiting for data"),
                Threshold("critical_share", WAIT_CRITICAL, "the loader sets the pace"),
                Threshold("line_share", DATA_LINE_SHARE,
                          "a line holding this share of the step in the data wait's host "
                          "samples is named"),
                Threshold("symptom_rank", SYMPTOM_RANK,
                          "workers restarting every pass (GD204) explain the wait: it ranks "
                          "just below that finding"),
                Threshold("restart_min_passes", MIN_PASSES, "GD204's, passes that restart"),
                Threshold("min_wait_ms", MIN_WAIT_MS,
                          "a median wait per step below this is information: a worker's "
                          "hand-off of one batch costs about as much"),
                Threshold("min_loop_share", MIN_LOOP_SHARE,
                          "waits adding up to less of the training loop are information")),
    references=("https://pytorch.org/docs/stable/data.html#multi-process-data-loading",
                "https://pytorch.org/docs/stable/data.html#disable-automatic-batching "
                "(a BatchSampler as sampler, batch_size=None: one index per batch)"),
)
def input_bound(run: RunResult) -> Iterator[Draft]:
    """Median data wait at least 10% of the median step; at the line the wait's host samples
    land on most, where a profiled script has them. Information only below MIN_WAIT_MS per
    step or MIN_LOOP_SHARE of the training loop. More workers are not advised where the wait
    is the DataLoader's own fetching on the training thread (no dataset code of the script's
    or of another library: indexing in-memory tensors and collating them), nor where
    --try-fixes measured workers slower."""
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
        restarts = worker_restarts(stage)
        loop_share = _loop_share(stage)
        severity = severity_for(share, warning=WAIT_WARNING, critical=WAIT_CRITICAL)
        if wait < MIN_WAIT_MS or (loop_share is not None and loop_share < MIN_LOOP_SHARE):
            severity = "info"
        impact = share
        if restarts is not None:  # the cause: this wait never ranks above its finding
            restart_share = restarts.loop_share
            impact = min(share, restart_share) * SYMPTOM_RANK
            severity = min(severity, restarts_severity(restarts), key=SEVERITY_RANK.__getitem__)
        knob = ("" if restarts is None else
                f"Its workers restart every pass (GD204): first {_loader_line(restarts.loader)}; "
                "then ")
        yield Draft(
            severity=severity, stage=stage.name,
            title=(f"Waiting {wait:.1f} ms per step for data ({pct(share)} of the step)"
                   + ("; its workers restart every pass (see GD204)" if restarts else "")),
            location=None if line is None else line.location,
            impact=impact,
            evidence={"data_wait_ms": round(wait, 2), "step_ms": stage.ms_per_iter,
                      "share": round(share, 3), "num_workers": workers,
                      "pin_memory": None if loader is None else loader.pin_memory,
                      "prefetch_factor": None if loader is None else loader.prefetch_factor,
                      "line_ms_per_step": None if line is None else round(line.ms("data"), 2),
                      "loop_share": None if loop_share is None else round(loop_share, 4)},
            fix=where + (knob or "") + _advice(run, stage, line, workers, bool(knob)),
        )


def _loop_share(stage: StageResult) -> float | None:
    """Every step's data wait, as a share of the training loop (None: no timeline)."""
    script = stage.facts.script
    whole = stage_account(stage)
    if script is None or script.timeline is None or whole is None or not whole.loop_ms:
        return None
    waits, steps = script.timeline.data_wait_ms, script.timeline.steps
    # Past the timeline's listed steps waits are only counted: as many again as listed.
    listed = sum(waits) * max(1.0, steps / len(waits)) if waits else 0.0
    return listed / whole.loop_ms


def _advice(run: RunResult, stage: StageResult, line: HostLineTime | None,
            workers: int | None, after: bool) -> str:
    """What to change: more workers and their settings, unless the wait is the DataLoader's
    own in-process fetching or --try-fixes measured workers slower; then what the loader
    does instead. `after`: it follows GD204's knob (lower case)."""
    slower = _workers_measured_slower(run)
    in_process = (workers == 0 and line is not None and not line.via
                  and line.function not in DATASET_METHODS)
    if in_process:
        measured = f"--try-fixes measured workers slower ({slower:.2f}x); " if slower else ""
        text = (f"{measured}The wait is the DataLoader's own fetching on the training thread "
                f"(no dataset code of the script's or of a library's runs in it): {BATCHED}")
    elif slower is not None:
        text = (f"--try-fixes measured workers slower ({slower:.2f}x): keep num_workers as it "
                "is; its batches cost less to make on the training thread than to hand over "
                "from worker processes. Precompute or cache per-sample work the dataset "
                "repeats every epoch, or index whole batches (a BatchSampler as sampler, "
                "batch_size=None).")
    else:
        text = (f"Give the DataLoader more workers ({_workers_now(workers)}), "
                + ("pin_memory=True, " if on_gpu(run, stage) else "")
                + "persistent_workers=True and prefetch_factor>=2; precompute or cache "
                "per-sample work the dataset repeats every epoch.")
    return text[0].lower() + text[1:] if after else text


def _workers_measured_slower(run: RunResult) -> float | None:
    """The loader remedy's measured speedup where --try-fixes found it slower (its interval
    below 1, or its estimate where there is none), else None."""
    return next((f.speedup for f in run.fixes if f.remedy == "loader"
                 and f.status == "measured" and f.speedup is not None
                 and (f.speedup_high if f.speedup_high is not None else f.speedup) < 1.0),
                None)


@rule(
    "GD202", "pageable-copies", concern="input",
    summary="Host-to-device copies from pageable (unpinned) memory.",
    why=("A copy from pageable memory is staged through a driver buffer and cannot run "
         "asynchronously: non_blocking=True has no effect, and the host waits for it."),
    fix="pin_memory=True in the DataLoader (or tensor.pin_memory()), then .to(device, "
        "non_blocking=True).",
    prices=device_time("the copies from pageable memory, as the profiler window times them"),
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
    prices=device_time("the copies no kernel overlaps"),
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
