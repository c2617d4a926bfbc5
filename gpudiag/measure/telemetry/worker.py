"""The sampling process: `python -m gpudiag.measure.telemetry.worker --spec JSON --out FILE ...`.

Per-tick sampling runs here, not in a thread of the measured process: NVML calls release and
re-take the GIL, and a sampling thread would trade the GIL with the training loop several times
per tick, slowing exactly the host-bound loops gpudiag is meant to diagnose. Rows are appended
to FILE as JSON lines stamped with the system-wide monotonic clock, which the parent shares.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from gpudiag.measure.telemetry.reader import GPM_METRICS, GPM_MIN_WINDOW_S
from gpudiag.measure.telemetry.readers import open_reader

_stop = threading.Event()


def _request_stop(_signum: int, _frame: object) -> None:
    _stop.set()


def sample(spec: dict[str, Any], out: str, period_s: float, gpm_period_s: float) -> int:
    reader, reason = open_reader(spec)
    if reader is None:
        print(f"telemetry worker: {reason}", file=sys.stderr)
        return 2
    parent = os.getppid()
    gpm_ok = any(reader.metric_status.get(m) == "ok" for m in GPM_METRICS)
    gpm_period_s = max(gpm_period_s, GPM_MIN_WINDOW_S)
    previous_gpm: Any | None = None
    next_tick = next_gpm = time.monotonic()
    with open(out, "a") as fh:  # noqa: PTH123  (line-buffered append, flushed per tick)
        while not _stop.is_set() and os.getppid() == parent:
            now = time.monotonic()
            row: dict[str, Any] = {"t": now, **reader.read()}
            if gpm_ok and now >= next_gpm:
                snapshot = reader.gpm_snapshot()
                if previous_gpm is not None and snapshot is not None:
                    row.update(reader.gpm_metrics(previous_gpm, snapshot))
                    reader.gpm_release(previous_gpm)
                previous_gpm = snapshot or previous_gpm
                next_gpm = now + gpm_period_s
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            next_tick += period_s
            _stop.wait(max(0.0, next_tick - time.monotonic()))
    reader.gpm_release(previous_gpm)
    reader.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C (and a closed terminal's SIGHUP) reaches the whole process group; the parent
    # decides when sampling stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _request_stop)
    parser = argparse.ArgumentParser(prog="gpudiag.measure.telemetry.worker")
    parser.add_argument("--spec", required=True, help="reader spec, JSON")
    parser.add_argument("--out", required=True)
    parser.add_argument("--period", type=float, required=True)
    parser.add_argument("--gpm-period", type=float, required=True)
    args = parser.parse_args(argv)
    return sample(json.loads(args.spec), args.out, args.period, args.gpm_period)


if __name__ == "__main__":
    sys.exit(main())
