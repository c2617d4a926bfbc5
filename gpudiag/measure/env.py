"""What gpudiag sees on this machine: GPU, driver, CUDA, torch, power limit, telemetry, flags."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from pathlib import Path

import torch

from gpudiag.measure.telemetry import GPM_METRICS, GpuReader, nvml_spec, open_reader
from gpudiag.model.results import Env


def device_identity(device: torch.device) -> tuple[str | None, int]:
    """(UUID, index) of a CUDA device, so NVML opens the same GPU torch uses."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return (str(uuid) if uuid else None), index


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect_env(device: torch.device, reader: GpuReader | None, telemetry_reason: str) -> Env:
    env = Env(
        device=str(device),
        torch_version=torch.__version__,
        transformers_version=_version("transformers"),
        python_version=platform.python_version(),
        platform=platform.platform(),
        hostname=socket.gethostname(),
        cpu_model=_cpu_model(),
        cpu_count=_usable_cpus(),
        cuda_runtime=torch.version.cuda,
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        tf32_cudnn=torch.backends.cudnn.allow_tf32,
        cudnn_benchmark=torch.backends.cudnn.benchmark,
        cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
        else None,
    )
    if torch.cuda.is_available():
        env.gpu_count = torch.cuda.device_count()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.gpu_name = props.name
        env.compute_capability = f"{props.major}.{props.minor}"
        env.gpu_memory_mib = props.total_memory / 2**20
    if reader is None:
        env.nvml = f"unavailable: {telemetry_reason}"
        return env
    facts = reader.describe()
    env.gpu_name = facts.get("gpu_name") or env.gpu_name
    env.driver_version = facts.get("driver_version")
    env.cuda_driver = facts.get("cuda_driver")
    env.power_limit_w = facts.get("power_limit_w")
    env.gpu_memory_mib = facts.get("gpu_memory_mib") or env.gpu_memory_mib
    env.nvml = "available"
    gpm = reader.metric_status.get(GPM_METRICS[0], "unknown")
    env.gpm = "available" if gpm == "ok" else f"unavailable: {gpm}"
    env.telemetry_metrics = dict(reader.metric_status)
    return env


def describe_environment(device: str) -> Env:
    """The environment a run on `device` (already resolved: see plan.resolve_device) would
    record, for `gpudiag env`."""
    resolved = torch.device(device)
    reader, reason = None, f"device is {resolved.type}: no GPU telemetry"
    if resolved.type == "cuda":
        reader, reason = open_reader(nvml_spec(*device_identity(resolved)))
    try:
        return collect_env(resolved, reader, reason)
    finally:
        if reader is not None:
            reader.close()
