"""The plan: the user's choices validated into a RunConfig, and device and precision selection:
everything a run needs decided before it starts."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from gpudiag.measure.models import resolve_model
from gpudiag.measure.stages import DEFAULT_LADDER, stage_names
from gpudiag.model.config import AMP_DTYPES, PRESETS, RunConfig
from gpudiag.model.errors import BadInput


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


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise BadInput(f"{name} must be positive (got {value})")


def build_config(
    *,
    model: str,
    preset: str | None = None,
    device: str | None = None,
    stages: Sequence[str] | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    iters: int | None = None,
    warmup: int | None = None,
    min_seconds: float | None = None,
    amp_dtype: str | None = None,
    loader_workers: int | None = None,
    prompt_length: int = 3,
    evidence_steps: int | None = None,
    checkpoint_every: int = 10,
    checkpoint_dir: str | None = None,
    keep_checkpoints: bool = False,
    nproc: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    ddp_sweep: bool = False,
    ddp_accum: int = 1,
    ddp_no_sync: str = "correct",
) -> tuple[RunConfig, list[str]]:
    """Validate the user's choices into a RunConfig; return it with notes worth showing."""

    notes: list[str] = []
    resolve_model(model)  # fail early on an unknown model, before any device work
    resolved_device = resolve_device(device)
    if preset is None:
        preset = "full" if resolved_device.startswith("cuda") else "tiny"
        if preset == "tiny":
            notes.append("No CUDA device: running the small 'tiny' preset on the CPU "
                         "(--preset full to override).")
    if preset not in PRESETS:
        raise BadInput(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    chosen = PRESETS[preset]
    for name, value in (("--batch-size", batch_size), ("--seq-len", seq_len),
                        ("--iters", iters), ("--prompt-length", prompt_length),
                        ("--checkpoint-every", checkpoint_every), ("--nproc", nproc),
                        ("--nnodes", nnodes), ("--ddp-accum", ddp_accum)):
        _positive(name, value)
    if warmup is not None and warmup < 0:
        raise BadInput(f"--warmup must be zero or more (got {warmup})")
    if min_seconds is not None and min_seconds < 0:
        raise BadInput(f"--min-seconds must be zero or more (got {min_seconds})")
    if evidence_steps is not None and evidence_steps < 0:
        raise BadInput(f"--evidence-steps must be zero or more (got {evidence_steps})")
    if loader_workers is not None and loader_workers < 0:
        raise BadInput(f"--workers must be zero or more (got {loader_workers})")
    if amp_dtype is None:
        amp_dtype = default_amp_dtype(resolved_device, notes)
    if amp_dtype not in AMP_DTYPES:
        raise BadInput(f"--amp-dtype must be fp16, bf16 or fp32 (got {amp_dtype!r})")
    seq = seq_len or chosen.seq_len
    if seq > chosen.shape.max_positions:
        raise BadInput(f"--seq-len {seq} exceeds the model's {chosen.shape.max_positions} "
                       "positions")
    if seq < 2 * prompt_length + 2:
        raise BadInput(f"--seq-len {seq} leaves no room for 2x{prompt_length} prompt slots and "
                       "a source sentence")

    if not 0 <= node_rank < nnodes:
        raise BadInput(f"--node-rank {node_rank} must be in 0..{nnodes - 1} for --nnodes "
                       f"{nnodes}")
    if nnodes > 1 and not rdzv_endpoint:
        raise BadInput("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if ddp_no_sync not in ("correct", "backward-only"):
        raise BadInput(f"--ddp-no-sync must be correct or backward-only (got {ddp_no_sync!r})")
    if (resolved_device.startswith("cuda") and nproc is not None
            and nproc > torch.cuda.device_count()):
        raise BadInput(f"--nproc {nproc}: only {torch.cuda.device_count()} CUDA device(s) "
                       "visible")

    selected = tuple(stages) if stages else DEFAULT_LADDER
    unknown = [s for s in selected if s not in stage_names()]
    if unknown:
        raise BadInput(f"unknown stage {unknown[0]!r} (known: {', '.join(stage_names())})")

    config = RunConfig(
        model=model,
        preset=preset,
        device=resolved_device,
        stages=tuple(dict.fromkeys(selected)),
        shape=chosen.shape,
        batch_size=batch_size or chosen.batch_size,
        seq_len=seq,
        iters=iters or chosen.iters,
        warmup=chosen.warmup if warmup is None else warmup,
        min_seconds=chosen.min_seconds if min_seconds is None else min_seconds,
        amp_dtype=amp_dtype,  # type: ignore[arg-type]
        loader_workers=default_loader_workers() if loader_workers is None else loader_workers,
        prompt_length=prompt_length,
        evidence_steps=2 if evidence_steps is None else evidence_steps,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=checkpoint_dir,
        keep_checkpoints=keep_checkpoints,
        nproc=nproc, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
        ddp_sweep=ddp_sweep, ddp_accum=ddp_accum, ddp_no_sync=ddp_no_sync,
    )
    return config, notes


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
    """Four workers, as in REFERENCE.md's stage 4, but never more than the CPUs we may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))
