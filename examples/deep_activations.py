"""Planted problem (memory): a deep stack of MLP blocks whose activations, kept for backward,
are most of the step's memory (a long sequence through a wide model: the usual reason a
fine-tuning run does not fit). `MEM_CAP_GIB` caps what the process may allocate on a GPU
(torch.cuda.set_per_process_memory_fraction), so that it dies of out-of-memory where its
activations do not fit (GD404), or runs near the cap (GD401). A CPU run is not capped (the CPU
allocator has no cap of its own; a process limit such as RLIMIT_DATA would also count what the
C allocator keeps after a free) and runs a small size.

The knob is activation checkpointing (`CHECKPOINT=1` here, what `gpudiag profile --try-fixes`
measures without it): each block's forward recomputed in backward instead of its activations
kept, about 1/5 of them kept (each block's input), for one more forward's time.
`STEPS` sets the steps (30).
"""

import os

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

STEPS = int(os.environ.get("STEPS", "30"))
CAP_GIB = float(os.environ.get("MEM_CAP_GIB", "0"))
CHECKPOINT = os.environ.get("CHECKPOINT") == "1"
CUDA = torch.cuda.is_available()
device = "cuda" if CUDA else "cpu"
# (tokens a step, width, blocks): 1.3 GiB of fp32 activations a block on a GPU, 2.5 MiB on a CPU.
TOKENS, WIDTH, BLOCKS = (16_384, 2_048, 12) if CUDA else (2_048, 32, 6)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if CHECKPOINT else block(x)
        return self.head(x)


def main() -> None:
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    model = Model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(TOKENS, WIDTH, device=device)
    target = torch.randn(TOKENS, 1, device=device)
    if CUDA and CAP_GIB:  # what the process may allocate, as the field's capped runs had it
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB * 2**30 / total))
    for _ in range(STEPS):
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
