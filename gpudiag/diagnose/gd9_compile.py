"""torch.compile rules: recompilations, the recompile limit's silent fallback to eager, graph
breaks; from Dynamo's own compilation records
(gpudiag/measure/profile/inscript/watches/compiled.py)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator

from gpudiag.diagnose.common import duration, pct
from gpudiag.diagnose.ledger import LoopParts, NoPart
from gpudiag.diagnose.registry import Draft, Threshold, rule, severity_for
from gpudiag.diagnose.timeline import stage_account
from gpudiag.model.facts import CompileEvent, CompileFacts
from gpudiag.model.results import RunResult, StageResult

MIN_RECOMPILES = 2  # one recompile (a last, smaller batch) is routine
WARNING_SHARE, CRITICAL_SHARE = 0.05, 0.20
MAX_REASONS = 3
LIMIT_WORDS = ("recompile limit", "cache_size_limit", "recompile_limit")

RECOMPILE_THRESHOLDS = (
    Threshold("min_recompiles", MIN_RECOMPILES,
              "recompilations of one function: a single one (a last, smaller batch) is routine"),
    Threshold("warning_share", WARNING_SHARE, "share of the run's wall time spent recompiling"),
    Threshold("critical_share", CRITICAL_SHARE, "recompiling takes a fifth of the run"),
    Threshold("max_reasons", MAX_REASONS, "distinct recompile reasons listed, most frequent "
              "first"),
)


def _compiles(stage: StageResult) -> CompileFacts | None:
    script = stage.facts.script
    return script.compiles if script is not None else None


def _frames(facts: CompileFacts) -> dict[tuple[str, str], list[CompileEvent]]:
    """Compilations by the function compiled (its name and place)."""
    frames: dict[tuple[str, str], list[CompileEvent]] = defaultdict(list)
    for event in facts.events:
        frames[(event.function, event.location)].append(event)
    return frames


def _call_site(events: list[CompileEvent]) -> str | None:
    """The user's line that calls the compiled code most often among `events`."""
    sites = Counter(e.call_site for e in events if e.call_site)
    return sites.most_common(1)[0][0] if sites else None


def _name(function: str, location: str, site: str | None) -> str:
    """How a compiled function is named: by its definition, or where that is torch's own
    wrapper (a compiled nn.Module), by the user's call."""
    if location.startswith("torch/") and site is not None:
        return f"the compiled code called at {site}"
    return f"{function}() ({location})"


def _compilations(events: list[CompileEvent]) -> int:
    """Compilations, not records: a backward pass compiled for its forward shares its id."""
    return len({e.compile_id or id(e) for e in events if not _gave_up(e)})


def _run_time(stage: StageResult) -> tuple[float, float | None, float | None]:
    """(the run's wall time, the compile part's share of the training loop (after step 0),
    the training steps' own time) from the run's account; without a timeline, (the timed
    steps' time, None, None)."""
    whole = stage_account(stage)
    if whole is None:
        return sum(stage.iter_ms), None, None
    part = sum(w.extra_ms for w in whole.works if w.kind == "compile")
    return whole.wall_ms, whole.loop_share(part), whole.steady_ms


def _dynamic_fix(reasons: list[str], site: str) -> str:
    if any("size mismatch" in r or "stride mismatch" in r for r in reasons):
        return (f"Its inputs change shape from call to call. At {site}: mark the changing "
                "dimension dynamic before the call (torch._dynamo.mark_dynamic(x, dim)), or "
                "compile with torch.compile(..., dynamic=True); or pad inputs to a few fixed "
                "lengths (buckets, e.g. multiples of 64) so each compiles once.")
    return (f"Each recompile follows a guard that failed (listed): keep what it checks the "
            f"same from call to call at {site} (a Python value or an object's identity turned "
            "into a constant, a changed dtype or requires_grad, grad mode), or pass it as a "
            "tensor.")


@rule(
    "GD901", "compile-recompiles", concern="compile",
    summary="torch.compile recompiles a function again and again: the run spends its time "
            "compiling.",
    why=("Dynamo specialises a compiled function to what its guards check (shapes, dtypes, "
         "Python values); a call that fails a guard compiles the function again, seconds to "
         "minutes each (an H100 spends ~23 s per recompile of a GPT block). Inputs whose "
         "length changes every step recompile until Dynamo's recompile limit, then run "
         "eagerly."),
    fix=("Mark the changing dimension dynamic (torch._dynamo.mark_dynamic, or "
         "torch.compile(dynamic=True)), or pad to a few bucket sizes; keep Python values the "
         "function branches on constant."),
    prices=LoopParts(("compile",)),
    thresholds=RECOMPILE_THRESHOLDS,
    references=("https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html",),
)
def compile_recompiles(run: RunResult) -> Iterator[Draft]:
    """A compiled function compiled MIN_RECOMPILES+1 times or more in a profiled run, with
    Dynamo's recompile reasons; priced as the run's wall time its compilations after the
    first step took (the run's account, gpudiag/diagnose/timeline.py)."""
    for stage in run.ok_stages():
        facts = _compiles(stage)
        if facts is None:
            continue
        wall_ms, part_share, training = _run_time(stage)
        for (function, location), events in _frames(facts).items():
            recompiles = [e for e in events if e.recompile_reason and not _gave_up(e)]
            if len(recompiles) < MIN_RECOMPILES:
                continue
            # A compilation is several records (forward, backward, ...) under one id.
            ids = {e.compile_id for e in recompiles}
            seconds = sum(e.seconds for e in events if e.compile_id in ids)
            # Without the run's account, of the time seen: those compilations and the timed
            # steps (the compilations happened outside them).
            share = part_share if part_share is not None else \
                seconds * 1e3 / (seconds * 1e3 + wall_ms)
            reasons = [r for r, _ in Counter(e.recompile_reason or "" for e in recompiles)
                       .most_common(MAX_REASONS)]
            called = _call_site(events)
            site = called or location
            versus = f" for {duration(training)} of training steps" if training else ""
            yield Draft(
                severity=severity_for(share, warning=WARNING_SHARE, critical=CRITICAL_SHARE),
                stage=stage.name,
                title=(f"torch.compile recompiled {_name(function, location, called)} "
                       f"{len(recompiles)} times, {duration(seconds * 1e3)} of compiling"
                       f"{versus} ({pct(share)} of the "
                       f"{'training loop' if part_share is not None else 'time seen'}): "
                       f"{reasons[0]}"),
                location=site, impact=min(1.0, share),
                evidence={"function": function, "defined_at": location, "called_at": site,
                          "compilations": _compilations(events),
                          "recompiles": len(recompiles),
                          "recompile_seconds": round(seconds, 2),
                          "all_compile_seconds": round(facts.seconds, 2),
                          "training_steps_seconds": None if training is None
                          else round(training / 1e3, 2),
                          "run_wall_ms": round(wall_ms, 1),
                          "recompile_reasons": reasons,
                          "steps": sorted({e.step for e in recompiles if e.step is not None}),
                          "recompile_limit": facts.recompile_limit},
                fix=_dynamic_fix(reasons, site))


