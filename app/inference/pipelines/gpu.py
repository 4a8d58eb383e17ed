"""The compiler pipeline for GPUs (cuda, rocm, vulkan, metal): the passes and schedule rules, in order.

TVM's GPU pipeline (legalize, fuse, dlight schedules: MLC's tuned GEMV configurations for CUDA,
ROCm, Vulkan and Metal), plus the kernels below; which of them a target gets is decided in
:mod:`.gpu_choices` (by backend, CUDA architecture and the ``LLMCHAT_*`` switches):

- an exact rewrite of the 4-bit decode ``float(u & 15)`` into float bit tricks (one OR and one
  FADD instead of an integer-to-float conversion, which runs at a fraction of the FMA rate;
  :func:`.gpu_gemv.fast_small_uint_to_float`);
- CUDA graphs on CUDA (the static parts of each function are captured and replayed);
- dlight's Matmul rule kept on its SIMT path: TVM 0.27's tensor-core path segfaults on fp16
  matmuls whose static dims all exceed 64;
- ``DecodeGEMV`` (:mod:`.gpu_gemv`), a batch-1 dequantizing GEMV rule. Used on CUDA and WGSL (see
  :func:`.gpu_choices.use_llmchat_gemv`; on WGSL in a layout of :mod:`.wgsl_gemv`'s family); rows
  it cannot tile go to dlight's GEMV.
- on WGSL (webgpu/Vulkan), ``WgslGemm`` (:mod:`.gpu_gemm`) for the prompt's matmuls: 256 threads,
  8x4 or 8x8 fp32 accumulators each, weight and activation tiles in workgroup memory, the weight
  decoded one packed word per thread (dlight's Matmul default there: 64 threads, 4x4 each, one
  word load per 4-bit value); ``LLMCHAT_WGSL_GEMM=tvm`` gives dlight's back; the q4f16_1 ones
  take ``WgslQ4Gemm`` (:mod:`.wgsl_q4_gemm`: hand-written TIR, vec4 tiles in workgroup memory,
  the next step's loads in registers before this step's FMAs; ``LLMCHAT_WGSL_GEMM=f16`` sums
  a K step's products in fp16) unless ``LLMCHAT_WGSL_GEMM=tiled``;
- on CUDA, llmchat's hand-written kernels (``cuda_kernels.cu``) in place of TVM's for the decode
  GEMVs (with the gate_up GEMV also applying SiLU·mul: ``cuda_silu_gate``), the prompt GEMMs, the
  decode and prompt attention (on sm_90 the decode attention also applies a decoded token's RoPE
  and appends it to the KV cache: ``cuda_rope_append``), the decode RMSNorm and the greedy argmax,
  each chosen by GPU generation;
- on WebGPU/Vulkan, TVM's decode attention (one workgroup per KV head, every key in turn) split
  along the keys and the query heads over many workgroups with a merge kernel
  (``wgsl_attention``), which also applies a decoded token's RoPE and appends it to the KV cache
  (``wgsl_rope_append``: two launches a layer fewer; ``LLMCHAT_WGSL_ROPE_APPEND=off`` keeps them);
- on WebGPU/Vulkan, a prompt chunk's attention to its own keys and to the cache's pages by
  llmchat's kernel (``wgsl_prefill_attention``: 32 query rows a workgroup, causal tiles skipped;
  ``LLMCHAT_WGSL_PREFILL_ATTENTION=tvm`` keeps TVM's), and the merge of its two partial softmaxes
  (``wgsl_merge_state``: TVM's races where a subgroup is narrower than ``head_dim / 4`` threads);
- on WebGPU/Vulkan, the SiLU gate (and the RMSNorm of short rows) computed by llmchat's int8 GEMV
  kernel beside them, and the longer rows' RMSNorm writing the vector quantized once for the GEMVs
  after it (``wgsl_fusion``; ``LLMCHAT_WGSL_FUSION=off`` keeps them apart).

Nothing here assumes tensor cores, and every reduction works with 32-wide waves (RDNA, NVIDIA).
On WGSL, cross-thread reductions use subgroup shuffles only for an adapter profile with one fixed
subgroup size (``-sgN``, :mod:`.wgsl_subgroups`); otherwise workgroup memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from app.inference.pipelines.cuda_argmax import CudaArgmax
from app.inference.pipelines.cuda_attention import (
    prefill_attention_pass,
    prefill_paged_attention_pass,
    split_decode_attention_pass,
)
from app.inference.pipelines.cuda_gemm import CudaQ4Gemm
from app.inference.pipelines.cuda_gemv import CudaQ4Gemv
from app.inference.pipelines.cuda_kernels import prim_func_pass
from app.inference.pipelines.cuda_rms_norm import CudaRmsNorm
from app.inference.pipelines.cuda_rope_append import mark_rope_append_pass, skip_single_token_pass
from app.inference.pipelines.cuda_silu_gate import fuse_silu_gate_pass
from app.inference.pipelines.gpu_choices import (
    TENSOR_CORE_MATMUL,
    cuda_gqa_decode,
    cuda_paged_prefill,
    fuse_rope_append,
    max_cluster_size,
    use_cuda_attention,
    use_cuda_gemm,
    use_cuda_gemm_mma,
    use_cuda_kernel_gemv,
    use_cuda_prompt_attention,
    use_llmchat_gemv,
    use_wgsl_attention,
    use_wgsl_gemm,
    use_wgsl_prefill_attention,
    use_wgsl_q4_gemm,
    uses_cuda_graph,
    wgsl_attention_variant,
    wgsl_q4_gemm_half,
)
from app.inference.pipelines.gpu_gemv import DecodeGEMV, fast_small_uint_to_float


@contextlib.contextmanager
def _simt_matmul_only() -> Iterator[None]:
    """TVM 0.27's dlight tensor-core matmul crashes (segfault in s_tir Tensorize) on fp16 matmuls
    whose static dims all exceed 64; make the Matmul rule take its SIMT path while we compile."""
    import tvm.s_tir.dlight.gpu.matmul as matmul

    if TENSOR_CORE_MATMUL:
        yield
        return
    original = matmul.check_sm_version
    matmul.check_sm_version = lambda _arch: 0
    try:
        yield
    finally:
        matmul.check_sm_version = original


def attention_passes(target: Any) -> list[Any]:
    """The passes that put llmchat's attention kernels in place of TVM's on ``target``."""
    if target.kind.name == "webgpu":
        from app.inference.pipelines.wgsl_attention import split_decode_attention_pass as wgsl_split
        from app.inference.pipelines.wgsl_merge_state import merge_state_pass
        from app.inference.pipelines.wgsl_prefill_attention import prefill_attention_pass as wgsl_prefill

        shared = int(target.attrs["max_shared_memory_per_block"])
        passes = []
        if use_wgsl_attention(target):
            passes.append(
                wgsl_split(
                    max_threads=int(target.attrs["max_num_threads"]),
                    shared_bytes=shared,
                    variant=wgsl_attention_variant(),
                )
            )
        if use_wgsl_prefill_attention(target):
            passes.append(wgsl_prefill(shared))
        # TVM's merge of two partial softmaxes races on subgroups narrower than head_dim / 4
        # threads (lavapipe's): llmchat's, always
        passes.append(merge_state_pass())
        return passes
    if not use_cuda_attention(target):
        return []
    gqa, gqa_min_keys = cuda_gqa_decode()
    passes = [split_decode_attention_pass(max_cluster_size(target), gqa, gqa_min_keys)]
    if use_cuda_prompt_attention(target):
        passes.append(prefill_attention_pass())
        paged = cuda_paged_prefill()
        if paged != "tvm":
            passes.append(prefill_paged_attention_pass(pipelined=paged == "async"))
    return passes


def schedule_rules(target: Any) -> list[Any]:
    """The dlight rules, in order, for ``target``."""
    from tvm.s_tir import dlight as dl

    first = [DecodeGEMV()] if use_llmchat_gemv(target) else []
    if first and target.kind.name == "webgpu":
        from app.inference.pipelines import wgsl_gemv

        first = wgsl_gemv.rules()  # DecodeGEMV() unless LLMCHAT_WGSL_GEMV names variants
    if use_cuda_kernel_gemv(target):
        first = [CudaQ4Gemv(), *first]
    if use_cuda_gemm(target):
        first = [CudaQ4Gemm(mma=use_cuda_gemm_mma(target)), *first]
    if target.kind.name == "cuda":
        first = [CudaArgmax(), CudaRmsNorm(), *first]
    elif target.kind.name == "webgpu":
        from app.inference.pipelines.gpu_argmax import GpuArgmax
        from app.inference.pipelines.wgsl_rms_norm import WgslRmsNorm

        first = [GpuArgmax(), WgslRmsNorm(), *first]
        if use_wgsl_q4_gemm(target):
            from app.inference.pipelines.wgsl_q4_gemm import WgslQ4Gemm

            first = [*first, WgslQ4Gemm(half=wgsl_q4_gemm_half())]
        if use_wgsl_gemm(target):
            from app.inference.pipelines.gpu_gemm import WgslGemm

            first = [*first, WgslGemm()]
    return [
        *first,
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.LowBatchGEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    ]


def fusion_passes(target: Any) -> list[Any]:
    """On WGSL: the RMSNorm and SiLU-gate kernels computed by the int8 GEMV kernel beside them
    (default), or the prologues grafted into the GEMV after them as :func:`schedule_rules`
    schedules it (``LLMCHAT_WGSL_FUSION=on``); :mod:`.wgsl_fusion`."""
    from app.inference.pipelines.wgsl_fusion import (
        fuse_int8_pass,
        fuse_prologues_pass,
        use_int8_fusion,
        use_wgsl_fusion,
    )

    if use_int8_fusion(target):
        return [fuse_int8_pass(target)]
    return [fuse_prologues_pass(schedule_rules(target), target)] if use_wgsl_fusion(target) else []


def fast_decode_pass() -> Any:
    """Module pass: :func:`fast_small_uint_to_float` on every PrimFunc (exact; removes I2F)."""
    return prim_func_pass("llmchat_fast_uint4_decode", fast_small_uint_to_float, only_unscheduled=True)


def _backend_passes(target: Any) -> Any:
    """TVM's per-backend pass lists (library dispatch, lowering, finalization) for ``target``."""
    kind = target.kind.name
    if kind == "cuda":
        from tvm.relax.backend.cuda import pipeline
    elif kind == "rocm":
        from tvm.relax.backend.rocm import pipeline
    else:
        from tvm.relax.backend.gpu_generic import pipeline
    return pipeline


