"""dlight-style rule: the decode step's RMSNorm on WebGPU/Vulkan as one workgroup of
:data:`THREADS` threads, each loading its strided share of the row (all loads first, so they are
in flight together), a tree sum of squares in workgroup memory, then ``x * rsqrt(mean + eps) * w``.

dlight's reduction rule gave a kernel whose loads waited on one another: 15.5 us per Llama-2-7B
norm (65 per token, 1.0 ms of a 7.2 ms step) on the H200 through NVIDIA's Vulkan driver
(``LLMCHAT_WEBGPU_PROFILE=1``, benchmarks/results/h200-2026-12-02-vulkan-profile). It replaces a
PrimFunc only where that is TVM's own ``rms_norm`` of a float16 ``[1, 1, K]`` row
(:func:`~app.inference.pipelines.cuda_rms_norm.match_rms_norm`), with the same float32 arithmetic
(the sum added in another order)."""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.cuda_rms_norm import match_rms_norm
from app.inference.pipelines.tir_facts import WebGPUKernelRule

#: threads of the one workgroup (WebGPU guarantees 256 invocations per workgroup)
THREADS = 256
_STEPS = THREADS.bit_length() - 1  # log2(THREADS) halving steps


def rms_norm_kernel(k: int, eps: float) -> Any:
    """The workgroup RMSNorm of a float16 ``[1, 1, k]`` row with a float16 weight, scheduled."""
    from tvm.script import tirx as T

    threads, steps, per = THREADS, _STEPS, -(-k // THREADS)

    @T.prim_func(private=True)
    def kernel(
        x: T.Buffer((1, 1, k), "float16"), w: T.Buffer((k,), "float16"), out: T.Buffer((1, 1, k), "float16")
    ):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", 1)  # noqa: F841
        tx = T.launch_thread("threadIdx.x", threads)
        # two halves, read one and write the other at each step (as gpu_argmax: no shared access
        # under a condition, no step reads what it writes)
        part = T.decl_buffer((2 * threads,), "float32", scope="shared")
        xs = T.decl_buffer((per,), "float32", scope="local")
        acc = T.decl_buffer((1,), "float32", scope="local")
        for j in T.unroll(per):
            xs[j] = T.float32(0)
            if j * threads + tx < k:
                xs[j] = T.Cast("float32", x[0, 0, j * threads + tx])
        acc[0] = T.float32(0)
        for j in T.unroll(per):
            acc[0] = acc[0] + xs[j] * xs[j]
        part[tx] = acc[0]
        T.tvm_storage_sync("shared")
        for s in T.unroll(steps):
            acc[0] = acc[0] + T.if_then_else(
                tx < T.shift_right(threads // 2, s),
                part[(s % 2) * threads + T.min(tx + T.shift_right(threads // 2, s), threads - 1)],
                T.float32(0),
            )
            part[threads - (s % 2) * threads + tx] = acc[0]
            T.tvm_storage_sync("shared")
        acc[0] = T.rsqrt(part[(steps % 2) * threads] / T.float32(k) + T.float32(eps))
        for j in T.unroll(per):
            if j * threads + tx < k:
                out[0, 0, j * threads + tx] = T.Cast(
                    "float16", acc[0] * xs[j] * T.Cast("float32", w[j * threads + tx])
                )

    return kernel


class WgslRmsNorm(WebGPUKernelRule):
    """Replace TVM's decode rms_norm PrimFunc by :func:`rms_norm_kernel` (WebGPU targets)."""

    def kernel(self, func: Any, max_shared: int = 1 << 30) -> Any | None:
        found = match_rms_norm(func)
        return None if found is None else rms_norm_kernel(*found)
