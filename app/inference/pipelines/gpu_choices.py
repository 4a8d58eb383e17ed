"""Which kernels a GPU target gets, llmchat's or TVM's: by backend, CUDA architecture and the
``LLMCHAT_*`` environment switches."""

from __future__ import annotations

import os
import re
from typing import Any

#: let dlight's Matmul rule use tensor cores (TVM 0.27 can segfault on some fp16 matmuls)
TENSOR_CORE_MATMUL = os.environ.get("LLMCHAT_TENSOR_CORE_MATMUL", "") == "1"


def use_llmchat_gemv(target: Any) -> bool:
    """Whether :class:`.gpu_gemv.DecodeGEMV` goes before dlight's GEMV rule.

    Default: on CUDA, where it was measured (H200, Llama-2-7B shapes, engine end to end: 317.7
    tok/s against 307.8 with dlight's GEMV and 272.5 with TVM's plain pipeline). Elsewhere
    dlight's GEMV keeps MLC's per-vendor configurations until the rule is measured there.
    ``LLMCHAT_GPU_GEMV=llmchat`` or ``=tvm`` overrides.
    """
    choice = os.environ.get("LLMCHAT_GPU_GEMV", "").strip().lower()
    if choice in ("llmchat", "tvm"):
        return choice == "llmchat"
    # also behind the CUDA kernel, for the shapes it declines; WGSL (H200, NVIDIA's Vulkan driver,
    # 7B shape: 6.1 -> 5.3 ms of GPU time per decode step against dlight's GEMV; BENCHMARKS.md)
    return target.kind.name in ("cuda", "webgpu")


#: the GEMV's ``ld.global.nc.L1::no_allocate`` loads and the prompt GEMM's WMMA need Volta (sm_70)
MIN_ARCH_GEMV_GEMM = 70
#: the prompt attention's ``mma.sync.m16n8k16`` with fp16 inputs needs Ampere (sm_80)
MIN_ARCH_PROMPT_ATTENTION = 80
#: the prompt GEMM's second kernel (``cp.async``, ``mma.sync.m16n8k16``) needs Ampere (sm_80)
MIN_ARCH_GEMM_MMA = 80
#: thread-block clusters (the decode attention's merge) need Hopper (sm_90)
MIN_ARCH_CLUSTERS = 90
#: GPUs where 16-block (non-portable) clusters were run: the H200 (sm_90); others get 8
WIDE_CLUSTER_ARCHS = (90,)


def cuda_arch(target: Any) -> int | None:
    """The compute capability a CUDA ``target`` is built for (``sm_90`` / ``sm_90a`` -> 90), None
    for other targets or when the target names none."""
    if target.kind.name != "cuda":
        return None
    match = re.fullmatch(r"sm_(\d+)[a-z]?", str(target.attrs.get("arch", "")))
    return int(match.group(1)) if match else None


def _arch_at_least(target: Any, arch: int) -> bool:
    got = cuda_arch(target)
    return got is not None and got >= arch


def use_cuda_kernel_gemv(target: Any) -> bool:
    """Whether q4f16_1 decode GEMVs use llmchat's CUDA kernel (:mod:`.cuda_gemv`): on CUDA from
    sm_70 on, unless ``LLMCHAT_GPU_GEMV`` names another rule (``llmchat`` for
    :class:`.gpu_gemv.DecodeGEMV`, ``tvm``)."""
    choice = os.environ.get("LLMCHAT_GPU_GEMV", "").strip().lower()
    return _arch_at_least(target, MIN_ARCH_GEMV_GEMM) and choice in ("", "cuda-kernel")


def use_cuda_gemm(target: Any) -> bool:
    """Whether prompt-sized q4f16_1 matmuls use llmchat's tensor-core kernel (:mod:`.cuda_gemm`):
    on CUDA from sm_70 on, unless ``LLMCHAT_CUDA_GEMM=tvm``."""
    choice = os.environ.get("LLMCHAT_CUDA_GEMM", "").strip().lower()
    return _arch_at_least(target, MIN_ARCH_GEMV_GEMM) and choice != "tvm"


