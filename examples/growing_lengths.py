"""Planted problem (GPU memory): batches whose sequence length grows step after step (a length
curriculum, or batches sorted by length), so each step's activations are larger than any
before: the caching allocator finds no cached block that fits and asks the driver with
cudaMalloc, step after step, and its cache fills with blocks of sizes no later step wants.

The knob is the allocator's configuration (GD405): `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:
True` grows one segment instead; `gpudiag profile --try-fixes` measures it (an environment
change, no file edited). `STEPS` sets the steps (80). `MEM_CAP_GIB` caps what the process may
allocate (torch.cuda.set_per_process_memory_fraction): the cache of unusable blocks then runs
into the cap, and the allocator frees all of it and retries (a device sync each time).
"""

import os

import torch
from torch import nn

STEPS = int(os.environ.get("STEPS", "80"))
CAP_GIB = float(os.environ.get("MEM_CAP_GIB", "0"))
CUDA = torch.cuda.is_available()
device = "cuda" if CUDA else "cpu"
WIDTH, BATCH, FIRST, GROWTH = (1024, 16, 256, 64) if CUDA else (64, 2, 16, 4)


def main() -> None:
    torch.manual_seed(0)
    if CUDA and CAP_GIB:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB * 2**30 / total))
    model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                          nn.Linear(4 * WIDTH, WIDTH)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=CUDA)
    for step in range(STEPS):
        length = FIRST + GROWTH * step
        x = torch.randn(BATCH, length, WIDTH, device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=CUDA):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    print(f"last length {length}, loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
