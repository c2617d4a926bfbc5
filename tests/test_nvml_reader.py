"""The NVML reader without a GPU: pynvml's functions are replaced by autospec'd mocks of a
healthy H100 (real constants, structs and NVMLError classes stay); each test changes one."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from typing import Any
from unittest.mock import MagicMock, create_autospec

import pynvml
import pytest

from gpudiag.measure.telemetry import nvml, reader
from gpudiag.measure.telemetry.nvml import open_gpu
from gpudiag.measure.telemetry.reader import TelemetryUnavailable
from gpudiag.measure.telemetry.readers import open_reader

HANDLE = object()  # an opaque device handle, as NVML gives
MIB = 1024 * 1024
NOT_SUPPORTED = "not supported on this GPU/driver"
GPM_UNSUPPORTED = "GPM not supported on this GPU (Hopper or newer needed)"
# A GPM value per metric id, so a result can be traced to the id it was read under.
GPM_VALUES = {
    pynvml.NVML_GPM_METRIC_SM_UTIL: 65.0,
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: 35.0,
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 17.5,
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 44.0,
}
# What a healthy H100 reports through read(), in gpudiag's units.
H100_READ = {
    "power_instant_w": 312.5,
    "power_avg1s_w": 298.0,
    "kernel_active_pct": 97.0,
    "memory_busy_pct": 41.0,
    "sm_clock_mhz": 1980.0,
    "temperature_c": 61.0,
    "memory_used_mib": 20_480.0,
    "throttle_reasons": 4.0,
}


def _field(value: float, *, ret: int = pynvml.NVML_SUCCESS,
           value_type: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
           member: str = "uiVal") -> ctypes.Array[Any]:
    """What nvmlDeviceGetFieldValues returns for one field id."""
    values = (pynvml.c_nvmlFieldValue_t * 1)()
    values[0].fieldId = pynvml.NVML_FI_DEV_POWER_INSTANT
    values[0].nvmlReturn = ret
    values[0].valueType = value_type
    setattr(values[0].value, member, value)
    return values


def _field_values(_handle: Any, field_ids: list[int]) -> ctypes.Array[Any]:
    if field_ids == [pynvml.NVML_FI_DEV_POWER_INSTANT]:
        return _field(312_500)  # mW
    return _field(0, ret=pynvml.NVML_ERROR_NOT_SUPPORTED)


def _gpm_sample(address: int) -> Any:
    """A GPM sample handle; gpudiag passes these around and never dereferences them."""
    return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)


def _address(sample: Any) -> int | None:
    return ctypes.cast(sample, ctypes.c_void_p).value


def _gpm_metrics_get(request: Any) -> Any:
    for i in range(request.numMetrics):
        metric = request.metrics[i]
        metric.value = GPM_VALUES[metric.metricId]
        metric.nvmlReturn = pynvml.NVML_SUCCESS
    return request


def _nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class FakeNvml:
    """Installs and holds the mocks; `patch` replaces one pynvml function for a test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.mocks: dict[str, MagicMock] = {}
        self._addresses = iter(range(0x1000, 0x100000, 0x10))

    def patch(self, name: str, **behaviour: Any) -> MagicMock:
        mock = create_autospec(_REAL[name], **behaviour)
        self._monkeypatch.setattr(pynvml, name, mock)
        self.mocks[name] = mock
        return mock

    def __getitem__(self, name: str) -> MagicMock:
        return self.mocks[name]

    def new_sample(self) -> Any:
        return _gpm_sample(next(self._addresses))


