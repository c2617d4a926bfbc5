"""Planted problem under torch.compile: the model is compiled, the input is not. Each sample
is built in the DataLoader's main process (num_workers=0) with Python-side work, so the GPU
waits for data every step.

    python compiled_slow_loader.py [STEPS]   (default 80)
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

BATCH, SEQ, HIDDEN = 64, 128, 512


class Tokens(Dataset):
    def __len__(self) -> int:
        return 10_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 4096, (SEQ,), generator=g)
        return torch.tensor([int(t) % 4096 for t in ids.tolist()])  # per-token Python work


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Embedding(4096, HIDDEN), nn.TransformerEncoder(
        nn.TransformerEncoderLayer(HIDDEN, 8, 4 * HIDDEN, batch_first=True), 4),
        nn.Linear(HIDDEN, 4096)).to(device)
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(Tokens(), batch_size=BATCH, num_workers=0)
    for step, batch in enumerate(loader):
        tokens = batch.to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = compiled(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step + 1 == steps:
            break


if __name__ == "__main__":
    main()
