"""One accounting of a profiled script's steady step, from its host samples
(gpudiag.model.facts.HostSamples): the training thread's time per step, by what it was doing
(blocked in device syncs, in torch calls, waiting for the DataLoader, in Python or numpy, in
gpudiag) and by the user's line. The parts add up to the sampled step: every share a finding
quotes of "the step" is of this one.

A sample at a C call or operator whose target its source does not name (`x.sum()`, `a @ b`,
`if torch.isnan(loss)`) is told apart by the profiler window: on a GPU, blocked in a sync
where the window saw syncs made from there (the line, or the library line it went through);
torch where the window saw that line issue torch operators; else Python/numpy. Without a
window it stays "a call, torch or not".
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from gpudiag.model.facts import HOST_KINDS, HostKind, HostSamples
from gpudiag.model.results import StageResult

MIN_SAMPLES = 20  # fewer samples on the steady steps say nothing per line
MAX_VIA = 2  # library frames named per line
UNSAMPLED_NOISE = 0.02  # samples short of the step by less than this are noise, not a part

KIND_LABELS: dict[HostKind, str] = {
    "sync": "blocked in device syncs (waiting for the GPU)",
    "torch": "in torch calls (launches, CPU-side op work)",
    "data": "waiting for the training DataLoader",
    "compile": "in torch.compile's own work (Dynamo's guards, compiling)",
    "python": "Python and numpy (host-only work)",
    "call": "C calls and operators, torch or not (no profiler window to tell)",
    "gpudiag": "gpudiag's own step bookkeeping",
}

SHORT_KIND: dict[HostKind, str] = {
    "sync": "blocked in syncs", "torch": "torch calls", "data": "DataLoader",
    "compile": "torch.compile",
    "python": "Python/numpy", "call": "C calls", "gpudiag": "gpudiag",
}


@dataclass
class HostLineTime:
    """One line of the user's code: its host time per steady step, split by kind."""

    location: str
    function: str
    text: str
    ms_per_step: float
    share: float  # of the sampled step
    kinds: dict[HostKind, float] = field(default_factory=dict)  # ms per step
    via: list[str] = field(default_factory=list)
    syncs_per_step: float = 0.0  # the profiler window's count, when it saw the line
    library: bool = False  # a library's own line, no user line below the loop (HostLine's)

    @property
    def main_kind(self) -> HostKind:
        return max(self.kinds, key=lambda k: self.kinds[k])

    def ms(self, *kinds: HostKind) -> float:
        return sum(self.kinds.get(k, 0.0) for k in kinds)


@dataclass
class StepAccount:
    """The steady step's host time in parts that add up to it, and its lines."""

    step_ms: float  # mean steady step, host clock
    steps: int
    samples: int
    period_ms: float
    parts: dict[HostKind, float]  # ms per step, by kind; with `unsampled_ms`, the step
    unsampled_ms: float
    lines: list[HostLineTime]
    gpu_busy_share: float | None = None  # the profiler window's, for the device's side
    clock: str = ""  # who took the samples (gpudiag.model.facts.HostSamples.clock)
    clock_note: str = ""

    def share(self, ms: float) -> float:
        return ms / self.step_ms if self.step_ms > 0 else 0.0

    def error(self, ms_per_step: float) -> float:
        """The sampling error (one standard error) of a line's ms per step: it stands on
        k = ms x steps / period samples, known to about sqrt(k) of them."""
        if self.steps <= 0:
            return 0.0
        return math.sqrt(max(ms_per_step, 0.0) * self.period_ms / self.steps)

    def lines_of(self, *kinds: HostKind, min_share: float = 0.0) -> list[HostLineTime]:
        """Lines by their time in `kinds`, busiest first, at least `min_share` of the step."""
        chosen = [line for line in self.lines if self.share(line.ms(*kinds)) >= min_share
                  and line.ms(*kinds) > 0]
        return sorted(chosen, key=lambda line: -line.ms(*kinds))


def _torch_lines(stage: StageResult) -> tuple[set[str], dict[str, float]]:
    """Lines the profiler window saw issue torch operators, and their syncs per step."""
    ev = stage.evidence
    if ev is None:
        return set(), {}
    counts = ev.line_counts or []
    issued = {c.location for c in counts if c.ops > 0 or c.kernels > 0}
    issued |= {s.location for s in ev.source_lines if s.calls_per_step > 0}
    syncs = {c.location: c.syncs for c in counts if c.syncs > 0}
    syncs.update({s.location: s.syncs_per_step for s in ev.source_lines if s.syncs_per_step})
    return issued, syncs


