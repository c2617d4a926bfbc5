"""Host work by line: the user's lines that hold the training thread in Python or numpy, from
the host samples of every steady step (gpudiag/diagnose/host.py)."""

from __future__ import annotations

from collections.abc import Iterator

from gpudiag.diagnose.common import on_gpu, pct
from gpudiag.diagnose.host import HostLineTime, StepAccount, step_account
from gpudiag.diagnose.ledger import StepPart
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.model.facts import HostKind
from gpudiag.model.results import RunResult, Severity, StageResult

LINE_SHARE, INFO_SHARE, WARNING_SHARE, CRITICAL_SHARE = 0.05, 0.05, 0.10, 0.40
MAX_LINES_NAMED = 3
HOST_ONLY: tuple[HostKind, ...] = ("python", "call")

HOST_THRESHOLDS = (
    Threshold("min_line_share", LINE_SHARE,
              "a line holding a twentieth of the step is worth naming; below that, sampling "
              "noise on short runs"),
    Threshold("info_share", INFO_SHARE, "host-only work reported at all"),
    Threshold("warning_share", WARNING_SHARE, "a tenth of the step is worth a code change"),
    Threshold("critical_share", CRITICAL_SHARE, "the host's own work is the step's largest part"),
    Threshold("max_lines_named", MAX_LINES_NAMED, "the fix names this many lines, busiest first"),
)


@rule(
    "GD105", "host-work-by-line", concern="launch",
    summary="Lines of the training loop hold the host in Python or numpy work every step.",
    why=("Work on the training thread that is not a torch call (per-sample augmentation in "
         "numpy, tokenisation, metrics and logging in Python) runs between the step's launches: "
         "on a GPU the device waits for it, on a CPU it competes with the step's own compute. "
         "The profiler window sees only torch operators; the host samples see every line."),
    fix=("Move per-sample preparation into a Dataset and load it with DataLoader(num_workers=N) "
         "so workers do it beside the step, or do it on the whole batch with torch ops; compute "
         "metrics on the device and log them every N steps."),
    prices=StepPart("python"),
    thresholds=HOST_THRESHOLDS,
    references=("gpudiag/measure/profile/inscript/hostsampler.py (how host time is sampled)",),
)
def host_work_by_line(run: RunResult) -> Iterator[Draft]:
    """A profiled script's steady steps, sampled: the lines whose Python/numpy time is at least
    5% of the step each. On a GPU, what it costs is at most the share the GPU idles (host work
    beside a busy GPU is free); without a profiler window's idle share it is information only,
    and so is a framework's own per-step Python (a library's loop, no line of the script below
    it: nothing to edit; a larger batch amortizes it)."""
    for stage in run.ok_stages():
        work = host_only_work(run, stage)
        if work is None:
            continue
        account, lines, share, cost = work
        gpu = on_gpu(run, stage)
        idle = stage.evidence.idle_fraction if stage.evidence is not None else None
        # A framework's loop (Lightning's, HF Trainer's) charges its own lines: no line of the
        # script runs there to edit (Lightning's is_overridden() on a 5 ms CPU step, 11%).
        framework = all(line.library for line in lines)
        severity = "info" if framework else host_severity(run, stage, cost)
        top = lines[0]
        beside = (f" while the GPU idles {pct(idle)} of it" if gpu and idle is not None else
                  " (the GPU's idle time was not measured: no profiler window)" if gpu else "")
        host_ms = sum(line.ms(*HOST_ONLY) for line in lines)
        yield Draft(
            severity=severity, stage=stage.name,
            title=(f"Host-only work (Python, numpy) takes {host_ms:.1f} ms of each "
                   f"{account.step_ms:.1f} ms step ({pct(share)}){beside}; most at "
                   f"{top.location} in {top.function}() ({top.ms(*HOST_ONLY):.1f} ms/step)"),
            location=top.location, impact=min(1.0, cost),
            evidence={**_evidence(account, lines, share, idle if gpu else None),
                      "framework": framework},
            fix=_framework_fix(lines) if framework else _fix(lines, workers_slower(run)))


