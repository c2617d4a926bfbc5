"""Why does a background checkpoint write stall the training thread?

The training thread runs short device steps (a matmul and a host sync, like GradScaler's
per-step `.item()`), timing each; a writer thread meanwhile writes a checkpoint-sized host
buffer in one of several ways. Comparing the training thread's excess time under each writer
isolates the mechanism: torch.save to a file, the same bytes with a raw file write, torch.save
into memory (no file system), or an idle writer (control).

    python benchmarks/async_write_stalls.py --gb 1.2 --dir /tmp --out stalls.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


def training_thread(stop: threading.Event, device: torch.device) -> list[float]:
    a = torch.randn(2048, 2048, device=device)
    times: list[float] = []
    while not stop.is_set():
        start = time.perf_counter()
        (a @ a).sum().item()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def writers(buffer: torch.Tensor, directory: Path) -> dict[str, Callable[[], None]]:
    path = directory / "gpudiag-stall-probe.pt"

    def torch_save_file() -> None:
        torch.save({"buffers": {"float32": buffer}}, path)

    def raw_write_file() -> None:
        with path.open("wb") as f:
            f.write(memoryview(buffer.numpy()).cast("B"))

    def torch_save_memory() -> None:
        torch.save({"buffers": {"float32": buffer}}, io.BytesIO())

    def idle() -> None:
        time.sleep(1.0)

    return {"idle": idle, "torch.save to file": torch_save_file,
            "raw write to file": raw_write_file, "torch.save to memory": torch_save_memory}


def probe(write: Callable[[], None], device: torch.device, repeats: int) -> dict[str, float]:
    stop = threading.Event()
    result: list[list[float]] = []
    trainer = threading.Thread(target=lambda: result.append(training_thread(stop, device)))
    trainer.start()
    time.sleep(0.5)  # the baseline steps before the first write
    write_ms = []
    for _ in range(repeats):
        start = time.perf_counter()
        write()
        write_ms.append((time.perf_counter() - start) * 1e3)
        time.sleep(0.3)
    stop.set()
    trainer.join()
    times = result[0]
    median = statistics.median(times)
    return {"steps": len(times), "median_step_ms": round(median, 3),
            "max_step_ms": round(max(times), 1),
            "excess_ms_total": round(sum(t - median for t in times if t > 2 * median), 1),
            "write_ms_median": round(statistics.median(write_ms), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.2, help="checkpoint size")
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    buffer = torch.ones(int(args.gb * 1e9 / 4), pin_memory=device.type == "cuda")
    report: dict[str, object] = {"device": torch.cuda.get_device_name() if device.type == "cuda"
                                 else "cpu", "gb": args.gb, "torch": torch.__version__,
                                 "writers": {}}
    for name, write in writers(buffer, args.dir).items():
        report["writers"][name] = probe(write, device, args.repeats)  # type: ignore[index]
        print(name, report["writers"][name], flush=True)  # type: ignore[index]
    (args.dir / "gpudiag-stall-probe.pt").unlink(missing_ok=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
