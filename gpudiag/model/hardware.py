"""What GPUs can do on paper: the ceilings MFU is held against when a run measured none."""

from __future__ import annotations

# Dense datasheet peaks (TFLOP/s, FP32 accumulate) by GPU name fragment, from NVIDIA's H100/H200,
# A100 and Ada (RTX 4090) datasheets and architecture whitepapers (https://www.nvidia.com/en-us/
# data-center/h100/, /h200/, /a100/; https://images.nvidia.com/aem-dam/Solutions/geforce/ada/
# nvidia-ada-gpu-architecture.pdf), without sparsity.
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 495.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.6, "fp32": 82.6},
}


def datasheet_tflops(gpu_name: str | None, dtype: str) -> float | None:
    if not gpu_name:
        return None
    for fragment, peaks in DATASHEET_TFLOPS.items():
        if fragment in gpu_name:
            return peaks.get(dtype)
    return None


# Memory bandwidth on paper (GB/s), by GPU name fragment, most specific first (the same
# datasheets: H100 SXM5 80GB HBM3 3.35 TB/s, H100 PCIe 2.0, H100 NVL 3.9, H200 4.8, A100 80GB
# SXM 2.04, A100 40GB 1.56, RTX 4090 1.01).
DATASHEET_GBPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0), ("H200", 4800.0),
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB", 2039.0), ("A100", 1555.0),
    ("RTX 4090", 1008.0))


def datasheet_gbps(gpu_name: str | None) -> float | None:
    if not gpu_name:
        return None
    return next((gbps for fragment, gbps in DATASHEET_GBPS if fragment in gpu_name), None)
