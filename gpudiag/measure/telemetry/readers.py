"""Open a GPU reader from a JSON-able spec, so the parent and the sampling worker open the same.

Specs: `{"kind": "nvml", "uuid": ..., "index": ...}` or a fake GPU's (`fake.fake_spec`).
"""

from __future__ import annotations

from typing import Any

from gpudiag.measure.telemetry.reader import GpuReader, TelemetryUnavailable


def nvml_spec(uuid: str | None, index: int) -> dict[str, Any]:
    return {"kind": "nvml", "uuid": uuid, "index": index}


def open_reader(spec: dict[str, Any]) -> tuple[GpuReader | None, str]:
    """The GPU's reader, or None and the reason it is unavailable. Never raises."""
    if spec.get("kind") == "fake":
        from gpudiag.measure.telemetry.fake import FakeGpu  # noqa: PLC0415 (tests only)

        if "unavailable" in spec:
            return None, str(spec["unavailable"])
        return FakeGpu(spec), ""
    try:
        from gpudiag.measure.telemetry.nvml import open_gpu  # noqa: PLC0415 (optional: pynvml)
    except ImportError as exc:  # nvidia-ml-py missing
        return None, f"nvidia-ml-py is not installed ({exc})"
    try:
        return open_gpu(spec.get("uuid"), int(spec.get("index", 0))), ""
    except TelemetryUnavailable as exc:
        return None, str(exc)