def _gave_up(event: CompileEvent) -> bool:
    return event.failure is not None and any(w in event.failure.lower() for w in LIMIT_WORDS)


@rule(
    "GD902", "compile-limit-fallback", concern="compile",
    summary="Dynamo hit its recompile limit and silently runs the function eagerly.",
    why=("After `recompile_limit` compilations of one function (8 by default) Dynamo stops "
         "compiling it and every later call runs in eager mode, with a log warning most users "
         "never see: the run is neither compiled nor free of the compile time already spent."),
    fix=("Remove the recompilations (compile-recompiles' fix); raising "
         "torch._dynamo.config.recompile_limit only spends more time compiling."),
    prices=NoPart("a risk whose cost is not measured"),
    references=("https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html",),
)
def compile_limit_fallback(run: RunResult) -> Iterator[Draft]:
    """A compilation Dynamo gave up on for the recompile limit: the function runs eagerly
    from then on. Its cost is not measured (no compiled run to hold it against): a risk."""
    for stage in run.ok_stages():
        facts = _compiles(stage)
        if facts is None:
            continue
        for (function, location), events in _frames(facts).items():
            fallen = [e for e in events if _gave_up(e)]
            if not fallen:
                continue
            first = min((e.step for e in fallen if e.step is not None), default=None)
            compiled = _compilations(events)
            called = _call_site(events)
            limit = f" (recompile_limit {facts.recompile_limit})" \
                if facts.recompile_limit is not None else ""
            when = f" from step {first}" if first is not None else ""
            yield Draft(
                severity="warning", stage=stage.name,
                title=(f"Dynamo stopped compiling {_name(function, location, called)} after "
                       f"{compiled} compilations{limit}: it runs eagerly{when}"),
                location=called or location,
                impact=0.0,
                evidence={"function": function, "defined_at": location,
                          "compilations": compiled, "recompile_limit": facts.recompile_limit,
                          "first_eager_step": first,
                          "last_reason": fallen[-1].recompile_reason},
                fix=("Remove the recompilations (GD901's fix: dynamic shapes or buckets); "
                     "until then the compiled model is not what runs."))


@rule(
    "GD903", "compile-graph-breaks", concern="compile",
    summary="torch.compile splits a function's graph (graph breaks), with Dynamo's reason.",
    why=("At a graph break Dynamo ends the graph, runs the unsupported code in Python and "
         "starts a new graph after it: fusion stops at the break, and each break adds guards "
         "and host work. One break in a large model is cheap; breaks inside layers are not."),
    fix=("Remove the break's cause (printing, .item(), data-dependent Python control flow, an "
         "unsupported call) or move it out of the compiled region; "
         "torch._dynamo.explain or TORCH_LOGS=graph_breaks lists each."),
    prices=NoPart("information: what a break costs is not measured"),
    references=("https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html",),
)
def compile_graph_breaks(run: RunResult) -> Iterator[Draft]:
    """Every graph break Dynamo counted in a profiled run, by reason, with the line where the
    compiled function resumes after it where Dynamo names one. Information: what a break
    costs is not measured here."""
    for stage in run.ok_stages():
        facts = _compiles(stage)
        if facts is None or not facts.graph_breaks:
            continue
        broken = [e for e in facts.events if e.graph_break]
        total = sum(facts.graph_breaks.values())
        top, count = max(facts.graph_breaks.items(), key=lambda kv: kv[1])
        where = next((e for e in broken if e.graph_break == top), broken[0] if broken else None)
        at = (where.graph_break_at or where.location) if where is not None else None
        in_fn = f" in {where.function}()" if where is not None else ""
        yield Draft(
            severity="info", stage=stage.name,
            title=(f"{total} graph break(s){in_fn}: {top}" + (f" ({count}x)" if count > 1
                                                              else "")),
            location=at, impact=0.0,
            evidence={"graph_breaks": facts.graph_breaks,
                      "at": {e.graph_break or "": e.graph_break_at or e.location
                             for e in broken}},
            fix=(f"At {at}: remove the cause ({top}) or move it out of the compiled function."
                 if at else "Remove the causes listed or move them out of the compiled code."))