def use_cuda_gemm_mma(target: Any) -> bool:
    """Whether the prompt GEMM's wide layers may take the ``mma.sync`` kernel (``cuda_gemm``'s
    :func:`~.cuda_gemm.takes_mma`): its ``cp.async`` and ``mma.sync.m16n8k16`` need Ampere (sm_80);
    ``LLMCHAT_CUDA_GEMM=wmma`` keeps the WMMA kernel for every layer."""
    choice = os.environ.get("LLMCHAT_CUDA_GEMM", "").strip().lower()
    return use_cuda_gemm(target) and _arch_at_least(target, MIN_ARCH_GEMM_MMA) and choice != "wmma"


def use_cuda_attention(target: Any) -> bool:
    """Whether decode and prompt attention use llmchat's CUDA kernels (:mod:`.cuda_attention`):
    on CUDA unless ``LLMCHAT_CUDA_ATTENTION=tvm``; the prompt kernel from sm_80 on."""
    choice = os.environ.get("LLMCHAT_CUDA_ATTENTION", "").strip().lower()
    return target.kind.name == "cuda" and choice != "tvm"


def use_cuda_prompt_attention(target: Any) -> bool:
    """Whether prompt attention also uses llmchat's tensor-core kernels (:mod:`.cuda_attention`):
    where the decode attention does (:func:`use_cuda_attention`), from sm_80 on."""
    return use_cuda_attention(target) and _arch_at_least(target, MIN_ARCH_PROMPT_ATTENTION)


def max_cluster_size(target: Any) -> int:
    """The largest thread-block cluster llmchat's kernels may launch on ``target``: 0 (none)
    before sm_90, 16 where that was run, else 8 (the portable size)."""
    if not _arch_at_least(target, MIN_ARCH_CLUSTERS):
        return 0
    return 16 if cuda_arch(target) in WIDE_CLUSTER_ARCHS else 8


def use_wgsl_attention(target: Any) -> bool:
    """Whether decode attention splits the keys over workgroups on WebGPU/Vulkan
    (:mod:`.wgsl_attention`): unless ``LLMCHAT_WGSL_ATTENTION=tvm``."""
    choice = os.environ.get("LLMCHAT_WGSL_ATTENTION", "").strip().lower()
    return target.kind.name == "webgpu" and choice != "tvm"


def use_wgsl_prefill_attention(target: Any) -> bool:
    """Whether a prompt's attention (to its own keys and to the cache's pages) on WebGPU/Vulkan is
    llmchat's kernel (:mod:`.wgsl_prefill_attention`): unless ``LLMCHAT_WGSL_PREFILL_ATTENTION=tvm``."""
    choice = os.environ.get("LLMCHAT_WGSL_PREFILL_ATTENTION", "").strip().lower()
    return target.kind.name == "webgpu" and choice != "tvm"


def wgsl_attention_variant() -> str:
    """Which of llmchat's WGSL decode attention kernels :func:`use_wgsl_attention` puts in:
    ``split-v2`` (default; one workgroup per KV head and chunk, no merge launch on short contexts;
    keys in parallel where a KV head has one query head)
    or ``split-v1`` (``LLMCHAT_WGSL_ATTENTION=split-v1``: the earlier per-query-head-group split,
    kept for A/B comparisons); ``split-v2-singleN`` and ``-all`` are v2 with options for A/B runs
    (:func:`.wgsl_attention.v2_options`)."""
    choice = os.environ.get("LLMCHAT_WGSL_ATTENTION", "").strip().lower()
    if choice == "split-v1" or choice.startswith("split-v2-"):
        return choice
    return "split-v2"


def cuda_paged_prefill() -> str:
    """How a prompt chunk's attention to the cached keys runs where llmchat's prompt attention
    does (``LLMCHAT_CUDA_PAGED_PREFILL``): ``async`` (default), llmchat's tensor-core kernel
    (:func:`.cuda_attention.prefill_paged_attention`) with its key tiles copied by cp.async behind
    the work on the previous tile; ``sync``, the same kernel with plain loads; ``tvm``, TVM's
    ``batch_prefill_paged_kv`` (for comparisons). H200, Llama-2-7B shape, pp4096 / pp8192 tok/s:
    13,952 / 12,627 (async), 13,640 / 11,925 (sync), 5,866 / 2,665 (tvm)."""
    choice = os.environ.get("LLMCHAT_CUDA_PAGED_PREFILL", "").strip().lower()
    return choice if choice in ("sync", "tvm") else "async"


