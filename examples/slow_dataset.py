"""Planted problem: a Dataset that tokenises text in Python on every access, read with no
DataLoader workers, so the training step waits for the host each batch."""

import random

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

STEPS = 40
VOCAB = 1000
WORDS = [f"w{i}" for i in range(VOCAB)]


class TextDataset(Dataset):
    def __init__(self) -> None:
        rng = random.Random(0)
        self.texts = [" ".join(rng.choices(WORDS, k=256)) for _ in range(512)]
        self.vocab = {w: i for i, w in enumerate(WORDS)}

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> torch.Tensor:
        tokens = [self.vocab[w] for w in self.texts[index].split()] * 8  # slow, per item
        return torch.tensor(sorted(tokens)[:64])


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = DataLoader(TextDataset(), batch_size=64, shuffle=True, num_workers=0)
    model = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Flatten(), nn.Linear(64 * 64, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    while step < STEPS:
        for tokens in loader:
            tokens = tokens.to(device)
            loss = model(tokens).logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == STEPS:
                break


if __name__ == "__main__":
    main()
