"""Transformer blocks with attention written by hand (matmul, scale, causal mask, softmax,
matmul) under bf16 autocast at sequence length 2048, or with `--sdpa`
F.scaled_dot_product_attention (a fused kernel); `--compile` compiles the model (as
--try-fixes' compile-model does). Times itself: truth.json in the working
directory holds every step's CUDA-synchronised time (reports/examples/h100-memory-bound)."""

import argparse
import json
import math
import time

import torch
from torch import nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--seq", type=int, default=2048)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--heads", type=int, default=16)
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--sdpa", action="store_true", help="fused attention")
parser.add_argument("--compile", action="store_true", help="the model under torch.compile")
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":
    args.seq, args.width, args.batch = min(args.seq, 256), min(args.width, 128), 2


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if args.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            y = scores.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


torch.manual_seed(0)
model = nn.Sequential(*[Block(args.width, args.heads) for _ in range(args.layers)]).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
if args.compile:
    model.compile()
x = torch.randn(args.batch, args.seq, args.width, device=device)
truth: dict[str, list[float]] = {"step_ms": []}
for step in range(args.steps):
    started = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    truth["step_ms"].append((time.perf_counter() - started) * 1e3)
with open("truth.json", "w") as f:
    json.dump(truth, f)
