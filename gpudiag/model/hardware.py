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
