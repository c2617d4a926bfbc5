"""A closed profiler window's Chrome trace as torch exported it: parsed, saved gzipped (beside
whatever comes next, in threads). Without torch: gpudiag profile's own process reads and keeps
a script's window (gpudiag/measure/profile/launching/windows.py) as the ladder keeps its own."""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import threading
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
    gzip level 6 (zlib's default; 9 is slower for a few percent). Whole or not at all: it may
    be written from a thread (TraceSaves, the ladder's), which an exit can cut."""
    write_bytes_atomic(path, gzip.compress(exported, compresslevel=6))


class TraceSaves:
    """Closed windows' traces compressed and written in threads, beside whatever comes next:
    zlib lets go of the GIL, so a 64 MB trace's second of gzip (the dgca full-loop window's on
    an H100) no longer adds to the run. `join` waits for them all and says which failed (a
    full disk: the evidence stands without its trace file)."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._failed: list[str] = []

    def save(self, exported: bytes, path: Path) -> None:
        def run() -> None:
            try:
                save_trace(exported, path)
            except Exception as exc:
                self._failed.append(f"{path.name} not written: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=run, name="gpudiag-trace-save", daemon=True)
        thread.start()
        self._threads.append(thread)

    def join(self) -> list[str]:
        for thread in self._threads:
            thread.join()
        self._threads.clear()
        failed, self._failed = self._failed, []
        return failed
