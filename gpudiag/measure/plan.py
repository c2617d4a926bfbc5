"""The plan: the user's choices validated into a RunConfig, and device and precision selection:
everything a run needs decided before it starts."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from gpudiag.measure.models import resolve_model
from gpudiag.measure.stages import DEFAULT_LADDER, stage_names
from gpudiag.model.config import (
    DEFAULT_EVIDENCE_STEPS,
    PRESETS,
    ModelShape,
    RunConfig,
    evidence_window,
    timed_steps,
)
from gpudiag.model.errors import BadInput
from gpudiag.model.options import RunOptions, check_ranges

T = TypeVar("T")


def resolve_device(requested: str | None) -> str:
    """`None` picks cuda when torch sees a GPU, else cpu. Refuses devices that are not there."""

    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    spec = requested.strip().lower()
    if spec == "cpu":
        return "cpu"
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise BadInput(f"--device {requested}: no CUDA device is visible to torch; "
                           "use --device cpu")
        if spec == "cuda":
            return "cuda"
        index = spec.removeprefix("cuda:")
        if not index.isdigit():
            raise BadInput(f"--device {requested}: expected cuda:N with N a GPU index")
        count = torch.cuda.device_count()
        if int(index) >= count:
            raise BadInput(f"--device {requested}: only {count} CUDA device(s) visible "
                           f"(cuda:0..cuda:{count - 1})")
        return f"cuda:{int(index)}"
    raise BadInput(f"--device {requested}: expected cpu, cuda or cuda:N")


def build_config(options: RunOptions | None = None, /,
                 **given: Any) -> tuple[RunConfig, list[str]]:
    """Validate the user's choices (`RunOptions`, or its fields as keywords) into a RunConfig;
    return it with notes worth showing."""
    options = options if options is not None else RunOptions(**given)
    notes: list[str] = []
    model = resolve_model(options.model)  # an unknown model fails before any device work
    device = resolve_device(options.device)
    preset = options.preset
    if preset is None:
        preset = "full" if device.startswith("cuda") else "tiny"
        if preset == "tiny":
            notes.append("No CUDA device: running the small 'tiny' preset on the CPU "
                         "(--preset full to override).")
    if preset not in PRESETS:
        raise BadInput(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    check_ranges(options)
    chosen = PRESETS[preset]
    amp_dtype = options.amp_dtype or default_amp_dtype(device, notes)
    seq = options.seq_len or chosen.seq_len
    _check_sequence(seq, chosen.shape.max_positions, options.prompt_length)
    if model.source == "built-in":  # their shapes are the preset's (others' are their own)
        _check_fits(options.batch_size or chosen.batch_size, seq, chosen.shape, device)
    _check_distributed(options, device)
    given_values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    steps, budget = evidence_window(options.evidence_steps, DEFAULT_EVIDENCE_STEPS)
    iters, precision = timed_steps(options.iters, chosen.iters)
    config = RunConfig(**{
        **given_values, "preset": preset, "device": device, "stages": _stages(options.stages),
        "shape": chosen.shape, "batch_size": options.batch_size or chosen.batch_size,
        "seq_len": seq, "iters": iters, "timed_precision": precision,
        "warmup": _or(options.warmup, chosen.warmup),
        "min_seconds": _or(options.min_seconds, chosen.min_seconds), "amp_dtype": amp_dtype,
        "loader_workers": _or(options.loader_workers, default_loader_workers()),
        "evidence_steps": steps, "evidence_budget_s": budget})
    return config, notes


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _check_sequence(seq: int, max_positions: int, prompt_length: int) -> None:
    if seq > max_positions:
        raise BadInput(f"--seq-len {seq} exceeds the model's {max_positions} positions")
    if seq < 2 * prompt_length + 2:
        raise BadInput(f"--seq-len {seq} leaves no room for 2x{prompt_length} prompt slots and "
                       "a source sentence")


def _check_fits(batch: int, seq: int, shape: ModelShape, device: str) -> None:
    """Refuse a batch that cannot fit before building anything: a training step holds at least
    its fp32 logits over the vocabulary (and one layer's hidden states), batch x seq x
    max(vocab, hidden) x 4 bytes. A lower bound: sizes it lets through may still run out."""
    need = batch * seq * max(shape.vocab_size, shape.hidden_size) * 4
    have, what = memory_capacity(device)
    if need > have:
        raise BadInput(f"--batch-size {batch} x --seq-len {seq}: a step needs at least "
                       f"{need / 2**30:,.1f} GiB (its logits alone), more than the "
                       f"{have / 2**30:,.1f} GiB of {what}")


def memory_capacity(device: str) -> tuple[int, str]:
    """Bytes a step could use at most on `device`, and what they are."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        return torch.cuda.get_device_properties(index).total_memory, "this GPU's memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def check_run_options(options: RunOptions) -> None:
    """What build_config checks of `options` without loading the model: for `gate --base-ref`,
    before its worktree and --out exist (the model is each side's own, judged by its trials:
    a head whose model breaks is exit 5, not bad input)."""
    device = resolve_device(options.device)
    _stages(options.stages)
    _check_distributed(options, device)


def _check_distributed(options: RunOptions, device: str) -> None:
    if not options.node_rank < options.nnodes:
        raise BadInput(f"--node-rank {options.node_rank} must be in 0..{options.nnodes - 1} "
                       f"for --nnodes {options.nnodes}")
    if options.nnodes > 1 and not options.rdzv_endpoint:
        raise BadInput("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if (device.startswith("cuda") and options.nproc is not None
            and options.nproc > torch.cuda.device_count()):
        raise BadInput(f"--nproc {options.nproc}: only {torch.cuda.device_count()} CUDA "
                       "device(s) visible")


def _stages(requested: Sequence[str] | None) -> tuple[str, ...]:
    selected = tuple(requested) if requested else DEFAULT_LADDER
    unknown = [s for s in selected if s not in stage_names()]
    if unknown:
        raise BadInput(f"unknown stage {unknown[0]!r} (known: {', '.join(stage_names())})")
    return tuple(dict.fromkeys(selected))


def default_amp_dtype(device: str, notes: list[str]) -> str:
    """fp16 + GradScaler on GPUs, the seed's recipe. On a CPU, bf16 where the CPU computes it
    natively (oneDNN has no fp16 LSTM); elsewhere fp32, said in `notes`: on AVX2-only CPUs
    oneDNN cannot build the bf16 LSTM of the dgca model at all."""
    if device.startswith("cuda"):
        return "fp16"
    if cpu_bf16_native():
        return "bf16"
    notes.append("This CPU has no native bf16 (no AVX512-BF16, AMX or Arm BF16): the "
                 "mixed-precision stages run in fp32 (--amp-dtype bf16 to try anyway).")
    return "fp32"


def cpu_bf16_native(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 arithmetic in hardware: x86 AVX512-BF16 or AMX-BF16, Arm's
    BF16 (Linux reports them as the `avx512_bf16`, `amx_bf16` and `bf16` flags). Without a
    cpuinfo file (macOS, Windows), whether oneDNN offers bf16 kernels at all."""
    try:
        text = cpuinfo.read_text()
    except OSError:

        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def default_loader_workers() -> int:
    """Four workers, as the field case's loader stage used (docs/field-cases.md#case-1), but
    never more than the CPUs we may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))
