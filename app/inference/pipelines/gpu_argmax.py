"""dlight-style rule: the exported ``argmax`` (``device_ops.argmax_te``) on GPUs without llmchat's
CUDA kernel (WebGPU/Vulkan) becomes one workgroup of :data:`THREADS` threads: each thread scans a
strided share of the vocabulary (:data:`UNROLL` loads at a time), then a tree reduction of
(value, index) pairs in workgroup memory picks the largest value, the lowest index on ties (as
numpy's argmax).

dlight's reduction rules cannot schedule this tuple reduction for WGSL: they stage partial
results in a ``global`` buffer, which TVM's WebGPU code generator refuses, and the cross-thread
reduction does not match the model's int64-indexed reducer."""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.tir_facts import WebGPUKernelRule, argmax_buffers

#: threads of the one workgroup (WebGPU guarantees 256 invocations per workgroup)
THREADS = 256
_STEPS = THREADS.bit_length() - 1  # log2(THREADS) halving steps
#: loads each thread has in flight: one dependent load at a time made the 151,936-word scan of
#: Qwen2.5's vocabulary latency-bound (H200, NVIDIA's Vulkan driver: 194 us per step; the
#: GPU profile of LLMCHAT_WEBGPU_PROFILE=1, benchmarks/results/h200-2026-12-02-vulkan-profile)
UNROLL = 16


def argmax_kernel(vocab: int) -> Any:
    """The workgroup argmax over ``[1, 1, vocab]`` float32 logits, as a scheduled PrimFunc."""
    from tvm.script import tirx as T

    threads, steps, chunks = THREADS, _STEPS, -(-vocab // THREADS)
    unroll = min(UNROLL, chunks)
    batches = -(-chunks // unroll)

    @T.prim_func(private=True)
    def kernel(logits: T.Buffer((1, 1, vocab), "float32"), out: T.Buffer((1,), "int32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", 1)  # noqa: F841
        tx = T.launch_thread("threadIdx.x", threads)
        # two halves, read one and write the other at each step: no shared access sits under a
        # condition (TVM's barrier pass refuses that) and no step reads what it writes
        best_v = T.decl_buffer((2 * threads,), "float32", scope="shared")
        best_i = T.decl_buffer((2 * threads,), "int32", scope="shared")
        lv = T.decl_buffer((1,), "float32", scope="local")  # this thread's best so far
        li = T.decl_buffer((1,), "int32", scope="local")
        ov = T.decl_buffer((1,), "float32", scope="local")  # its partner's
        oi = T.decl_buffer((1,), "int32", scope="local")
        vals = T.decl_buffer((unroll,), "float32", scope="local")  # a batch of loads in flight
        lv[0] = T.min_value("float32")
        li[0] = vocab
        for jo in range(batches):
            for u in T.unroll(unroll):  # the loads first, independent of each other
                vals[u] = T.min_value("float32")
                if (jo * unroll + u) * threads + tx < vocab:  # no load past the end
                    vals[u] = logits[0, 0, (jo * unroll + u) * threads + tx]
            for u in T.unroll(unroll):  # then the comparisons, in index order (first index on ties)
                if vals[u] > lv[0]:
                    lv[0] = vals[u]
                    li[0] = (jo * unroll + u) * threads + tx
        best_v[tx] = lv[0]
        best_i[tx] = li[0]
        T.tvm_storage_sync("shared")
        for s in T.unroll(steps):
            ov[0] = best_v[(s % 2) * threads + T.min(tx + T.shift_right(threads // 2, s), threads - 1)]
            oi[0] = best_i[(s % 2) * threads + T.min(tx + T.shift_right(threads // 2, s), threads - 1)]
            li[0] = T.if_then_else(
                tx < T.shift_right(threads // 2, s) and (ov[0] > lv[0] or (ov[0] == lv[0] and oi[0] < li[0])),
                oi[0],
                li[0],
            )
            lv[0] = T.if_then_else(li[0] == oi[0], ov[0], lv[0])
            best_v[threads - (s % 2) * threads + tx] = lv[0]
            best_i[threads - (s % 2) * threads + tx] = li[0]
            T.tvm_storage_sync("shared")
        if tx == 0:
            out[0] = T.if_then_else(li[0] < vocab, li[0], 0)

    return kernel


class GpuArgmax(WebGPUKernelRule):
    """Replace the annotated argmax PrimFunc by :func:`argmax_kernel` (WebGPU targets)."""

    def kernel(self, func: Any, max_shared: int = 1 << 30) -> Any | None:
        found = argmax_buffers(func)
        return None if found is None else argmax_kernel(found[2])
