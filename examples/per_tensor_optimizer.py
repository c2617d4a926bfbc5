"""Planted problem: AdamW built with foreach=False over 800 small parameter tensors, so every
optimizer.step() runs ~8 small ops per tensor (thousands of kernel launches per step on a GPU).

The knob is the optimizer's implementation at the line that builds it (GD106): fused=True.
`FUSED=1` builds it fused instead, for a plain A/B with the script's own timer
(benchmarks/knobs_ab.py); gpudiag's --try-fixes applies the same change to the unmodified
script.
"""

import json
import os
import statistics
import time

import torch
from torch import nn

STEPS = int(os.environ.get("STEPS", "60"))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # 200 blocks of Linear + LayerNorm: 800 parameter tensors of 64 or 64x64 elements.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
                            for _ in range(200)]).to(device)
    if os.environ.get("FUSED") == "1":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    x = torch.randn(256, 64, device=device)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    steady = times[5:]
    print("SCRIPT_TIMER " + json.dumps({"median_ms": statistics.median(steady),
                                        "mean_ms": statistics.fmean(steady),
                                        "loss": float(loss)}))


if __name__ == "__main__":
    main()
