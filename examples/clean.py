"""A clean training loop: a Transformer classifier (bf16 autocast on a GPU), a DataLoader over in-memory data, one
optimizer step per batch. gpudiag profile should find nothing to warn about."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 60


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Sized for the device: a GPU gets enough work per step to stay busy.
    width, layers, batch, seq = (768, 6, 128, 128) if device == "cuda" else (64, 2, 32, 32)
    data = TensorDataset(torch.randint(0, 1000, (4096, seq)), torch.randint(0, 2, (4096,)))
    loader = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True,
                        pin_memory=device == "cuda")
    model = nn.Sequential(nn.Embedding(1000, width),
                          nn.TransformerEncoder(nn.TransformerEncoderLayer(
                              width, 8, 4 * width, batch_first=True), layers),
                          nn.Flatten(), nn.Linear(width * seq, 2)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    step = 0
    while step < STEPS:
        for tokens, labels in loader:
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
                loss = nn.functional.cross_entropy(model(tokens), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == STEPS:
                break


if __name__ == "__main__":
    main()
