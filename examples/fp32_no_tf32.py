"""Planted problem (GPU): fp32 training with TF32 matmuls switched off, on a GPU whose tensor
cores would run the same matmuls in TF32 or bf16 several times faster."""

import torch
from torch import nn

STEPS = 40

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)]).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1024, 4096, device=device)
    for _ in range(STEPS):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
