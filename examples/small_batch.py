"""Planted problem (launch-bound): a small Transformer classifier trained at batch 8 from a
DataLoader, on a GPU with room for a hundred times the batch. Each step launches the same few
hundred kernels whatever the batch, and each is too small to fill the GPU: the host's launch
rate, not the GPU, sets the pace (GD104, GD102). The step uses a fraction of a percent of the
device: the first thing to try is a larger batch (`gpudiag profile --try-fixes` measures one,
in samples per second; it changes the recipe: the learning rate and the steps go with it).
`BATCH` sets the batch (8), `STEPS` the steps (200).
"""

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH = int(os.environ.get("BATCH", "8"))
STEPS = int(os.environ.get("STEPS", "200"))


def build(device: str) -> tuple[nn.Module, TensorDataset]:
    """The model and its data (benchmarks/batch_ab.py times the same at two batches)."""
    width, layers, seq = (512, 4, 128) if device == "cuda" else (64, 2, 32)
    data = TensorDataset(torch.randint(0, 1000, (16_384, seq)), torch.randint(0, 2, (16_384,)))
    model = nn.Sequential(nn.Embedding(1000, width),
                          nn.TransformerEncoder(nn.TransformerEncoderLayer(
                              width, 8, 4 * width, batch_first=True), layers,
                              enable_nested_tensor=False),
                          nn.Flatten(), nn.Linear(width * seq, 2)).to(device)
    return model, data


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, data = build(device)
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = 0
    while step < STEPS:
        for batch, labels in loader:
            loss = nn.functional.cross_entropy(model(batch.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == STEPS:
                break


if __name__ == "__main__":
    main()
