"""Planted problem (GPU): a small step (an MLP classifier, batch 256, TF32 on) whose host time
and device time are alike, that reads its loss and accuracy back to the host every step for
logging: two `.item()`s, each a device-to-host sync. Without them the host queues the next
step while the GPU runs this one; each read makes the host wait for the queue to drain, and the
GPU then idles while the host queues the next step's launches: host and device take turns.
Two reads a step is below what "many syncs" means, and what they cost depends on how the
step's host and device times compare: a sixth of one small step on an H200 (issue 55), 3% of
this one (reports/examples/h200-issue55-reads: 1.03x deferred, gpudiag's price 2%). GD103
names them at their line with that price. `WIDTH` sets the device's share (4096 on CUDA by
default; 256 on a CPU).

The knob is the logging line (GD103): keep the sums on the device and read them every N steps.
`DEFERRED=1` does that (reads every 50 steps), for a plain A/B with the script's own timer
(benchmarks/knobs_ab.py --cases reads). The timer reads the clock once per block of 25 steps
after one synchronize, so that the timer adds no sync of its own to the deferred steps.
"""

import json
import os
import statistics
import time

import torch
from torch import nn

STEPS = int(os.environ.get("STEPS", "300"))
DEFERRED = os.environ.get("DEFERRED") == "1"
BLOCK, READ_EVERY = 25, 50
CUDA = torch.cuda.is_available()
device = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def main() -> None:
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    width = int(os.environ.get("WIDTH", "4096" if CUDA else "256"))
    model = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=CUDA)
    x = torch.randn(1024, 256, device=device)
    y = torch.randint(0, 10, (1024,), device=device)
    logged: list[tuple[float, float]] = []
    loss_sum = torch.zeros((), device=device)
    right_sum = torch.zeros((), device=device)
    block_ms: list[float] = []
    sync()
    start = time.perf_counter()
    for step in range(STEPS):
        picked = torch.randint(0, 1024, (256,), device=device)
        out = model(x[picked])
        loss = nn.functional.cross_entropy(out, y[picked])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        accuracy = (out.argmax(1) == y[picked]).float().mean()
        if DEFERRED:
            loss_sum += loss.detach()
            right_sum += accuracy
            if (step + 1) % READ_EVERY == 0:
                logged.append((loss_sum.item() / READ_EVERY, right_sum.item() / READ_EVERY))
                loss_sum.zero_()
                right_sum.zero_()
        else:
            logged.append((loss.item(), accuracy.item()))
        if (step + 1) % BLOCK == 0:
            sync()
            now = time.perf_counter()
            block_ms.append((now - start) * 1e3 / BLOCK)
            start = now
    print(f"last loss {logged[-1][0]:.4f}, accuracy {logged[-1][1]:.3f}")
    steady = block_ms[1:] or block_ms
    print("SCRIPT_TIMER " + json.dumps({"median_ms": statistics.median(steady),
                                        "blocks_ms": block_ms, "deferred": DEFERRED}))


if __name__ == "__main__":
    main()
