"""A closed profiler window's Chrome trace as torch exported it: parsed, saved gzipped. Without
torch: windows are read away from the process that profiles them (evidence/reader.py)."""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpudiag.model.atomic import write_bytes_atomic


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a trace is parsed and analysed: a window's
    hundreds of thousands of event dicts, none of them garbage yet, set off its full
    collections again and again, each walking all of them (per_tensor_optimizer's 166,000
    events: 5.9 s to parse with it, 1.1 s without; benchmarks/window_cost.py). The script's
    own setting is restored."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_trace(exported: bytes) -> list[dict[str, Any]]:
    """The trace's events (its `traceEvents`), parsed with the collector paused."""
    with collector_paused():
        events: list[dict[str, Any]] = json.loads(exported).get("traceEvents", [])
    return events


def save_trace(exported: bytes, path: Path) -> None:
    """A closed window's Chrome trace (its `trace_json`), gzipped (ui.perfetto.dev and
    chrome://tracing open it): torch's export as it is, never parsed and encoded again, at
    gzip level 6 (zlib's default; 9 is slower for a few percent). Whole or not at all: a stop
    can cut its writer."""
    write_bytes_atomic(path, gzip.compress(exported, compresslevel=6))
