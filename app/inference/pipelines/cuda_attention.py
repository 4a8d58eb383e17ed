"""Decode attention on CUDA split along the sequence (``llmchat::decode_attention``).

TVM 0.27's ``batch_decode_paged_kv`` kernel runs one thread block per KV head: 32 blocks for
Llama-2-7B and 2 for Qwen2.5 on a GPU with 132 multiprocessors, and its time grows with the
context. :func:`split_decode_attention_pass` keeps that PrimFunc's signature and puts in front of
its body by a launch of llmchat's kernel on (chunks x head groups x sequences) blocks. The kernel
expects the rotary embedding applied before the cache (llmchat's models use ``RopeMode.NORMAL``;
anything else stops with a CUDA error instead of a wrong answer); a batch too large for its
static scratch area runs unsplit.
"""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.cuda_kernels import launch, prim_func_pass

#: the PrimFunc TVM's paged KV cache uses for decode attention (no sliding window)
DECODE_ATTENTION = "batch_decode_paged_kv"
#: thread blocks the split aims at (a few waves on a large GPU)
TARGET_BLOCKS = 256


def _static(expr: Any) -> int | None:
    from tvm import tirx

    if isinstance(expr, int):
        return expr
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def heads_per_block(group: int) -> int:
    """Query heads one block handles (of the ``group`` sharing a kv head): 2 when the group
    divides evenly, else 1 (registers: every thread keeps each head's query and output)."""
    return 2 if group % 2 == 0 else 1


def num_chunks(head_blocks: int) -> int:
    """Chunks per sequence and head block: a power of two near TARGET_BLOCKS / head_blocks, 1..32."""
    chunks = 1
    while chunks < 32 and chunks * head_blocks < TARGET_BLOCKS:
        chunks *= 2
    return chunks


def split_decode_attention(func: Any) -> Any | None:
    """``func`` (TVM's ``batch_decode_paged_kv``) with llmchat's kernel in front, or None when
    its shapes are not the ones the kernel handles."""
    from tvm import tirx

    names = [str(p) for p in func.params]
    if names[:9] != ["Q", "pages", "page_table_indptr", "page_table_values", "length_info",
                     "k_rope_pos_offset", "q_rope_position", "output", "lse"] or len(names) != 13:
        return None
    q, pages, indptr, values, length_info, _k_off, _q_pos, output, lse = func.params[:9]
    rotary_mode, _rope_scale, _rope_theta, sm_scale = func.params[9:]
    if (str(q.dtype) != "float16" or str(pages.dtype) != "float16" or len(pages.shape) != 5
            or len(q.shape) != 3 or len(length_info.shape) != 1):
        return None
    h_qo, d = _static(q.shape[1]), _static(q.shape[2])
    h_kv, page = _static(pages.shape[2]), _static(pages.shape[3])
    if None in (h_qo, d, h_kv, page) or h_qo % h_kv or d % 8 or d // 8 not in (1, 2, 4, 8, 16, 32):
        return None
    per_block = heads_per_block(h_qo // h_kv)
    chunks = num_chunks(h_qo // per_block)
    batch = q.shape[0]

    def at(buf: Any) -> Any:
        return tirx.address_of(tirx.BufferLoad(buf, [tirx.IntImm("int32", 0)] * len(buf.shape)))

    name = f"llmchat::decode_attention<{h_qo}, {h_kv}, {d}, {page}, {chunks}, {per_block}>"
    call = tirx.call_extern("int32", name, at(q), at(pages), at(indptr), at(values), at(length_info),
                            at(output), at(lse), sm_scale, batch, rotary_mode)
    kernel = launch(call, {"blockIdx.x": chunks, "blockIdx.y": h_qo // per_block, "blockIdx.z": batch},
                    {"threadIdx.x": 32, "threadIdx.y": 4})
    return func.with_body(kernel)


def split_decode_attention_pass() -> Any:
    """Module pass: :func:`split_decode_attention` on TVM's decode attention PrimFunc."""

    def rewrite(func: Any) -> Any | None:
        if func.attrs is None or str(func.attrs.get("global_symbol", "")) != DECODE_ATTENTION:
            return None
        return split_decode_attention(func)

    return prim_func_pass("llmchat_split_decode_attention", rewrite)
