"""Planted problem: autograd's anomaly detection, turned on while chasing a NaN, left on for the
whole training run. Every operator records its stack for backward and every backward checks its
outputs: the step is much slower than it needs to be. `python debug_left_on.py [STEPS]`
(default 60)."""

import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
BATCH, WIDTH, DEPTH = 32, 64, 12


def main() -> None:
    torch.manual_seed(0)
    torch.autograd.set_detect_anomaly(True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(BATCH, WIDTH, device=device)
    targets = torch.randint(0, 10, (BATCH,), device=device)
    for _ in range(STEPS):
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