_PATCHED = [
    "nvmlInit", "nvmlShutdown", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetName", "nvmlDeviceGetFieldValues", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc",
    "nvmlGpmSampleGet", "nvmlGpmSampleFree", "nvmlGpmMetricsGet", "nvmlSystemGetDriverVersion",
    "nvmlSystemGetCudaDriverVersion",
]
_REAL: dict[str, Callable[..., Any]] = {
    name: getattr(pynvml, name) for name in _PATCHED if hasattr(pynvml, name)
}


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """A healthy H100 behind NVML; no call reaches a real driver."""

    def no_driver(name: str) -> None:
        raise AssertionError(f"unmocked NVML call: {name}")

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", no_driver, raising=False)
    f = FakeNvml(monkeypatch)
    f.patch("nvmlInit", return_value=None)
    f.patch("nvmlShutdown", return_value=None)
    f.patch("nvmlDeviceGetHandleByIndex", return_value=HANDLE)
    f.patch("nvmlDeviceGetHandleByUUID", return_value=HANDLE)
    f.patch("nvmlDeviceGetName", return_value="NVIDIA H100 80GB HBM3")
    f.patch("nvmlDeviceGetFieldValues", side_effect=_field_values)
    f.patch("nvmlDeviceGetPowerUsage", return_value=298_000)  # mW
    f.patch("nvmlDeviceGetUtilizationRates",
            return_value=pynvml.c_nvmlUtilization_t(gpu=97, memory=41))
    clocks = {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_GRAPHICS: 1755,
              pynvml.NVML_CLOCK_MEM: 2619}
    f.patch("nvmlDeviceGetClockInfo", side_effect=lambda _h, clock: clocks[clock])
    f.patch("nvmlDeviceGetTemperature",
            side_effect=lambda _h, sensor: {pynvml.NVML_TEMPERATURE_GPU: 61}[sensor])
    f.patch("nvmlDeviceGetMemoryInfo", return_value=pynvml.c_nvmlMemory_t(
        total=81_559 * MIB, free=61_079 * MIB, used=20_480 * MIB))
    for name in ("nvmlDeviceGetCurrentClocksEventReasons",
                 "nvmlDeviceGetCurrentClocksThrottleReasons"):
        if name in _REAL:
            f.patch(name, return_value=0x4)  # power cap
    f.patch("nvmlDeviceGetTotalEnergyConsumption", return_value=123_456_789)  # mJ
    f.patch("nvmlDeviceGetEnforcedPowerLimit", return_value=700_000)  # mW
    f.patch("nvmlGpmQueryDeviceSupport",
            return_value=pynvml.c_nvmlGpmSupport_t(version=1, isSupportedDevice=1))
    f.patch("nvmlGpmSampleAlloc", side_effect=f.new_sample)
    f.patch("nvmlGpmSampleGet", side_effect=lambda _device, sample: sample)
    f.patch("nvmlGpmSampleFree", return_value=None)
    f.patch("nvmlGpmMetricsGet", side_effect=_gpm_metrics_get)
    f.patch("nvmlSystemGetDriverVersion", return_value="570.86.15")
    f.patch("nvmlSystemGetCudaDriverVersion", return_value=12_080)
    return f


# --- opening --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver library (libnvidia-ml)"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "the NVIDIA driver is not loaded"),
    ],
    ids=["no-library", "driver-not-loaded"],
)
def test_open_gpu_without_a_driver_is_unavailable(fake_nvml: FakeNvml, code: int,
                                                  message: str) -> None:
    fake_nvml.patch("nvmlInit", side_effect=_nvml_error(code))
    with pytest.raises(TelemetryUnavailable, match=re.escape(message)):
        open_gpu(None, 0)
    fake_nvml["nvmlDeviceGetHandleByIndex"].assert_not_called()
    fake_nvml["nvmlShutdown"].assert_not_called()  # nothing was initialised


def test_open_reader_turns_a_missing_driver_into_a_reason(fake_nvml: FakeNvml) -> None:
    fake_nvml.patch("nvmlInit", side_effect=_nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    gpu, reason = open_reader({"kind": "nvml", "uuid": None, "index": 0})
    assert gpu is None
    assert "driver library" in reason


def test_open_gpu_finds_the_device_by_uuid_or_index(fake_nvml: FakeNvml) -> None:
    gpu = open_gpu("8d1b7c2e-0000-1111-2222-333344445555", 3)
    fake_nvml["nvmlDeviceGetHandleByUUID"].assert_called_once_with(
        "GPU-8d1b7c2e-0000-1111-2222-333344445555")
    fake_nvml["nvmlDeviceGetHandleByIndex"].assert_not_called()
    assert gpu.handle is HANDLE
    assert gpu.name == "NVIDIA H100 80GB HBM3"

    open_gpu(None, 2)
    fake_nvml["nvmlDeviceGetHandleByIndex"].assert_called_once_with(2)


def test_open_gpu_shuts_nvml_down_when_the_device_cannot_be_opened(
    fake_nvml: FakeNvml,
) -> None:
    fake_nvml.patch("nvmlDeviceGetHandleByIndex",
                    side_effect=_nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT))
    with pytest.raises(TelemetryUnavailable, match="NVML cannot open the GPU"):
        open_gpu(None, 7)
    fake_nvml["nvmlShutdown"].assert_called_once_with()
    gpu, reason = open_reader({"kind": "nvml", "uuid": None, "index": 7})
    assert gpu is None and "cannot open the GPU" in reason


