"""Planted problem: a full blocking checkpoint (model and optimizer) every 5 steps.

On a GPU the batch is large enough that five steps take longer than writing one checkpoint
(about 100 MB), the case a background save is for; on a CPU it stays small, for speed."""

import tempfile
from pathlib import Path

import torch
from torch import nn

STEPS = 60
SAVE_EVERY = 5


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32768 if device == "cuda" else 64, 1024, device=device)
    with tempfile.TemporaryDirectory() as out:
        for step in range(1, STEPS + 1):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % SAVE_EVERY == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, Path(out) / "checkpoint.pt")


if __name__ == "__main__":
    main()
