"""Planted problem: DDP with a tiny per-device batch, so each step's all-reduce and
synchronisation cost more than its compute. Run with torchrun --nproc-per-node 2 tiny_ddp.py
[STEPS] [ACCUM] (defaults 60 and 1). With ACCUM > 1 each optimizer step accumulates ACCUM
micro-steps and, the second planted problem, all-reduces on every one of them (no
model.no_sync() around the micro-steps but the last); NO_SYNC=1 puts it there."""

import contextlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
ACCUM = int(sys.argv[2]) if len(sys.argv) > 2 else 1


def main() -> None:
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(device),
        device_ids=[local] if cuda else None)
    # SGD keeps the optimizer's own time small, so the planted all-reduce cost is what
    # dominates the step on any machine (AdamW's passes over 8M parameters rival it on a CPU).
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(4, 1024, device=device)  # 4 samples per device
    no_sync = os.environ.get("NO_SYNC") == "1"
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            with model.no_sync() if no_sync and not last else contextlib.nullcontext():
                loss = model(x).square().mean() / ACCUM
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    if dist.get_rank() == 0 and len(times) > 5:  # the script's own timer, for a plain A/B
        print("SCRIPT_TIMER " + json.dumps({"median_ms": statistics.median(times[5:])}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