# --- a healthy GPU --------------------------------------------------------------------------


def test_a_healthy_h100_offers_every_metric_in_gpudiag_units(fake_nvml: FakeNvml) -> None:
    gpu = open_gpu(None, 0)
    assert set(gpu.metric_status) == {*reader.FAST_METRICS, "energy_counter",
                                      *reader.GPM_METRICS}
    assert set(gpu.metric_status.values()) == {"ok"}
    assert gpu.energy_ok and gpu.gpm_ok
    assert gpu.read() == H100_READ
    assert gpu.energy_mj() == 123_456_789.0
    assert gpu.power_limit_w() == 700.0
    fake_nvml["nvmlDeviceGetClockInfo"].assert_called_with(HANDLE, pynvml.NVML_CLOCK_SM)
    # The probe's GPM sample was freed.
    assert (fake_nvml["nvmlGpmSampleAlloc"].call_count
            == fake_nvml["nvmlGpmSampleFree"].call_count == 1)
    gpu.close()
    fake_nvml["nvmlShutdown"].assert_called_once_with()


@pytest.mark.parametrize(
    ("value_type", "member", "raw"),
    [
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 312_500),
        (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", 312_500),
        (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", 312_500.0),
    ],
    ids=["uint", "ulonglong", "double"],
)
def test_instantaneous_power_field_in_milliwatts(fake_nvml: FakeNvml, value_type: int,
                                                 member: str, raw: float) -> None:
    fake_nvml.patch("nvmlDeviceGetFieldValues",
                    return_value=_field(raw, value_type=value_type, member=member))
    assert open_gpu(None, 0).read()["power_instant_w"] == 312.5


def test_describe_reports_static_facts(fake_nvml: FakeNvml) -> None:
    facts = open_gpu(None, 0).describe()
    assert facts == {"gpu_name": "NVIDIA H100 80GB HBM3", "power_limit_w": 700.0,
                     "driver_version": "570.86.15", "cuda_driver": "12.8",
                     "gpu_memory_mib": 81_559.0}


# --- refusals -------------------------------------------------------------------------------


def test_refused_metrics_are_recorded_and_never_read(fake_nvml: FakeNvml) -> None:
    fake_nvml.patch("nvmlDeviceGetFieldValues",
                    return_value=_field(0, ret=pynvml.NVML_ERROR_NOT_SUPPORTED))
    clock = fake_nvml.patch("nvmlDeviceGetClockInfo",
                            side_effect=_nvml_error(pynvml.NVML_ERROR_NO_PERMISSION))
    gpu = open_gpu(None, 0)

    assert gpu.metric_status["power_instant_w"] == NOT_SUPPORTED
    assert gpu.metric_status["sm_clock_mhz"].startswith("no permission")
    assert all(gpu.metric_status[m] == "ok" for m in H100_READ
               if m not in ("power_instant_w", "sm_clock_mhz"))

    probes = fake_nvml["nvmlDeviceGetFieldValues"].call_count, clock.call_count
    values = gpu.read()
    assert values == {k: v for k, v in H100_READ.items()
                      if k not in ("power_instant_w", "sm_clock_mhz")}
    assert (fake_nvml["nvmlDeviceGetFieldValues"].call_count, clock.call_count) == probes


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, NOT_SUPPORTED),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "not in this driver's NVML"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML error: Unknown Error"),
    ],
    ids=["not-supported", "function-not-found", "unknown"],
)
def test_refused_energy_counter(fake_nvml: FakeNvml, code: int, reason: str) -> None:
    fake_nvml.patch("nvmlDeviceGetTotalEnergyConsumption", side_effect=_nvml_error(code))
    gpu = open_gpu(None, 0)
    assert gpu.metric_status["energy_counter"] == reason
    assert not gpu.energy_ok
    assert gpu.energy_mj() is None


def test_a_transient_failure_loses_one_sample_not_the_metric(fake_nvml: FakeNvml) -> None:
    fake_nvml.patch("nvmlDeviceGetTemperature",
                    side_effect=[61, _nvml_error(pynvml.NVML_ERROR_TIMEOUT), 62])
    gpu = open_gpu(None, 0)  # the probe reads 61
    assert gpu.read() == {k: v for k, v in H100_READ.items() if k != "temperature_c"}
    assert gpu.metric_status["temperature_c"] == "ok"
    assert gpu.read()["temperature_c"] == 62.0


# --- GPM ------------------------------------------------------------------------------------


