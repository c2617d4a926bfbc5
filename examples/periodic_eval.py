"""A plain training loop with periodic work, timing itself: an evaluation over its own
DataLoader every --eval-every steps (in evaluate(), called from the loop), a checkpoint every
--save-every steps. Writes truth.json beside it in the working directory: every step's,
evaluation's and save's time from a plain perf_counter timer (CUDA-synchronised), the ground
truth for gpudiag's whole-run figures (reports/examples/h100-periodic)."""

import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--eval-every", type=int, default=20)
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--tensor-eval", action="store_true",
                    help="evaluate over in-memory tensors, not a DataLoader")
parser.add_argument("--slow-after-ms", type=float, default=0.0,
                    help="make the step after each evaluation this much slower")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                            torch.nn.Linear(2048, 2048), torch.nn.GELU(),
                            torch.nn.Linear(2048, 1)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
train = DataLoader(TensorDataset(torch.randn(64 * 256, 512), torch.randn(64 * 256, 1)),
                   batch_size=256, shuffle=True)
val = DataLoader(TensorDataset(torch.randn(64 * 256, 512), torch.randn(64 * 256, 1)),
                 batch_size=256)
val_x, val_y = (t.to(device) for t in val.dataset.tensors)  # type: ignore[attr-defined]
truth: dict[str, list[float]] = {"step_ms": [], "eval_ms": [], "save_ms": []}


def sync() -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def evaluate() -> float:
    total = 0.0
    batches = (zip(val_x.split(256), val_y.split(256), strict=True) if args.tensor_eval
               else val)
    with torch.no_grad():
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            total += torch.nn.functional.mse_loss(model(x), y).item()
    return total


step = 0
while step < args.steps:
    for x, y in train:
        started = time.perf_counter()
        if args.slow_after_ms and step % args.eval_every == 1 and step > 1:
            time.sleep(args.slow_after_ms / 1e3)
        x, y = x.to(device), y.to(device)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        truth["step_ms"].append((time.perf_counter() - started) * 1e3)
        step += 1
        if step % args.eval_every == 0 and step < args.steps:
            started = time.perf_counter()
            evaluate()
            truth["eval_ms"].append((time.perf_counter() - started) * 1e3)
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            started = time.perf_counter()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, "ckpt.pt")
            truth["save_ms"].append((time.perf_counter() - started) * 1e3)
        if step >= args.steps:
            break
with open("truth.json", "w") as f:
    json.dump(truth, f)
