"""Planted problem: per-step host reads (`.item()` for logging and a Python branch on a device
value) and `torch.cuda.empty_cache()` every step."""

import torch
from torch import nn

STEPS = 40


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(128, 512, device=device)
    history = []
    for _ in range(STEPS):
        out = model(x)
        loss = out.square().mean()
        for layer in model:  # per-layer weight norms, read back one by one
            history.append(layer.weight.norm().item())
        if out.abs().max().item() > 1e3:
            continue
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
