"""Planted problem (GPU): every batch is built in ordinary (pageable) host memory and copied
synchronously; no pinned memory, no overlap with compute."""

import torch
from torch import nn

STEPS = 40


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    host_batches = [torch.randn(8192, 2048) for _ in range(4)]  # 64 MB each, pageable
    for step in range(STEPS):
        x = host_batches[step % 4].to(device)
        loss = model(x).logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
