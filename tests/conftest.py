"""Shared fixtures: tiny CPU configs, one recorded tiny ladder run, a fake GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpudiag.measure.plan import build_config
from gpudiag.measure.runner import RunOutput, run_stages
from gpudiag.measure.stages import DEFAULT_LADDER
from gpudiag.measure.telemetry.fake import fake_spec
from gpudiag.model.config import PRESETS, RunConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "reports" / "examples"


def tiny_config(model: str = "dgca", **overrides: Any) -> RunConfig:
    """The tiny preset on the CPU, with few steps so a whole ladder takes seconds."""
    options: dict[str, Any] = {"preset": "tiny", "device": "cpu", "iters": 4, "warmup": 1,
                               "loader_workers": 1}
    options.update(overrides)
    config, _ = build_config(model=model, **options)
    return config


def ladder_config(**fields: Any) -> RunConfig:
    """A recorded ladder run's config without building one (no device query): the tiny preset
    on the CPU, with `fields` replaced."""
    tiny = PRESETS["tiny"]
    values: dict[str, Any] = {
        "model": "dgca", "preset": "tiny", "device": "cpu", "stages": (), "shape": tiny.shape,
        "batch_size": tiny.batch_size, "seq_len": tiny.seq_len, "iters": tiny.iters,
        "warmup": tiny.warmup, "min_seconds": tiny.min_seconds}
    return RunConfig(**{**values, **fields})


@pytest.fixture(scope="session")
def tiny_ladder() -> RunOutput:
    """The whole default ladder of the dgca model on the CPU, with a fake GPU's telemetry."""
    config = tiny_config(stages=list(DEFAULT_LADDER))
    return run_stages(config, telemetry_spec=fake_spec([(0.0, 250.0)]))
