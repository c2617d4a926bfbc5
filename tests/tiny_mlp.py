"""A model for tests of `gpudiag run` that are about processes, not models (signals, trials,
DDP accumulation): a plain-torch MLP through the `--model file.py:factory` door README's "Your
own model" documents. The built-in models are BERT-based, and importing transformers' BERT
costs each fresh process ~5 s of CPU (a quarter of such a test); this one costs nothing."""

from __future__ import annotations

from pathlib import Path

import torch

from gpudiag.measure.models import ModelBundle, ModelOptions

WIDTH = 512  # ~0.8 M parameters: a DDP all-reduce of 3 MB, which gloo takes milliseconds on
MODEL = f"{Path(__file__).resolve()}:factory"  # what `--model` takes


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
            torch.nn.Linear(WIDTH, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)


def factory(options: ModelOptions) -> ModelBundle:
    """A four-layer MLP regressor (tests/tiny_mlp.py)."""
    del options  # one size: what the tests need of it is processes, not shapes

    def example(i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(64, generator=g), "y": torch.randn((), generator=g)}

    return ModelBundle(model=_Regressor(), make_example=example, description="tiny MLP")
