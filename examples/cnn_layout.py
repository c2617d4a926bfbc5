"""Planted problem (GPU): a ResNet-style classifier (convolution, BatchNorm, ReLU blocks) trained
under bf16 autocast in PyTorch's default NCHW (channels_first) memory format. Tensor-core
convolutions want NHWC: cuDNN transposes each NCHW activation to NHWC and back around its
convolutions (`nchwToNhwcKernel`), and its NCHW batch norms are slower than the NHWC ones.

The knob is the memory format at the lines that build the model and make the input (GD306):
`model.to(memory_format=torch.channels_last)` and `x.to(memory_format=torch.channels_last)`.
`CHANNELS_LAST=1` trains in channels_last instead, for a plain A/B with the script's own
timer; gpudiag's --try-fixes applies the same change to the unmodified script
(`--fix channels-last`). On a CPU it runs a small size in seconds (the layout costs little
there); on CUDA a larger one.
"""

import json
import os
import statistics
import time

import torch
from torch import nn

STEPS = int(os.environ.get("STEPS", "40"))
CHANNELS_LAST = os.environ.get("CHANNELS_LAST") == "1"
CUDA = torch.cuda.is_available()
# (batch, image side, widths of the stages): a CPU-sized default, a GPU-sized one on CUDA.
BATCH, SIDE, WIDTHS = (128, 128, (64, 128, 256)) if CUDA else (8, 32, (8, 16, 32))
CLASSES = 100


class Block(nn.Module):
    """Two 3x3 convolutions with BatchNorm and ReLU, and a residual connection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, WIDTHS[0], 3, padding=1, bias=False),
                                   nn.BatchNorm2d(WIDTHS[0]), nn.ReLU()]
        for i, width in enumerate(WIDTHS):
            if i:  # a strided convolution halves the side and widens the stage
                layers += [nn.Conv2d(WIDTHS[i - 1], width, 3, stride=2, padding=1, bias=False),
                           nn.BatchNorm2d(width), nn.ReLU()]
            layers += [Block(width), Block(width)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(WIDTHS[-1], CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if CUDA else "cpu"
    model = Net().to(device)
    if CHANNELS_LAST:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(BATCH, 3, SIDE, SIDE, device=device)
    if CHANNELS_LAST:
        x = x.to(memory_format=torch.channels_last)
    y = torch.randint(0, CLASSES, (BATCH,), device=device)
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=CUDA):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if CUDA:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    steady = times[5:]
    print("SCRIPT_TIMER " + json.dumps({"median_ms": statistics.median(steady),
                                        "mean_ms": statistics.fmean(steady),
                                        "channels_last": CHANNELS_LAST,
                                        "loss": loss.item()}))


if __name__ == "__main__":
    main()
