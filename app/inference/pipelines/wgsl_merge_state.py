"""The merge of two partial softmaxes on WGSL (WebGPU/Vulkan), in place of TVM's
``tir_attention_merge_state``: ``V, S <- merge((V, S), (V_other, S_other))`` for every (row, head)
pair, with log2-domain log-sum-exps ``S``. TVM's paged KV cache calls it after a prompt chunk's
attention to its own keys and to the cache's pages (a second turn, a long prompt's later chunks).

Why not TVM's (``relax/frontend/nn/llm/_decode_kernels.py``, ``_merge_state_inplace``): it gives a
(row, head) pair ``head_dim / 4`` threads, each of which reads ``S[row, head]``, merges its four
values and writes the merged ``S`` back, with nothing between one thread's write and another's
read. Where a pair's threads are one subgroup running in step (NVIDIA: 32 for head_dim 128) all
reads come first; where they span several subgroups, a later one reads the merged ``S`` and
scales its values wrongly. On lavapipe (8 lanes a subgroup with 256-bit vectors) head_dim 64 and
128 span 2 and 4: a second turn's logits came out 0.1-0.7 of the largest logit off a fresh prefill
of the same tokens (session 24; head_dim 32 was right). The same holds on any device whose
subgroups are narrower than ``head_dim / 4`` (WGSL promises no lockstep at all).

Here: :data:`PAIRS` (row, head) pairs a workgroup, :data:`LANES` threads a pair striding over the
head dimension; every thread reads both ``S`` values first, a workgroup barrier, then the pair's
thread 0 writes the merged ``S``. Sizes stay symbolic, as in TVM's signature.
"""

from __future__ import annotations

from typing import Any

#: TVM's global symbol of the kernel (``kv_cache.py``; the MLA variant keeps TVM's)
MERGE_STATE = "tir_attention_merge_state"
#: threads along the head dimension of one (row, head) pair
LANES = 32
#: (row, head) pairs a workgroup
PAIRS = 4


def merge_state_kernel(dtype: str) -> Any:
    """The PrimFunc: TVM's parameters ``(v, s, v_other, s_other)``, ``V`` and ``V_other`` of
    ``[rows, heads, head_dim]`` in ``dtype``, ``S`` and ``S_other`` of ``[rows, heads]`` in fp32."""
    from tvm.script import tirx as T

    @T.prim_func(private=True)
    def merge_state_inplace(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "llmchat_kernel": "wgsl_merge_state"})
        n = T.int32()
        h = T.int32()
        d = T.int32()
        V = T.match_buffer(v, (n, h, d), dtype)
        S = T.match_buffer(s, (n, h), "float32")
        V_other = T.match_buffer(v_other, (n, h, d), dtype)
        S_other = T.match_buffer(s_other, (n, h), "float32")
        bx = T.launch_thread("blockIdx.x", (n * h + (PAIRS - 1)) // PAIRS)
        ty = T.launch_thread("threadIdx.y", PAIRS)
        tx = T.launch_thread("threadIdx.x", LANES)
        # weight of V, of V_other, their sum, the larger log-sum-exp
        w = T.decl_buffer((4,), "float32", scope="local")
        pair = T.meta_var(bx * PAIRS + ty)
        row = T.meta_var(pair // h)
        head = T.meta_var(pair % h)
        if pair < n * h:
            w[3] = T.max(S[row, head], S_other[row, head])
            w[0] = T.exp2(S[row, head] - w[3])
            w[1] = T.exp2(S_other[row, head] - w[3])
            w[2] = w[0] + w[1]
            for i in T.serial((d + (LANES - 1)) // LANES):
                if i * LANES + tx < d:
                    V[row, head, i * LANES + tx] = T.Cast(
                        dtype,
                        (
                            T.Cast("float32", V[row, head, i * LANES + tx]) * w[0]
                            + T.Cast("float32", V_other[row, head, i * LANES + tx]) * w[1]
                        )
                        / w[2],
                    )
        T.tvm_storage_sync("shared")  # every thread of the pair has read S
        if pair < n * h and tx == 0:
            S[row, head] = T.log2(w[2]) + w[3]

    return merge_state_inplace


def merge_state(func: Any) -> Any | None:
    """:func:`merge_state_kernel` for TVM's ``func`` (four parameters, ``V`` of three dimensions),
    with ``func``'s attributes; None for another signature."""
    if len(func.params) != 4:
        return None
    v = func.params[0]
    if len(getattr(v, "shape", ())) != 3:
        return None
    from app.inference.pipelines.wgsl_attention import _with_attrs

    return _with_attrs(merge_state_kernel(str(v.dtype)), func)


def merge_state_pass() -> Any:
    """Module pass: :func:`merge_state` on the PrimFunc whose global symbol is :data:`MERGE_STATE`."""
    from app.inference.pipelines.cuda_kernels import prim_func_pass

    def rewrite(func: Any) -> Any | None:
        symbol = "" if func.attrs is None else str(func.attrs.get("global_symbol", ""))
        return merge_state(func) if symbol == MERGE_STATE else None

    return prim_func_pass("llmchat_wgsl_merge_state", rewrite)