def schedule_passes(target: Any) -> list[Any]:
    """The pipeline's passes up to scheduled kernels (before the backend's lowering): what
    :mod:`.kernel_count` counts the launches of."""
    from tvm import relax
    from tvm.s_tir import dlight as dl

    wgsl_ra = _wgsl_rope_append(target)
    return [
        *_backend_passes(target).library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        *([fuse_silu_gate_pass()] if use_cuda_kernel_gemv(target) else []),
        *([mark_rope_append_pass()] if fuse_rope_append(target) else []),
        fast_decode_pass(),
        *fusion_passes(target),
        *wgsl_ra[:1],
        *attention_passes(target),
        dl.ApplyDefaultSchedule(*schedule_rules(target)),
        *([skip_single_token_pass()] if fuse_rope_append(target) or wgsl_ra else []),
        *wgsl_ra[1:],
    ]


def _wgsl_rope_append(target: Any) -> list[Any]:
    """On WGSL with llmchat's v2 decode attention: the passes that fold a decoded token's RoPE and
    KV append into it (:mod:`.wgsl_rope_append`: its mark pass, then its record pass for after
    the schedules), unless ``LLMCHAT_WGSL_ROPE_APPEND=off``; else none."""
    from app.inference.pipelines import wgsl_rope_append

    variant = wgsl_attention_variant()
    if not (use_wgsl_attention(target) and variant.startswith("split-v2") and wgsl_rope_append.enabled()):
        return []
    plan = wgsl_rope_append.Plan()
    return [
        wgsl_rope_append.mark_pass(
            plan,
            int(target.attrs["max_num_threads"]),
            int(target.attrs["max_shared_memory_per_block"]),
            variant,
        ),
        wgsl_rope_append.record_pass(plan),
    ]


def gpu_pipeline(target: Any, cuda_graph: bool | None = None) -> Any:
    """The relax pipeline for a GPU ``target``, as ``tvm.compile(..., relax_pipeline=...)`` takes it."""
    import tvm

    backend = _backend_passes(target)
    graph = uses_cuda_graph(target) if cuda_graph is None else cuda_graph

    @tvm.transform.module_pass(opt_level=0, name="llmchat_gpu_pipeline")
    def _pipeline(mod: Any, ctx: Any) -> Any:
        config = dict(ctx.config) if ctx.config is not None else {}
        config["relax.backend.use_cuda_graph"] = bool(graph)
        passes = [
            *schedule_passes(target),
            *backend.dataflow_lower_passes(target),
            *backend.finalize_passes(target),
        ]
        with (
            _simt_matmul_only(),
            target,
            tvm.transform.PassContext(
                opt_level=ctx.opt_level,
                config=config,
                required_pass=list(ctx.required_pass),
                disabled_pass=list(ctx.disabled_pass),
            ),
        ):
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
