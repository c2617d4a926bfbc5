"""Hand-written attention against its fixes, interleaved in one process:
examples/attention_block.py's model (two blocks, width 1024, 16 heads, batch 4, sequence 2048,
bf16 autocast) as written ("hand-written"), the same model under torch.compile ("compiled":
what --try-fixes' compile-model does) and with F.scaled_dot_product_attention ("sdpa"), one
training step per sample, timed with CUDA events, in alternating blocks of each (forward and
reverse order in turn), after a warm-up. Prints and writes the median step of each, and the
ratio hand-written / each fix with a bootstrap 95% interval over blocks: the measured gains
of the fixes GD304 names, against its price (reports/examples/h100-memory-bound).

    python benchmarks/attention_sdpa.py --out attention_sdpa.json
    python benchmarks/attention_sdpa.py --width 256 --heads 4 --batch 32 --variants \
        sdpa,sdpa-compiled
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


def _ratio(base: list[float], fix: list[float]) -> tuple[float, tuple[float, float]]:
    """The median over blocks of base / fix, and its bootstrap 95% interval."""
    pairs = [a / b for a, b in zip(base, fix, strict=True)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(pairs, k=len(pairs))) for _ in range(BOOTSTRAP))
    return statistics.median(pairs), (boot[int(0.025 * BOOTSTRAP)],
                                       boot[int(0.975 * BOOTSTRAP) - 1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--variants", default="hand-written,compiled,sdpa",
                        help="the first is the baseline; NAME or NAME-compiled, NAME one of "
                             "hand-written, sdpa")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of each variant")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    x = torch.randn(args.batch, args.seq, args.width, device="cuda")
    variants: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for name in args.variants.split(","):
        net = model(args.width, args.heads, 2, name.startswith("sdpa"), "cuda")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
        variants[name] = (torch.compile(net) if name == "compiled" or
                          name.endswith("-compiled") else net, opt)

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
    base, *fixes = variants
    measured = {fix: _ratio(medians[base], medians[fix]) for fix in fixes}
    ratios = {fix: r for fix, (r, _) in measured.items()}
    intervals = {fix: list(ci) for fix, (_, ci) in measured.items()}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "seq": args.seq, "width": args.width, "heads": args.heads, "batch": args.batch,
              "blocks": args.blocks, "steps_per_block": args.steps, "baseline": base,
              "median_ms": {n: statistics.median(v) for n, v in samples.items()},
              "ratio": ratios, "ratio_ci95": intervals, "step_ms": samples,
              "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9}
    for fix in fixes:
        print(f"{base} {result['median_ms'][base]:.2f} ms, {fix} {result['median_ms'][fix]:.2f}"
              f" ms per step: {ratios[fix]:.2f}x (95% CI {intervals[fix][0]:.2f}-"
              f"{intervals[fix][1]:.2f}); the fix saves {1 - 1 / ratios[fix]:.0%}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
