"""Where a profiled step's host time grew between two runs: the host sampler's time per steady
step by line of the user's code (facts.script.host), side by side, each line's source read
from both runs. A slower machine stretches every line alike; a line's own time also moves
with what it waits on (a collective, a loader, the GPU), with no change to the code. So only
a step that grew at a line the head edited, while the rest of it did not, is the code's doing
even between runs recorded apart; the gate names that line."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from gpudiag.model.facts import HostSamples
from gpudiag.model.results import StageResult

# The line that grew: at least this share of the step's growth ...
LOCALIZED_SHARE = 0.5
# ... while the rest of the host's step grew by at most this fraction of the step's own
# relative growth (a machine twice as slow would grow the rest as much as the step).
REST_GROWTH_RATIO = 0.5


@dataclass
class HostLineChange:
    location: str  # the head's "path:line" (the base's where the line is gone)
    text: str  # its source, which pairs the two sides' lines when code above it moved
    before_ms: float  # host time per steady step
    after_ms: float
    edited: bool = False  # its source differs between the runs, or only the head has it

    @property
    def grew_ms(self) -> float:
        return self.after_ms - self.before_ms


def _host(stage: StageResult | None) -> HostSamples | None:
    script = stage.facts.script if stage is not None else None
    host = script.host if script is not None else None
    return host if host is not None and host.steady_steps else None


def _by_line(host: HostSamples) -> dict[str, tuple[str, float]]:
    """location -> (its source, ms per steady step), every kind of host time on it summed."""
    found: dict[str, list[float]] = defaultdict(list)
    for line in host.lines:
        found[line.location].append(host.per_step(line.ms))
    return {loc: (host.text.get(loc, "").strip(), sum(v)) for loc, v in found.items()}


def _number(location: str) -> int:
    number = location.rpartition(":")[2]
    return int(number) if number.isdigit() else 0


def _pairs(a: dict[str, tuple[str, float]], b: dict[str, tuple[str, float]],
           ) -> list[tuple[str | None, str | None]]:
    """The two sides' locations paired: by file and source first (code above the line may
    have moved it), then what is left by location (the line itself was edited), then by file
    and the nearest line (edited, and moved)."""
    def key(loc: str, text: str) -> tuple[str, str]:
        return loc.rpartition(":")[0], text

    by_text = {key(loc, text): loc for loc, (text, _) in a.items() if text}
    pairs: list[tuple[str | None, str | None]] = []
    left_a = set(a)
    left_b = []
    for loc, (text, _) in b.items():
        match = by_text.get(key(loc, text)) if text else None
        if match is not None and match in left_a:
            pairs.append((match, loc))
            left_a.discard(match)
        else:
            left_b.append(loc)
    for loc in sorted(left_b, key=_number):
        same_file = [x for x in left_a if x.rpartition(":")[0] == loc.rpartition(":")[0]]
        near = loc if loc in left_a else min(
            same_file, key=lambda x: abs(_number(x) - _number(loc)), default=None)
        pairs.append((near, loc))
        if near is not None:
            left_a.discard(near)
    return pairs + [(loc, None) for loc in sorted(left_a)]


def host_line_changes(before: StageResult | None, after: StageResult | None,
                      ) -> list[HostLineChange]:
    """Every sampled line's host time per step on both sides, the largest change first; empty
    where a side has no host samples."""
    a, b = _host(before), _host(after)
    if a is None or b is None:
        return []
    lines_a, lines_b = _by_line(a), _by_line(b)
    changes = []
    for loc_a, loc_b in _pairs(lines_a, lines_b):
        text_a, ms_a = lines_a[loc_a] if loc_a is not None else ("", 0.0)
        text_b, ms_b = lines_b[loc_b] if loc_b is not None else ("", 0.0)
        changes.append(HostLineChange(location=loc_b or loc_a or "", text=text_b or text_a,
                                      before_ms=ms_a, after_ms=ms_b,
                                      edited=loc_b is not None and (
                                          loc_a is None or text_a != text_b)))
    return sorted(changes, key=lambda c: -abs(c.grew_ms))


def localized_growth(changes: list[HostLineChange]) -> HostLineChange | None:
    """The line the host's step grew at, if it grew at one the head edited: that line took at
    least half the growth while the rest of the step grew, relatively, at most half as much as
    the whole."""
    before = sum(c.before_ms for c in changes)
    after = sum(c.after_ms for c in changes)
    if not changes or before <= 0 or after <= before:
        return None
    top = max(changes, key=lambda c: c.grew_ms)
    rest_before, rest_after = before - top.before_ms, after - top.after_ms
    step_growth = after / before - 1
    rest_growth = rest_after / rest_before - 1 if rest_before > 0 else 0.0
    if top.edited and top.grew_ms >= LOCALIZED_SHARE * (after - before) and \
            rest_growth <= REST_GROWTH_RATIO * step_growth:
        return top
    return None


def describe(change: HostLineChange) -> str:
    """'train.py:13 `time.sleep(0.042)` +12.0 ms/step of host time (30.1 -> 42.1)'."""
    text = f" `{change.text}`" if change.text else ""
    return (f"{change.location}{text} {change.grew_ms:+.1f} ms/step of host time "
            f"({change.before_ms:.1f} -> {change.after_ms:.1f})")
