"""Why the ladder's DataLoader-alone stage reads 1.6-2.4 ms a batch on an H100 where the
independent reference ladder (its stage 4) read 0.99 ms: the statistic, the data, or
the loader?

Three loaders, each timed two ways, interleaved, several rounds:
- `ladder`: the stage itself (gpudiag/measure/stages/ladder.py: four int64 tensors a row,
  a preloaded pool, 4 workers, pinned, persistent, prefetch 2);
- `tensors3`: the reference's description (synthetic token ids, 4 workers, pinned): a
  TensorDataset of input_ids, attention_mask and labels, shuffled;
- `tensors4`: the same with the ladder's fourth tensor (token_type_ids).
Ways: `reference` (5 warm-up batches, then the median of 20, each under a host clock with
torch.cuda.synchronize(), as the reference timed every stage) and `ladder` (gpudiag's own
timing of that stage: the mean batch time over at least 1 s, steps never synchronised).

    python benchmarks/dataloader_reference.py --rounds 3 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from gpudiag.measure.models import resolve_model
from gpudiag.measure.plan import build_config
from gpudiag.measure.stages import StageContext, get_stage
from gpudiag.measure.timing import PhaseRecorder, time_steps

BATCH, SEQ, VOCAB, WORKERS = 128, 128, 21128, 4


def _tensor_loader(keys: int, pin: bool) -> Iterator[Any]:
    rows = 64 * BATCH  # a pool of 64 batches
    data = [torch.randint(0, VOCAB, (rows, SEQ)), torch.ones(rows, SEQ, dtype=torch.long),
            torch.randint(0, VOCAB, (rows, SEQ)), torch.zeros(rows, SEQ, dtype=torch.long)]
    loader = DataLoader(TensorDataset(*data[:keys]), batch_size=BATCH, shuffle=True,
                        num_workers=WORKERS, pin_memory=pin, drop_last=True,
                        persistent_workers=True)

    def forever() -> Iterator[Any]:
        while True:
            yield from loader

    return forever()


def _ladder_loader(device: str) -> tuple[Callable[[], None], Callable[[], None]]:
    config, _ = build_config(model="dgca", device=device, preset="full",
                             loader_workers=WORKERS)
    ctx = StageContext(config=config, device=torch.device(config.device),
                       spec=resolve_model(config.model), phases=PhaseRecorder(
                           torch.device(config.device)))
    workload = get_stage("dataloader").build(ctx)  # type: ignore[misc]
    return workload.step, workload.close


def _reference_way(step: Callable[[], None], device: torch.device) -> float:
    for _ in range(5):
        step()
    times = []
    for _ in range(20):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _ladder_way(step: Callable[[], None], device: torch.device) -> dict[str, float]:
    for _ in range(5):
        step()
    timed = time_steps(step, device=device, iters=30, min_seconds=1.0, host_only=True)
    return {"mean_ms": statistics.fmean(timed.iter_ms),
            "median_ms": statistics.median(timed.iter_ms), "batches": len(timed.iter_ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    pin = device.type == "cuda"
    rows: list[dict[str, Any]] = []
    for k in range(args.rounds):
        order = ["ladder", "tensors3", "tensors4"]
        for name in order if k % 2 == 0 else order[::-1]:
            for way in ("reference", "ladder"):
                # A fresh loader for each measurement: its prefetched queue starts full, as
                # a stage's does.
                if name == "ladder":
                    step, close = _ladder_loader(args.device)
                else:
                    batches = _tensor_loader(3 if name == "tensors3" else 4, pin)

                    def step(batches: Iterator[Any] = batches) -> None:
                        next(batches)

                    close = batches.close  # type: ignore[attr-defined]
                try:
                    row: dict[str, Any] = {"round": k, "loader": name, "way": way}
                    if way == "reference":
                        row["median_of_20_ms"] = _reference_way(step, device)
                    else:
                        row.update(_ladder_way(step, device))
                finally:
                    close()
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"meta": {"device": torch.cuda.get_device_name(device) if pin else "cpu",
                       "torch": torch.__version__, "batch": BATCH, "seq": SEQ,
                       "workers": WORKERS, "pin_memory": pin}, "rows": rows}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
