"""Planted problem: per-sample losses read back to the host one by one for logging (a `.item()`
per sample, each a device-to-host sync), and `torch.cuda.empty_cache()` every step."""

import torch
from torch import nn

STEPS = 40


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    width, batch = (2048, 128) if device == "cuda" else (256, 32)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(6)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)
    target = torch.randn(batch, width, device=device)
    history = []
    for _ in range(STEPS):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(x)
        per_sample = nn.functional.mse_loss(out.float(), target, reduction="none").mean(1)
        for value in per_sample:
            history.append(value.item())
        per_sample.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