def cuda_gqa_decode() -> tuple[str, int]:
    """Which decode attention kernel grouped-query models take for long sequences on sm_90
    (:mod:`.cuda_attention`), and from how many keys per sequence: ``LLMCHAT_CUDA_GQA_DECODE`` =
    ``auto`` (default: llmchat's tensor-core kernel for the query heads of a kv head where it
    applies, else the blocks of 4 heads for GQA-4, from ``LLMCHAT_CUDA_GQA_MIN_KEYS`` keys on,
    default 0: the shape's measured threshold; below, one head per block in clusters), ``cluster``
    (always one head per block), ``groups`` (always 4 heads per block, GQA-4), ``mma`` (always the
    tensor-core kernel). A value that is not one of these stops the build (an A/B switch that is
    silently ignored compares nothing)."""
    from app.errors import LlmchatError
    from app.inference.pipelines.cuda_attention import GQA_MODES

    mode = os.environ.get("LLMCHAT_CUDA_GQA_DECODE", "").strip().lower() or "auto"
    if mode not in GQA_MODES:
        raise LlmchatError(
            f"LLMCHAT_CUDA_GQA_DECODE={mode!r} is not one of {', '.join(GQA_MODES)}",
            "unset it (auto) or set one of those",
        )
    raw = os.environ.get("LLMCHAT_CUDA_GQA_MIN_KEYS", "").strip()
    if not raw:
        return mode, 0
    try:
        min_keys = int(raw)
    except ValueError:
        min_keys = 0
    if min_keys < 1:
        raise LlmchatError(
            f"LLMCHAT_CUDA_GQA_MIN_KEYS={raw!r} is not a positive number of keys",
            "unset it (the threshold measured for the model's shape) or set a positive integer",
        )
    return mode, min_keys


def fuse_rope_append(target: Any) -> bool:
    """Whether a decoded token's RoPE and KV append move into the decode attention
    (:mod:`.cuda_rope_append`): with llmchat's attention (its cluster kernel, sm_90) and matmul
    kernels, which record the q/k/v projection it reads."""
    return (
        use_cuda_attention(target)
        and max_cluster_size(target) > 0
        and use_cuda_kernel_gemv(target)
        and use_cuda_gemm(target)
    )


def use_wgsl_gemm(target: Any) -> bool:
    """Whether the prompt's matmuls on WGSL use :class:`~.gpu_gemm.WgslGemm` (register-tiled,
    256 threads) instead of dlight's Matmul default (64 threads, 4x4 outputs each): on webgpu
    unless ``LLMCHAT_WGSL_GEMM=tvm``."""
    choice = os.environ.get("LLMCHAT_WGSL_GEMM", "").strip().lower()
    return target.kind.name == "webgpu" and choice != "tvm"


def use_wgsl_q4_gemm(target: Any) -> bool:
    """Whether the prompt's q4f16_1 matmuls on WGSL take :class:`~.wgsl_q4_gemm.WgslQ4Gemm`
    (vec4 tiles, register prefetch) before :class:`~.gpu_gemm.WgslGemm`: on webgpu unless
    ``LLMCHAT_WGSL_GEMM`` is ``tiled`` (the scheduled GEMM for every prompt matmul) or ``tvm``."""
    choice = os.environ.get("LLMCHAT_WGSL_GEMM", "").strip().lower()
    return use_wgsl_gemm(target) and choice != "tiled"


def wgsl_q4_gemm_half() -> bool:
    """Whether :class:`~.wgsl_q4_gemm.WgslQ4Gemm` multiplies and sums a K step in fp16
    (``LLMCHAT_WGSL_GEMM=f16``: tested on lavapipe, not yet measured on a GPU) instead of fp32
    (the default, measured on the H200 in session 23)."""
    return os.environ.get("LLMCHAT_WGSL_GEMM", "").strip().lower() == "f16"


def uses_cuda_graph(target: Any) -> bool:
    """CUDA graphs are a CUDA runtime feature; other GPU runtimes launch kernels one by one."""
    return target.kind.name == "cuda"
