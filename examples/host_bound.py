"""A plain training loop whose host sets the pace, timing itself: with --augment, every sample
of a batch is augmented in numpy on the training thread before `.to(device)` (rotations, a
flip, per-image normalisation); with --log, every step reads its loss and accuracy back with
`.item()` for logging and calls `torch.cuda.empty_cache()`. Writes truth.json in the working
directory: each step's time, and the time of the augmentation and of the logging line, from a
plain perf_counter timer (the ground truth for gpudiag's host time by line,
reports/examples/h100-host)."""

import argparse
import json
import time

import numpy as np
import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--augment", action="store_true")
parser.add_argument("--log", action="store_true")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
rng = np.random.default_rng(0)
images = rng.random((512, 64, 64, 3), dtype=np.float32)
labels = rng.integers(0, 100, 512)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
    torch.nn.Flatten(), torch.nn.Linear(128 * 16, 100)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
truth: dict[str, list[float]] = {"step_ms": [], "augment_ms": [], "log_ms": []}


def augment(image: np.ndarray) -> np.ndarray:
    image = np.rot90(image, k=int(rng.integers(4)))
    if rng.random() < 0.5:
        image = image[:, ::-1]
    image = np.ascontiguousarray(image)
    return (image - image.mean(axis=(0, 1))) / (image.std(axis=(0, 1)) + 1e-6)


batch_ids = np.arange(64)
history = []
for step in range(args.steps):
    started = time.perf_counter()
    picked = rng.integers(0, 512, 64)
    if args.augment:
        batch = np.stack([augment(images[i]) for i in picked])
    else:
        batch = images[picked]
    augmented = time.perf_counter()
    x = torch.from_numpy(batch).permute(0, 3, 1, 2).to(device)
    y = torch.from_numpy(labels[picked]).to(device)
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    logged = time.perf_counter()
    if args.log:
        history.append((loss.item(), (out.argmax(1) == y).float().mean().item()))
        if device == "cuda":
            torch.cuda.empty_cache()
    ended = time.perf_counter()
    truth["augment_ms"].append((augmented - started) * 1e3)
    truth["log_ms"].append((ended - logged) * 1e3)
    truth["step_ms"].append((ended - started) * 1e3)
with open("truth.json", "w") as f:
    json.dump(truth, f)
