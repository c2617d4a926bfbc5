"""Planted problem: a dataset kept as a list of Python objects, read by many DataLoader
workers. Each worker is a fork of the script: reading an object touches its reference count,
so copy-on-write copies the page it lies on into that worker, and the workers' copies grow
step after step until the host's memory (or the container's limit) runs out and the kernel's
out-of-memory killer ends the run with SIGKILL: exit 137, no Python traceback.

Run it only under a memory limit (benchmarks/host_oom.py puts it in a cgroup of a few hundred
MiB): on a machine without one it takes WORKERS copies of the dataset from the machine.
"""

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

ROWS = int(os.environ.get("HOST_OOM_ROWS", "200000"))  # ~110 MiB of Python objects
WORKERS = int(os.environ.get("HOST_OOM_WORKERS", "6"))
WINDOW = 512  # neighbours each sample reads: how fast each worker copies the dataset
STEPS = 400
BATCH = 64
FEATURES = 16


class RowsDataset(Dataset):
    """Each row a Python list of floats: the form a CSV read row by row takes."""

    def __init__(self) -> None:
        self.rows = [[float(i % 97 + j) for j in range(FEATURES)] for i in range(ROWS)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        # A window of neighbours per sample (a rolling feature): each read touches their
        # reference counts, so their pages are copied into this worker.
        start = (index * 97) % (ROWS - WINDOW)
        window = self.rows[start:start + WINDOW]
        return torch.tensor(window[0]) + sum(row[0] for row in window) / len(window)


def main() -> None:
    torch.manual_seed(0)
    loader = DataLoader(RowsDataset(), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while step < STEPS:
        for batch in loader:
            loss = model(batch).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == STEPS:
                break


if __name__ == "__main__":
    main()
