"""A clean training loop: a small Transformer classifier, a DataLoader over in-memory data, one
optimizer step per batch. gpudiag profile should find nothing to warn about."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 60


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = TensorDataset(torch.randint(0, 1000, (4096, 64)), torch.randint(0, 2, (4096,)))
    loader = DataLoader(data, batch_size=32, shuffle=True, drop_last=True,
                        pin_memory=device == "cuda")
    model = nn.Sequential(nn.Embedding(1000, 128),
                          nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 512,
                                                                           batch_first=True), 2),
                          nn.Flatten(), nn.Linear(128 * 64, 2)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = 0
    while step < STEPS:
        for tokens, labels in loader:
            tokens = tokens.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = nn.functional.cross_entropy(model(tokens), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == STEPS:
                break


if __name__ == "__main__":
    main()