def host_only_work(run: RunResult, stage: StageResult
                   ) -> tuple[StepAccount, list[HostLineTime], float, float] | None:
    """(the step's account, the lines holding the host in Python or numpy, their share of the
    step, what they cost it) when GD105 has something to say about `stage`; GD102 defers to
    it as it does to a Python loop."""
    account = step_account(stage)
    if account is None:
        return None
    lines = account.lines_of(*HOST_ONLY, min_share=LINE_SHARE)
    share = account.share(sum(line.ms(*HOST_ONLY) for line in lines))
    if not lines or share < INFO_SHARE:
        return None
    idle = stage.evidence.idle_fraction if stage.evidence is not None else None
    cost = min(share, idle) if on_gpu(run, stage) and idle is not None else share
    return account, lines, share, cost


def host_severity(run: RunResult, stage: StageResult, cost: float) -> Severity:
    unmeasured = on_gpu(run, stage) and (stage.evidence is None
                                        or stage.evidence.idle_fraction is None)
    return severity_for(cost, warning=WARNING_SHARE, critical=CRITICAL_SHARE,
                        cap="info" if unmeasured else "critical")


def _evidence(account: StepAccount, lines: list[HostLineTime], share: float,
              idle: float | None) -> dict[str, object]:
    return {"step_ms": round(account.step_ms, 2), "host_only_share": round(share, 3),
            "host_only_ms_per_step": round(sum(x.ms(*HOST_ONLY) for x in lines), 2),
            "gpu_idle_fraction": None if idle is None else round(idle, 3),
            "steps_sampled": account.steps, "samples": account.samples,
            "sample_period_ms": account.period_ms,
            "lines": {x.location: {"ms_per_step": round(x.ms(*HOST_ONLY), 2),
                                   "sampling_error_ms": round(account.error(x.ms(*HOST_ONLY)),
                                                              2),
                                   "share": round(account.share(x.ms(*HOST_ONLY)), 3),
                                   "function": x.function, "source": x.text,
                                   "via": x.via} for x in lines}}


def workers_slower(run: RunResult) -> float | None:
    """The speedup --try-fixes measured for more DataLoader workers, where it was a slowdown
    (the script's batches cost less to make on the training thread than to hand over)."""
    return next((f.speedup for f in run.fixes if f.remedy == "loader" and f.status == "measured"
                 and not f.changed_nothing and f.speedup is not None and f.speedup < 1.0), None)


def _framework_fix(lines: list[HostLineTime]) -> str:
    named = "; ".join(f"{x.location} in {x.function}() {x.ms(*HOST_ONLY):.1f} ms/step"
                      for x in lines[:MAX_LINES_NAMED])
    return (f"The framework's own per-step Python ({named}): its training loop runs these "
            "lines, none of the script's, so there is no line to edit. A larger batch "
            "amortizes it over more samples; fewer callbacks and hooks shorten it.")


def _fix(lines: list[HostLineTime], slower: float | None) -> str:
    named = "; ".join(f"{x.location} `{x.text}` {x.ms(*HOST_ONLY):.1f} ms/step" if x.text
                      else f"{x.location} {x.ms(*HOST_ONLY):.1f} ms/step"
                      for x in lines[:MAX_LINES_NAMED])
    where = ("Per-sample preparation belongs in a Dataset's __getitem__, loaded by "
             "DataLoader(num_workers=N) so it runs beside the step" if slower is None else
             f"DataLoader workers measured {slower:.2f}x here (--try-fixes): do per-sample "
             "preparation once, before training, or on whole batches")
    return (f"Take this work off the training thread: {named}. {where}; batch-wide work can "
            "be torch ops on the device; metrics and logging can stay on the device and be "
            "read every N steps.")
