"""The NVML reader: the only module in gpudiag that imports `pynvml` (from `nvidia-ml-py`).

Every metric is probed once when the GPU is opened; one the GPU or driver refuses is recorded as
unavailable with the reason, and never read again. Facts behind the choices (the NVML reference,
https://docs.nvidia.com/deploy/nvml-api/, and docs/performance.md for the costs measured here):
- `nvmlDeviceGetPowerUsage` is a 1-second moving average on Ampere (not GA100) and newer, so it
  is recorded as `power_avg1s_w`; the power *timeline* uses the instantaneous field.
- the total-energy counter costs milliseconds per read: read only at window edges.
- utilization.gpu is the share of time any kernel ran ("kernel-active time"), not chip load.
- GPM needs two samples more than 100 ms apart; a metrics call costs 1-4 ms.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from gpudiag.measure.telemetry.reader import TelemetryUnavailable

_MILLI = 1e-3
_MIB = 1024 * 1024

# NVML return codes that mean "this GPU/driver/container does not offer it" rather than a fault.
_REFUSALS = {
    pynvml.NVML_ERROR_NOT_SUPPORTED: "not supported on this GPU/driver",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission (a container may need extra privileges)",
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: "not in this driver's NVML",
}

_GPM_IDS = {
    "sm_active_pct": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy_pct": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_active_pct": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_bw_pct": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}

_init_lock = threading.Lock()


def nvml_error_reason(exc: Exception) -> str:
    if isinstance(exc, pynvml.NVMLError):
        known = _REFUSALS.get(exc.value)
        return known if known else f"NVML error: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _field_value(handle: Any, field_id: int) -> float:
    (value,) = pynvml.nvmlDeviceGetFieldValues(handle, [field_id])
    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        raise pynvml.NVMLError(value.nvmlReturn)
    kind = {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    }.get(value.valueType, "uiVal")
    return float(getattr(value.value, kind))


def _throttle_reasons(handle: Any) -> float:
    # Renamed "clocks event reasons" in newer drivers; the bit values are unchanged.
    getter = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if getter is None:
        getter = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return float(getter(handle))


# One reader per fast metric: cheap calls (microseconds) that can run every tick.
_FAST_READERS: dict[str, Callable[[Any], float]] = {
    "power_instant_w": lambda h: _field_value(h, pynvml.NVML_FI_DEV_POWER_INSTANT) * _MILLI,
    "power_avg1s_w": lambda h: pynvml.nvmlDeviceGetPowerUsage(h) * _MILLI,
    "kernel_active_pct": lambda h: float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu),
    "memory_busy_pct": lambda h: float(pynvml.nvmlDeviceGetUtilizationRates(h).memory),
    "sm_clock_mhz": lambda h: float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
    "temperature_c": lambda h: float(
        pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
    "memory_used_mib": lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).used / _MIB,
    "throttle_reasons": _throttle_reasons,
}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class NvmlGpu:
    """One GPU seen through NVML. Use `open_gpu`; call `close()` when done."""

    handle: Any
    name: str
    metric_status: dict[str, str]  # metric -> "ok" or why it is unavailable
    energy_ok: bool
    gpm_ok: bool

    def read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for metric, reader in _FAST_READERS.items():
            if self.metric_status.get(metric) != "ok":
                continue
            try:
                values[metric] = reader(self.handle)
            except pynvml.NVMLError:
                continue  # a transient failure loses one sample, not the metric
        return values

    def energy_mj(self) -> float | None:
        if not self.energy_ok:
            return None
        try:
            return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except pynvml.NVMLError:
            return None

    def power_limit_w(self) -> float | None:
        try:
            return pynvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) * _MILLI
        except pynvml.NVMLError:
            return None

    def gpm_snapshot(self) -> Any | None:
        if not self.gpm_ok:
            return None
        try:
            sample = pynvml.nvmlGpmSampleAlloc()
        except pynvml.NVMLError:
            return None
        try:
            pynvml.nvmlGpmSampleGet(self.handle, sample)
        except pynvml.NVMLError:
            self.gpm_release(sample)
            return None
        return sample

    def gpm_metrics(self, first: Any, second: Any) -> dict[str, float]:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(_GPM_IDS)
        request.sample1, request.sample2 = first, second
        for i, metric_id in enumerate(_GPM_IDS.values()):
            request.metrics[i].metricId = metric_id
        try:
            pynvml.nvmlGpmMetricsGet(request)
        except pynvml.NVMLError:
            return {}
        return {
            name: float(request.metrics[i].value)
            for i, name in enumerate(_GPM_IDS)
            if request.metrics[i].nvmlReturn == pynvml.NVML_SUCCESS
        }

    def gpm_release(self, snapshot: Any) -> None:
        if snapshot is not None:
            with contextlib.suppress(pynvml.NVMLError):  # the sample is lost either way
                pynvml.nvmlGpmSampleFree(snapshot)

    def describe(self) -> dict[str, Any]:
        """Static facts for the run's environment."""
        facts: dict[str, Any] = {"gpu_name": self.name, "power_limit_w": self.power_limit_w()}
        for key, call in (
            ("driver_version", lambda: _text(pynvml.nvmlSystemGetDriverVersion())),
            ("cuda_driver", lambda: _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion())),
            ("gpu_memory_mib", lambda: pynvml.nvmlDeviceGetMemoryInfo(self.handle).total / _MIB),
        ):
            try:
                facts[key] = call()
            except pynvml.NVMLError:
                facts[key] = None
        return facts

    def close(self) -> None:
        pynvml.nvmlShutdown()


def _cuda_version(encoded: int) -> str:
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _probe(call: Callable[[], object]) -> str:
    try:
        call()
    except Exception as exc:
        return nvml_error_reason(exc)
    return "ok"


def open_gpu(uuid: str | None, index: int) -> NvmlGpu:
    """Open the GPU torch calls `cuda:index` (matched by UUID, so CUDA_VISIBLE_DEVICES is
    respected) and probe what it offers. Raises TelemetryUnavailable with the reason."""
    with _init_lock:
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError) as exc:
            raise TelemetryUnavailable(f"NVML: {_init_failure(exc)}") from None
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}") if uuid
                  else pynvml.nvmlDeviceGetHandleByIndex(index))
        name = _text(pynvml.nvmlDeviceGetName(handle))
    except pynvml.NVMLError as exc:
        pynvml.nvmlShutdown()
        raise TelemetryUnavailable(f"NVML cannot open the GPU: {exc}") from None
    status = {metric: _probe(functools.partial(reader, handle))
              for metric, reader in _FAST_READERS.items()}
    energy = _probe(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    status["energy_counter"] = energy
    gpm = _probe_gpm(handle)
    for metric in _GPM_IDS:
        status[metric] = gpm
    return NvmlGpu(handle=handle, name=name, metric_status=status, energy_ok=energy == "ok",
                   gpm_ok=gpm == "ok")


def _probe_gpm(handle: Any) -> str:
    try:
        if not pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
            return "GPM not supported on this GPU (Hopper or newer needed)"
        sample = pynvml.nvmlGpmSampleAlloc()
        try:
            pynvml.nvmlGpmSampleGet(handle, sample)
        finally:
            pynvml.nvmlGpmSampleFree(sample)
    except Exception as exc:
        return f"GPM: {nvml_error_reason(exc)}"
    return "ok"


def _init_failure(exc: Exception) -> str:
    if isinstance(exc, pynvml.NVMLError):
        if exc.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            return "no NVIDIA driver library (libnvidia-ml) on this machine"
        if exc.value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
            return "the NVIDIA driver is not loaded"
    return str(exc) or type(exc).__name__
