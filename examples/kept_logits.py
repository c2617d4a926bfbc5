"""Planted problem (memory): a fine-tuning loop that appends each step's logits to a Python list
for an end-of-run metric. The logits (batch x sequence x vocabulary, bf16 on a GPU: 131 MB a
step) stay on the device with the list holding them: memory grows by that much every step
until the device runs out (issue 57's field report: 16.4 GB after 120 steps, against 1.65 GB
keeping a slice). `MEM_CAP_GIB` caps what the process may allocate on the GPU
(torch.cuda.set_per_process_memory_fraction), so that it dies of out-of-memory as the field
report's capped run did (GD404).

The knob is the line that keeps them (GD403): keep what the metric needs (`KEEP=slice` keeps the
last position's argmax, a few KB, on the CPU). `STEPS` sets the steps (60); on a CPU a small
size (8 MB a step) runs in seconds.
"""

import os

import torch
from torch import nn

STEPS = int(os.environ.get("STEPS", "60"))
KEEP = os.environ.get("KEEP", "all")
CAP_GIB = float(os.environ.get("MEM_CAP_GIB", "0"))
CUDA = torch.cuda.is_available()
device = "cuda" if CUDA else "cpu"
# (batch, sequence, vocabulary, width): 131 MB of bf16 logits a step on CUDA; 8 MB fp32 on a CPU.
BATCH, SEQ, VOCAB, WIDTH = (8, 256, 32_000, 512) if CUDA else (4, 64, 8_000, 64)


def main() -> None:
    torch.manual_seed(0)
    if CUDA and CAP_GIB:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                          nn.Linear(WIDTH, VOCAB)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
    all_logits = []
    for _ in range(STEPS):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=CUDA):
            logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                           tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if KEEP == "all":
            all_logits.append(logits.detach())
        else:
            all_logits.append(logits[:, -1].argmax(-1).cpu())
    kept = sum(t.numel() * t.element_size() for t in all_logits)
    print(f"kept {len(all_logits)} tensors, {kept / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
