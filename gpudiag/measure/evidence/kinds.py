"""What kind of work a kernel (or, on a CPU, an operator) is, by its name: matmul, fused
attention, softmax, normalisation, elementwise, reduction, optimizer, collective, or other.
The names are those the profiler records: cuBLAS/CUTLASS (`sm90_xmma_gemm_*`, `nvjet_*`,
`cutlass_*`), cuDNN, FlashAttention and memory-efficient attention (`flash_fwd_kernel`,
`fmha_cutlassF_*`), ATen's CUDA kernels (`vectorized_elementwise_kernel`, `reduce_kernel`,
`softmax_warp_forward`, `vectorized_layer_norm_kernel`, `multi_tensor_apply_kernel`), NCCL
(`ncclDevKernel_*`) and Inductor's Triton kernels (`triton_poi_*` pointwise, `triton_red_*` /
`triton_per_*` reductions, `triton_tem_*` templates: matmuls). Kinds are named in
gpudiag/model/results.py (DEVICE_KINDS)."""

from __future__ import annotations

import functools
import re

from gpudiag.model.results import DeviceKind

# First match wins: attention before softmax (a fused kernel's name may hold both), matmul
# before elementwise (a gemm epilogue's name may say "relu").
_KERNEL_KINDS: tuple[tuple[DeviceKind, re.Pattern[str]], ...] = (
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|efficient_attention|_attention_|sdpa|mha_", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|fused_adam|fusedadam|_foreach", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|wgmma|^triton_tem_|conv|"
                          r"implicit_|winograd|cudnn", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("norm", re.compile(r"layer_?norm|rms_?norm|batch_?norm|group_?norm|bn_fw|bn_bw|"
                        r"welford", re.I)),
    ("reduction", re.compile(r"reduce|^triton_red_|^triton_per_|argmax|argmin|cumsum|"
                             r"scan", re.I)),
    ("elementwise", re.compile(r"elementwise|^triton_poi_|vectorized|unrolled|copy|cat|"
                               r"index|scatter|gather|fill|where|dropout|gelu|relu|silu|"
                               r"tanh|sigmoid|mul|add|div|exp|pow|sqrt", re.I)),
)

# CPU operators (no kernels): by the operator's or autograd node's name, lower-cased
# ("aten::addmm", "AddmmBackward0").
_OP_KINDS: tuple[tuple[DeviceKind, re.Pattern[str]], ...] = (
    ("collective", re.compile(r"^c10d::")),
    ("attention", re.compile(r"scaled_dot_product|flash_attention|efficient_attention")),
    ("optimizer", re.compile(r"_foreach_|_fused_adam|_fused_sgd")),
    ("matmul", re.compile(r"mm|matmul|linear|conv")),
    ("softmax", re.compile(r"softmax")),
    ("norm", re.compile(r"norm")),
    ("reduction", re.compile(r"sum|mean|amax|amin|argmax|argmin|cumsum|prod|logsumexp|::var|"
                             r"::std|::max$|::min$")),
)
_BACKWARD_NODE = "autograd::engine::evaluate_function: "


# Cached: a window launches the same few hundred kernels and operators tens of thousands of
# times, and their names run to hundreds of characters of C++ templates.
@functools.lru_cache(maxsize=2**14)
def kernel_kind(name: str, *, in_optimizer: bool = False) -> DeviceKind:
    """A kernel's kind; an otherwise elementwise kernel launched by an optimizer's step is the
    optimizer's (unfused, per-parameter)."""
    for kind, pattern in _KERNEL_KINDS:
        if pattern.search(name):
            if in_optimizer and kind in ("elementwise", "reduction", "other"):
                return "optimizer"
            return kind
    return "optimizer" if in_optimizer else "other"


@functools.lru_cache(maxsize=2**14)
def op_kind(name: str, *, in_optimizer: bool = False) -> DeviceKind:
    """A CPU operator's kind (its host time is its work)."""
    if in_optimizer:
        return "optimizer"
    lowered = name.removeprefix(_BACKWARD_NODE).lower()
    for kind, pattern in _OP_KINDS:
        if pattern.search(lowered):
            return kind
    return "elementwise" if name.startswith(("aten::", _BACKWARD_NODE)) else "other"
