"""What kind of work a kernel (or, on a CPU, an operator) is, by its name: matmul,
convolution, fused attention, softmax, normalisation, elementwise, reduction, layout transpose,
optimizer, collective, or other.
The names are those the profiler records: cuBLAS/CUTLASS (`sm90_xmma_gemm_*`, `nvjet_*`,
`cutlass_*`), cuDNN's convolutions (`sm80_xmma_fprop_implicit_gemm_*`, `*_dgrad_*`,
`*_wgrad_*`, `implicit_convolve_sgemm`, `*_scudnn_winograd_*`, `volta_s884cudnn_*`) and the
layout transposes it runs around them on NCHW tensors (`nchwToNhwcKernel`,
`nhwcToNchwKernel`, `cubeTransposeDeviceGeneric_kernel`), FlashAttention and
memory-efficient attention (`flash_fwd_kernel`, `fmha_cutlassF_*`), ATen's CUDA kernels
(`vectorized_elementwise_kernel`, `reduce_kernel`, `softmax_warp_forward`,
`vectorized_layer_norm_kernel`, `multi_tensor_apply_kernel`), NCCL (`ncclDevKernel_*`)
and Inductor's Triton kernels (`triton_poi_*` pointwise, `triton_red_*` / `triton_per_*`
reductions, `triton_tem_*` templates: matmuls). Kinds are named in gpudiag/model/results.py
(DeviceKind).

cuDNN's names as profilers print them: apache/mxnet#14684 (`nhwcToNchwKernel`,
`volta_s884cudnn_fp16_*_nhwc_tn_v1`, `cudnn::detail::bn_fw_inf_1C11_kernel_new`),
kblomdahl/dream-go#25 (`maxwell_scudnn_winograd_*`, `cudnn::detail::implicit_convolve_sgemm`,
`cudnn::detail::cubeTransposeDeviceGeneric_kernel`), NVIDIA/cutlass#231 (`winograd_nonfused`);
cuDNN 8/9 on Ampere and Hopper name its implicit-GEMM engines `sm80_xmma_fprop_implicit_gemm_*`,
`sm90_xmma_dgrad_implicit_gemm_*`, `sm80_xmma_wgrad_implicit_gemm_*`, and CUTLASS its own
`cutlass_80_tensorop_*fprop_*`."""

from __future__ import annotations

import functools
import re

from gpudiag.model.results import DeviceKind

# First match wins: attention before softmax (a fused kernel's name may hold both), layout
# before convolution (`nchwToNhwcKernel` is cuDNN's, beside its convolutions), convolution
# before matmul (an implicit-GEMM convolution says "gemm"), norm before matmul (cuDNN's
# batch norms say "cudnn"), matmul before elementwise (a gemm epilogue's name may say "relu").
# Inductor's pointwise and reduction kernels are named after the ops they fuse
# (`triton_poi_fused_convolution_relu_0`): their prefix decides, not "convolution".
_KERNEL_KINDS: tuple[tuple[DeviceKind, re.Pattern[str]], ...] = (
    ("collective", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|efficient_attention|_attention_|sdpa|mha_", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|fused_adam|fusedadam|_foreach", re.I)),
    ("layout", re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|cubeTranspose", re.I)),
    ("convolution", re.compile(r"^(?!triton_(poi|red|per)_).*(conv(?!ert)|fprop|dgrad|wgrad|"
                               r"implicit_|winograd|im2col|col2im|s\d+cudnn|scudnn)", re.I)),
    ("norm", re.compile(r"layer_?norm|rms_?norm|batch_?norm|group_?norm|bn_fw|bn_bw|"
                        r"welford", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|wgmma|^triton_tem_|cudnn", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
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
    ("convolution", re.compile(r"conv(?!ert)")),
    ("matmul", re.compile(r"mm|matmul|linear")),
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
