"""A tiny deterministic Accelerate job (benchmarks/same_job.py): 30 steps of batch 8 per
process, one line per step. `python accelerate_job.py`, or under torchrun for DDP on CPU."""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

STEPS, BATCH = 30, 8


def say(step: str) -> None:
    """One step's line, in one write: a job's ranks share one pipe."""
    sys.stdout.write(f"SAMEJOB {step}\n")
    sys.stdout.flush()


def main() -> None:
    torch.set_num_threads(1)  # one reduction order: losses comparable bit for bit
    accelerator = Accelerator(cpu=True)
    generator = torch.Generator().manual_seed(0)
    size = STEPS * BATCH * accelerator.num_processes
    data = TensorDataset(torch.randn(size, 16, generator=generator),
                         torch.randint(0, 4, (size,), generator=generator))
    set_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        say(json.dumps({"rank": accelerator.process_index, "step": step,
                                       "batch": len(x), "loss": repr(loss.item())}))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    # The process group destroyed before exit: left to the interpreter's teardown, gloo's
    # threads can abort the process ("terminate called without an active exception").
    accelerator.end_training()


if __name__ == "__main__":
    main()
