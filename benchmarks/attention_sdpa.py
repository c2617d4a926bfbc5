"""Hand-written attention against F.scaled_dot_product_attention, interleaved in one process:
examples/attention_block.py's model (two blocks, width 1024, 16 heads, batch 4, sequence 2048,
bf16 autocast), one training step per sample, timed with CUDA events, in alternating blocks of
each (ABBA order), after a warm-up. Prints and writes the median step of each, and the ratio
hand-written / fused with a bootstrap 95% interval over blocks: the measured gain of the fix
GD304 names (reports/examples/h100-memory-bound).

    python benchmarks/attention_sdpa.py --out attention_sdpa.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

BOOTSTRAP = 2000


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, fused: bool) -> None:
        super().__init__()
        self.heads, self.fused = heads, fused
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, c))


def model(width: int, heads: int, layers: int, fused: bool, device: str) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.LayerNorm(width), Attention(width, heads, fused), nn.LayerNorm(width),
                   nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))]
    return nn.Sequential(*blocks).to(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=20, help="blocks of each variant")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    x = torch.randn(4, args.seq, 1024, device="cuda")
    variants = {}
    for name, fused in (("hand-written", False), ("sdpa", True)):
        net = model(1024, 16, 2, fused, "cuda")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
        variants[name] = (net, opt)

    def step(name: str) -> float:
        net, opt = variants[name]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    for name in variants:  # warm-up
        for _ in range(5):
            step(name)
    samples: dict[str, list[float]] = {n: [] for n in variants}
    medians: dict[str, list[float]] = {n: [] for n in variants}
    for k in range(args.blocks):
        order = list(variants) if k % 2 == 0 else list(reversed(variants))  # ABBA
        for name in order:
            block = [step(name) for _ in range(args.steps)]
            samples[name] += block
            medians[name].append(statistics.median(block))
    ratios = [a / b for a, b in zip(medians["hand-written"], medians["sdpa"], strict=True)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                  for _ in range(BOOTSTRAP))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "seq": args.seq, "blocks": args.blocks, "steps_per_block": args.steps,
              "median_ms": {n: statistics.median(v) for n, v in samples.items()},
              "ratio": statistics.median(ratios),
              "ratio_ci95": [boot[int(0.025 * BOOTSTRAP)], boot[int(0.975 * BOOTSTRAP) - 1]],
              "step_ms": samples,
              "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}
    print(f"hand-written {result['median_ms']['hand-written']:.2f} ms, sdpa "
          f"{result['median_ms']['sdpa']:.2f} ms per step: {result['ratio']:.2f}x "
          f"(95% CI {result['ratio_ci95'][0]:.2f}-{result['ratio_ci95'][1]:.2f})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
