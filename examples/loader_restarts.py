"""Planted problem: a DataLoader with 8 workers and no persistent_workers over a short epoch (8
batches), so each epoch starts 8 worker processes, waits for their first batch and shuts them
down again: at these sizes most of the training loop.

The knob is the DataLoader's persistent_workers at the line that builds it (GD204).
`PERSISTENT=1` builds it with persistent_workers=True, for a plain A/B with the script's own
timer (benchmarks/knobs_ab.py); gpudiag's --try-fixes applies the same change to the
unmodified script.
"""

import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = int(os.environ.get("EPOCHS", "12"))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = TensorDataset(torch.randn(512, 3, 32, 32), torch.randint(0, 10, (512,)))
    loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=8,
                        persistent_workers=os.environ.get("PERSISTENT") == "1")
    model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(64 * 32 * 32, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.perf_counter()
    first_epoch_s = None
    for epoch in range(EPOCHS):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if epoch == 0:
            first_epoch_s = time.perf_counter() - start
    loop_s = time.perf_counter() - start
    # The loop after the first epoch: what restarting workers costs beyond start-up.
    print("SCRIPT_TIMER " + json.dumps({"loop_s": loop_s, "first_epoch_s": first_epoch_s,
                                        "later_epochs_s": loop_s - (first_epoch_s or 0.0),
                                        "loss": float(loss)}))


if __name__ == "__main__":
    main()