def _sync_sites(stage: StageResult) -> set[tuple[str, str]]:
    """Where the window saw syncs made, as a host sample is charged: (the user's line, the
    library line it went through, or ""). A library's line a sync went through is a site of
    its own too: its loop's samples are charged to it (HF Trainer's NaN check of the loss)."""
    ev = stage.evidence
    sites: set[tuple[str, str]] = set()
    for c in ev.line_counts if ev is not None and ev.line_counts else []:
        if c.syncs > sum(c.sync_vias.values()):
            sites.add((c.location, ""))
        for via in c.sync_vias:
            sites |= {(c.location, via), (via, "")}
    return sites


class _CallResolver:
    """What a sample at a C call or operator was doing, by the profiler window's record of
    its line: on a GPU, a call made where the window saw syncs made (the same line, through
    the same library line) is the thread waiting for the device (`if torch.isnan(loss) or
    ...`: the bool() its source does not name); else a line that issued torch operators is
    torch's, any other Python's. Without a window, a call."""

    def __init__(self, stage: StageResult) -> None:
        self.issued, self.syncs = _torch_lines(stage)
        self.windowed = stage.evidence is not None
        cuda = stage.evidence is not None and stage.evidence.backend == "cuda"
        self.sync_sites = _sync_sites(stage) if cuda else set()

    def __call__(self, kind: HostKind, location: str, via: str) -> HostKind:
        if kind != "call" or not self.windowed:
            return kind
        if (location, via) in self.sync_sites:
            return "sync"
        return "torch" if location in self.issued else "python"


def step_account(stage: StageResult) -> StepAccount | None:
    """The stage's steady step from its host samples, or None without enough of them."""
    script = stage.facts.script
    host: HostSamples | None = script.host if script is not None else None
    if host is None or host.samples < MIN_SAMPLES or not host.steady_steps \
            or host.sampled_ms <= 0:
        return None
    resolved = _CallResolver(stage)
    step_ms = host.per_step(host.steady_wall_ms)
    # Samples weigh the time since the one before: over many steps they add up to the steps'
    # wall time, give or take sampling noise (scaled away); well short of it is time no
    # sample could see (the sampler kept from the GIL), shown as "not sampled".
    seen = host.sampled_ms >= (1 - UNSAMPLED_NOISE) * host.steady_wall_ms
    scale = host.steady_wall_ms / host.sampled_ms if seen else 1.0

    def per_step(ms: float) -> float:
        return host.per_step(ms) * scale

    per_line: dict[str, HostLineTime] = {}
    vias: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for sample in host.lines:
        kind = resolved(sample.kind, sample.location, sample.via)
        ms = per_step(sample.ms)
        line = per_line.setdefault(sample.location, HostLineTime(
            sample.location, sample.function, host.text.get(sample.location, ""), 0.0, 0.0,
            syncs_per_step=resolved.syncs.get(sample.location, 0.0), library=sample.library))
        line.ms_per_step += ms
        line.kinds[kind] = line.kinds.get(kind, 0.0) + ms
        if sample.via:
            vias[sample.location][sample.via] += ms
    parts = {kind: per_step(host.kind_ms.get(kind, 0.0)) for kind in HOST_KINDS}
    if resolved.windowed:
        # Calls are told apart line by line; those on lines past the MAX_LINES listed, by
        # no window record of torch work there, are Python's.
        calls: dict[HostKind, float] = defaultdict(float)
        for s in host.lines:
            if s.kind == "call":
                calls[resolved("call", s.location, s.via)] += per_step(s.ms)
        left = parts["call"]
        for kind in ("sync", "torch"):
            parts[kind] += min(calls[kind], left)
            left -= min(calls[kind], left)
        parts["python"] += left
        parts["call"] = 0.0
    sampled = per_step(host.sampled_ms)
    for line in per_line.values():
        line.share = line.ms_per_step / step_ms if step_ms else 0.0
        line.via = [v for v, _ in sorted(vias[line.location].items(),
                                         key=lambda kv: -kv[1])[:MAX_VIA]]
    ev = stage.evidence
    # The window's own reading (GD102's), not busy time over its instrumented step.
    busy = (1 - ev.idle_fraction if ev is not None and ev.backend == "cuda"
            and ev.idle_fraction is not None else None)
    return StepAccount(
        step_ms=step_ms, steps=host.steady_steps, samples=host.samples,
        period_ms=host.period_ms, parts={k: v for k, v in parts.items() if v > 0},
        unsampled_ms=0.0 if seen else step_ms - sampled,
        lines=sorted(per_line.values(), key=lambda line: -line.ms_per_step),
        gpu_busy_share=busy, clock=host.clock, clock_note=host.clock_note)