def test_gpm_on_a_gpu_without_it(fake_nvml: FakeNvml) -> None:
    fake_nvml.patch("nvmlGpmQueryDeviceSupport",
                    return_value=pynvml.c_nvmlGpmSupport_t(version=1, isSupportedDevice=0))
    gpu = open_gpu(None, 0)
    assert not gpu.gpm_ok
    assert {gpu.metric_status[m] for m in reader.GPM_METRICS} == {GPM_UNSUPPORTED}
    assert gpu.gpm_snapshot() is None
    fake_nvml["nvmlGpmSampleAlloc"].assert_not_called()
    assert gpu.metric_status["kernel_active_pct"] == "ok"  # the rest is unaffected


def test_gpm_probe_failure_frees_its_sample(fake_nvml: FakeNvml) -> None:
    fake_nvml.patch("nvmlGpmSampleGet",
                    side_effect=_nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED))
    gpu = open_gpu(None, 0)
    assert not gpu.gpm_ok
    assert gpu.metric_status["sm_active_pct"] == f"GPM: {NOT_SUPPORTED}"
    assert (fake_nvml["nvmlGpmSampleAlloc"].call_count
            == fake_nvml["nvmlGpmSampleFree"].call_count == 1)


def test_gpm_metrics_request_every_id_and_keep_only_successes(fake_nvml: FakeNvml) -> None:
    requests: list[dict[str, Any]] = []

    def metrics_get(request: Any) -> Any:
        requests.append({
            "version": request.version, "count": request.numMetrics,
            "ids": [request.metrics[i].metricId for i in range(request.numMetrics)],
            "samples": (_address(request.sample1), _address(request.sample2)),
        })
        _gpm_metrics_get(request)
        for i in range(request.numMetrics):  # this GPU cannot count tensor activity
            if request.metrics[i].metricId == pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL:
                request.metrics[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request

    gpu = open_gpu(None, 0)
    fake_nvml.patch("nvmlGpmMetricsGet", side_effect=metrics_get)
    first, second = gpu.gpm_snapshot(), gpu.gpm_snapshot()
    assert first is not None and second is not None

    assert gpu.gpm_metrics(first, second) == {
        "sm_active_pct": 65.0, "sm_occupancy_pct": 35.0, "dram_bw_pct": 44.0}
    (request,) = requests
    assert request["version"] == pynvml.NVML_GPM_METRICS_GET_VERSION
    assert request["count"] == len(reader.GPM_METRICS)
    assert sorted(request["ids"]) == sorted(GPM_VALUES)
    assert request["samples"] == (_address(first), _address(second))

    gpu.gpm_release(first)
    gpu.gpm_release(second)
    gpu.gpm_release(None)
    freed = [_address(c.args[0]) for c in fake_nvml["nvmlGpmSampleFree"].call_args_list]
    assert freed[-2:] == [_address(first), _address(second)]
    assert len(freed) == fake_nvml["nvmlGpmSampleAlloc"].call_count == 3  # probe + two


def test_gpm_metrics_call_failure_gives_no_metrics(fake_nvml: FakeNvml) -> None:
    gpu = open_gpu(None, 0)
    fake_nvml.patch("nvmlGpmMetricsGet", side_effect=_nvml_error(pynvml.NVML_ERROR_UNKNOWN))
    assert gpu.gpm_metrics(gpu.gpm_snapshot(), gpu.gpm_snapshot()) == {}


def test_gpm_snapshot_that_fails_is_freed(fake_nvml: FakeNvml) -> None:
    gpu = open_gpu(None, 0)
    fake_nvml.patch("nvmlGpmSampleGet", side_effect=_nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST))
    assert gpu.gpm_snapshot() is None
    assert (fake_nvml["nvmlGpmSampleAlloc"].call_count
            == fake_nvml["nvmlGpmSampleFree"].call_count == 2)


# --- the NVML reader and the reader contract agree ------------------------------------------


def test_nvml_reads_exactly_the_metrics_the_sampler_knows() -> None:
    assert set(nvml._GPM_IDS) == set(reader.GPM_METRICS)
    assert set(nvml._FAST_READERS) == set(reader.FAST_METRICS)
    assert len(set(nvml._GPM_IDS.values())) == len(nvml._GPM_IDS)


def test_gpm_allocation_failure_is_not_an_exception(fake_nvml: FakeNvml) -> None:
    gpu = open_gpu(None, 0)
    fake_nvml.patch("nvmlGpmSampleAlloc",
                    side_effect=pynvml.NVMLError(pynvml.NVML_ERROR_MEMORY))
    assert gpu.gpm_snapshot() is None
