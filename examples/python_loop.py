"""Planted problem: a per-element Python loop writes prompt embeddings one row at a time (the
DGCA-ReLM pattern of docs/field-cases.md#case-1). Each iteration launches its own small device
ops. `python python_loop.py [STEPS]` (default 40)."""

import sys

import torch
from torch import nn

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
BATCH, SEQ, HIDDEN, SLOTS = 32, 64, 128, 6


class PromptModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, HIDDEN)
        self.prompt = nn.Parameter(torch.randn(SLOTS, HIDDEN))
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(HIDDEN, 4, 256, batch_first=True), 1)
        self.head = nn.Linear(HIDDEN, 1000)

    def forward(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i in range(tokens.shape[0]):
            for j in range(SLOTS):
                x[i, slots[i, j], :] = self.prompt[j]
        return self.head(self.encoder(x))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = PromptModel().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 1000, (BATCH, SEQ), device=device)
    slots = torch.stack([torch.randperm(SEQ)[:SLOTS] for _ in range(BATCH)]).to(device)
    for _ in range(STEPS):
        logits = model(tokens, slots)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
