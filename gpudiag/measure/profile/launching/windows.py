"""A profiled script's closed profiler windows, read in gpudiag's own process: the recorder
exports each window's trace into the parts folder and goes on with the script; this side
parses and analyses it (evidence/reader.py, which loads no torch), keeps it gzipped where
traces are kept, and the evidence beside the part, read again at every later collection.
Parsing and analysing in the script cost it ~40% of its window (per-tensor optimizer on an
H100: 3.0 of 7.8 s, the gzip beside it apart; reports/examples/benchmarks/
h100-window-phases-after.json)."""

from __future__ import annotations

from pathlib import Path

from gpudiag.measure.evidence.reader import read_window
from gpudiag.measure.profile import protocol
from gpudiag.model.atomic import write_text_atomic
from gpudiag.model.profilepart import WindowTrace
from gpudiag.model.results import Evidence


def window_evidence(parts_dir: Path, pid: int, window: WindowTrace,
                    ) -> tuple[Evidence, str | None]:
    """Process `pid`'s window's evidence, analysed at the first call and read back after; and
    why its gzipped trace was not kept, where it was not (the evidence stands without it).
    OSError where the trace is gone or unreadable; a malformed trace raises what its parse
    raises."""
    kept = parts_dir / protocol.window_evidence_name(pid)
    if kept.is_file():
        return protocol.read_evidence(kept), None
    trace = parts_dir / window.trace
    evidence, not_kept = read_window(trace, window)
    if not_kept is not None:  # a full disk: analysed (and said) again at the next read
        return evidence, not_kept
    write_text_atomic(kept, protocol.evidence_text(evidence))
    trace.unlink()
    return evidence, None
