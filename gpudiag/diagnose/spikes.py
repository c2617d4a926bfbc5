"""Step-time spikes, their period, and the time they cost: checkpoint stalls from times alone.

A spike is a step above median + k * MAD (the MAD scaled to a normal sigma), and at least a
fifth above the median so that the near-zero MAD of a very steady GPU does not turn jitter
into spikes. Spikes are *periodic* when one period p and phase r explain almost all of them
(i = r mod p) and almost every step at that phase spikes: a save every N steps does both,
random interference (another job, a GC pause) does neither.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

SPIKE_MADS = 5.0
MIN_SPIKE_EXCESS = 0.2  # a spike is at least 20% above the median step
MIN_PERIODIC_SPIKES = 3
PERIODIC_SHARE = 0.8  # of spikes on the phase, and of phase slots that spike
MAD_TO_SIGMA = 1.4826


@dataclass
class Spikes:
    indices: list[int]
    median_ms: float
    threshold_ms: float
    excess_ms: list[float]  # each spike's time above the median


@dataclass
class Period:
    steps: int
    phase: int
    hits: int  # spikes at that phase
    slots: int  # steps at that phase in the series
    spikes: int  # all spikes


def find_spikes(times: Sequence[float], k: float = SPIKE_MADS) -> Spikes:
    median = statistics.median(times)
    mad = MAD_TO_SIGMA * statistics.median(abs(t - median) for t in times)
    threshold = median + max(k * mad, MIN_SPIKE_EXCESS * median)
    indices = [i for i, t in enumerate(times) if t > threshold]
    return Spikes(indices=indices, median_ms=median, threshold_ms=threshold,
                  excess_ms=[times[i] - median for i in indices])


def detect_period(indices: Sequence[int], n: int) -> Period | None:
    """The period that explains the spikes at `indices` in a series of `n` steps, or None.

    Candidates run from 2 to n/3 (three occurrences at least). Among those where at least 80%
    of spikes share one phase and at least 80% of that phase's steps spike, the one explaining
    the most spikes wins; ties go to the shorter period."""
    if len(indices) < MIN_PERIODIC_SPIKES:
        return None
    best: Period | None = None
    for p in range(2, n // MIN_PERIODIC_SPIKES + 1):
        phase, hits = Counter(i % p for i in indices).most_common(1)[0]
        slots = len(range(phase, n, p))
        if (hits < MIN_PERIODIC_SPIKES or hits < PERIODIC_SHARE * len(indices)
                or hits < PERIODIC_SHARE * slots):
            continue
        if best is None or hits > best.hits:
            best = Period(steps=p, phase=phase, hits=hits, slots=slots, spikes=len(indices))
    return best


def lost_share(times: Sequence[float], baseline_ms: float | None = None) -> float:
    """Time lost to slow steps over the time steady steps would take: CheckFreq's overhead,
    (sum(t) - m * n) / (m * n), with m the median step unless a baseline is given."""
    m = statistics.median(times) if baseline_ms is None else baseline_ms
    ideal = m * len(times)
    return (sum(times) - ideal) / ideal if ideal > 0 else 0.0
