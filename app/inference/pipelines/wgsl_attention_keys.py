"""Decode attention for a KV head with one query head (multi-head attention: Llama-2-7B), keys in
parallel, for WGSL (WebGPU/Vulkan): v2's kernel for these shapes with
:data:`.wgsl_attention.DEFAULT_KEY_THREADS` threads a key (``split-v2-keyN`` for A/B,
:func:`.wgsl_attention.v2_options`). H200, NVIDIA's Vulkan driver, Llama-2-7B: decode 300 -> 377-381
tok/s (bench protocol; 8 threads a key: 370-372) and 172 -> 288 tok/s at 3,072 keys of context
(with :data:`TARGET_WORKGROUPS_KEYS`; benchmarks/results/h200-2026-12-04-s20/).

v2 (:func:`.wgsl_attention.decode_kernel_v2`) stages a tile of keys and values in workgroup
memory, then gives each score to a few threads and has *every* thread of a head sum every score
of the tile and run the softmax over it. With one query head per KV head that is 128 threads
that each add up all 32 scores (128 workgroup-memory reads a tile), and a tile's keys wait for
its values behind three barriers. The H200 profile of the Llama-2-7B shape puts this kernel
first: ~30 us a launch at 3-67 keys (32 workgroups, one per KV head) where its keys and values
are well under 1 MB.

Here a workgroup of ``threads`` threads takes one chunk of one KV head's keys, ``tpk`` threads a
key (``slots = threads / tpk`` keys a step), each thread ``d / tpk`` dimensions of its key,
interleaved (dimension ``j * tpk + lane``, so the threads of a key read adjacent halves):

1. the query (with RoPE in the fused kernel) into registers, ``d / tpk`` values a thread;
2. a step: each thread loads its dimensions of its key and value straight into registers (the
   next step's are loaded while this step computes: software pipelining), its part of the
   score goes to workgroup memory, one barrier, and each thread adds its key's ``tpk`` parts;
3. each key slot runs its own online softmax over the keys it sees (running maximum and sum,
   its dimensions of the weighted values), so no thread waits on another key's score;
4. at the end of the chunk one barrier combines the slots: their maxima, their sums and their
   outputs through workgroup memory (``slots x d`` floats).

The PrimFunc around the launch (TVM's signature, the chunks, the merge launch) is v2's
(:func:`.wgsl_attention.paged_decode_func`, :func:`.wgsl_attention.merge_chunks`): one chunk up
to ``single_pages`` pages, then chunks of at least one step, at most ``max_chunks`` a KV head.

**Fused** (the RoPE and the KV append of the decoded token, :mod:`.wgsl_rope_append`): as v2, q
and the new key get RoPE from the recorded q/k/v projection and the workgroup whose chunk holds
the last key writes the key and value to their page slot; the page loop stops before the last
key and one extra step takes it from workgroup memory (the new key and value, staged once),
counted by the first key slot only.

Work per key and thread, counted from the structure (not measured): 2 x d/tpk loads, d/tpk
products for the score, one write and ``tpk`` reads of workgroup memory, two exp2 and 2 x d/tpk
multiply-adds for the values; v2 at head_dim 128 and 128 threads: one load of K and of V, 32
products per 32 keys, plus 4 reads, a max, an exp2 and a multiply-add for *every* key of the tile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.wgsl_attention import (
    LOG2E,
    NEG,
    V2Options,
    _q_value,
    chunk_span,
    merge_chunks,
    new_token_kv,
    paged_decode_func,
)

#: threads a workgroup
THREADS = 256
#: workgroups aimed at over the chunks and KV heads of one sequence at long contexts (v2's:
#: :data:`.wgsl_attention.TARGET_WORKGROUPS_V2`, 128); ``split-v2-wgN`` for A/B. H200, NVIDIA's
#: Vulkan driver, Llama-2-7B (32 KV heads), 16 threads a key, decode tok/s at 0 / 1,024 / 3,072 keys
#: of context: 128 workgroups (4 chunks a KV head) 380.7 / 324.3 / 258.6, **256** 382.4 / 339.5 /
#: 288.3, 512 388.2 / 330.5 / 288.2; bench protocol 375.6, 376.9, 371.1
#: (benchmarks/results/h200-2026-12-04-s20/callD)
TARGET_WORKGROUPS_KEYS = 256


@dataclass(frozen=True)
class KeyLayout:
    """How :func:`decode_kernel_keys` splits the work: ``threads`` threads a workgroup, ``tpk`` a
    key (``slots`` keys a step), chunks of at least ``min_pages`` pages (one chunk up to
    ``single_pages``), at most ``max_chunks`` a KV head."""

    threads: int
    tpk: int
    slots: int
    min_pages: int
    single_pages: int
    max_chunks: int


def shared_floats(threads: int, slots: int, d: int) -> int:
    """Workgroup memory of the kernel in floats: the query, the new key and value, the score
    parts (two steps' worth), the slots' maxima and sums, and their outputs."""
    return threads * 7 + slots * d


def key_layout(
    h_qo: int, h_kv: int, d: int, page: int, max_threads: int, shared_bytes: int, options: V2Options
) -> KeyLayout | None:
    """The layout for these shapes, or None where the kernel does not apply (more than one query
    head a KV head, ``options.key_threads`` 0, head_dim not a power of two dividing the threads,
    or workgroup memory short)."""
    tpk = options.key_threads
    if tpk <= 0 or h_qo != h_kv or d & (d - 1) or d < tpk or d % tpk:
        return None
    threads = min(THREADS, max_threads)
    if threads % d or threads % tpk:
        return None
    slots = threads // tpk
    if slots % (threads // d):  # the combine: each of threads / d lanes sums as many slots
        return None
    if shared_floats(threads, slots, d) * 4 > shared_bytes:
        return None
    min_pages = max(1, -(-slots // page))  # a chunk of at least one step
    single_pages = max(1, options.single_keys // page) if options.single_keys > 0 else 0
    max_chunks = max(1, (options.target_workgroups or TARGET_WORKGROUPS_KEYS) // h_kv)
    return KeyLayout(threads, tpk, slots, min_pages, single_pages, max_chunks)


def decode_kernel_keys(
    h_qo: int, h_kv: int, d: int, page: int, dtype: str, layout: KeyLayout, fused: bool = False
) -> Any:
    """The key-parallel decode attention (module docstring) as a scheduled PrimFunc with
    ``batch_decode_paged_kv``'s parameters (no sliding window), one query head a KV head.
    ``fused``: as :func:`.wgsl_attention.decode_kernel_v2`'s."""
    from tvm.script import tirx as T

    threads, tpk, slots = layout.threads, layout.tpk, layout.slots
    dpt = d // tpk  # dimensions of a thread: j * tpk + tx % tpk
    min_pages, single_pages, max_chunks = layout.min_pages, layout.single_pages, layout.max_chunks
    lanes = max(1, threads // d)
    merge = merge_chunks(h_qo, d, lanes, dtype)
    span = chunk_span(page)
    token_kv = new_token_kv(h_qo, h_kv, d, dtype)

    @T.macro
    def partial(
        B: Any,
        chunks: Any,
        chunk_pages: Any,
        Q: Any,
        pages: Any,
        page_table_indptr: Any,
        page_table_values: Any,
        length_info: Any,
        q_rope_position: Any,
        output: Any,
        lse: Any,
        part_o: Any,
        part_ml: Any,
        rope_scale: Any,
        rope_theta: Any,
        sm_scale: Any,
    ) -> None:
        with T.launch_thread("blockIdx.x", chunks) as c:
            by = T.launch_thread("blockIdx.y", h_kv * B)  # WebGPU: no blockIdx.z
            hk = T.meta_var(by % h_kv)
            b = T.meta_var(by // h_kv)
            tx = T.launch_thread("threadIdx.x", threads)
            q_sh = T.decl_buffer((threads,), "float32", scope="shared")
            new_sh = T.decl_buffer((2 * threads,), "float32", scope="shared")  # fused: new key, value
            red = T.decl_buffer((2 * threads,), "float32", scope="shared")  # score parts, two steps
            ml_sh = T.decl_buffer((2 * threads,), "float32", scope="shared")
            o_sh = T.decl_buffer((slots * d,), "float32", scope="shared")
            info = T.decl_buffer((5,), "int32", scope="local")
            qr = T.decl_buffer((dpt,), "float32", scope="local")
            kr = T.decl_buffer((dpt,), dtype, scope="local")
            vr = T.decl_buffer((dpt,), dtype, scope="local")
            kn = T.decl_buffer((dpt,), dtype, scope="local")
            vn = T.decl_buffer((dpt,), dtype, scope="local")
            acc = T.decl_buffer((dpt,), "float32", scope="local")
            new_kv = T.decl_buffer((2,), "float32", scope="local")
            m = T.decl_buffer((1,), "float32", scope="local")
            m_new = T.decl_buffer((1,), "float32", scope="local")
            l_run = T.decl_buffer((1,), "float32", scope="local")
            s = T.decl_buffer((1,), "float32", scope="local")
            p = T.decl_buffer((1,), "float32", scope="local")
            w = T.decl_buffer((1,), "float32", scope="local")

            span(info, page_table_indptr, length_info, b, c, chunk_pages)
            # keys the page loop reads: fused with one sequence, the last key is the new token's
            # (not in its page yet), taken after the loop
            has_last = T.meta_var(T.And(B == 1, T.And(info[3] > 0, info[2] + info[3] == info[1])))
            if fused:
                info[4] = info[3] - T.if_then_else(has_last, 1, 0)
            else:
                info[4] = info[3]
            q_sh[tx] = (
                T.Cast(
                    "float32",
                    _q_value(
                        T, Q, b, hk, tx % d, fused, B, d, q_rope_position, rope_scale, rope_theta, dtype
                    ),
                )
                * sm_scale
                * LOG2E
            )
            if fused:
                token_kv(new_kv, Q, B, hk, tx % d, q_rope_position, rope_scale, rope_theta)
                new_sh[tx] = new_kv[0]
                new_sh[threads + tx] = new_kv[1]
                # the new key and value into their page slot: the workgroup whose chunk holds it
                if B == 1 and c == (info[1] - 1) // (chunk_pages * page) and tx < d:
                    for kv in T.unroll(2):
                        pages[
                            page_table_values[info[0] + (info[1] - 1) // page],
                            kv,
                            hk,
                            (info[1] - 1) % page,
                            tx,
                        ] = T.Cast(dtype, new_kv[kv])
            m[0] = T.float32(NEG)
            l_run[0] = T.float32(0)
            for j in T.unroll(dpt):
                acc[j] = T.float32(0)
            # step 0's key and value into registers
            pos0 = T.meta_var(T.max(T.min(info[2] + tx // tpk, info[1] - 1), 0))  # clamped
            slot0 = T.meta_var(page_table_values[info[0] + pos0 // page])
            for j in T.unroll(dpt):
                kr[j] = pages[slot0, 0, hk, pos0 % page, j * tpk + tx % tpk]
                vr[j] = pages[slot0, 1, hk, pos0 % page, j * tpk + tx % tpk]
            T.tvm_storage_sync("shared")  # the query staged
            for j in T.unroll(dpt):
                qr[j] = q_sh[j * tpk + tx % tpk]
            for t in range(T.ceildiv(info[4], slots)):
                # the next step's key and value, in flight during this step's work
                pos = T.meta_var(T.max(T.min(info[2] + (t + 1) * slots + tx // tpk, info[1] - 1), 0))
                slot = T.meta_var(page_table_values[info[0] + pos // page])
                for j in T.unroll(dpt):
                    kn[j] = pages[slot, 0, hk, pos % page, j * tpk + tx % tpk]
                    vn[j] = pages[slot, 1, hk, pos % page, j * tpk + tx % tpk]
                s[0] = T.float32(0)
                for j in T.unroll(dpt):
                    s[0] = s[0] + qr[j] * T.Cast("float32", kr[j])
                red[t % 2 * threads + tx] = s[0]
                T.tvm_storage_sync("shared")
                s[0] = T.float32(0)
                for i in T.unroll(tpk):
                    s[0] = s[0] + red[t % 2 * threads + tx // tpk * tpk + i]
                valid = T.meta_var(t * slots + tx // tpk < info[4])
                m_new[0] = T.max(m[0], T.if_then_else(valid, s[0], T.float32(NEG)))
                w[0] = T.exp2(m[0] - m_new[0])
                p[0] = T.if_then_else(valid, T.exp2(s[0] - m_new[0]), T.float32(0))
                l_run[0] = l_run[0] * w[0] + p[0]
                for j in T.unroll(dpt):
                    acc[j] = acc[j] * w[0] + p[0] * T.Cast("float32", vr[j])
                    kr[j] = kn[j]
                    vr[j] = vn[j]
                m[0] = m_new[0]
            if fused:
                # the new token's key, from workgroup memory: every slot scores it, the first
                # slot of the workgroup whose chunk ends with it counts it
                s[0] = T.float32(0)
                for j in T.unroll(dpt):
                    s[0] = s[0] + qr[j] * new_sh[j * tpk + tx % tpk]
                red[T.ceildiv(info[4], slots) % 2 * threads + tx] = s[0]
                T.tvm_storage_sync("shared")
                s[0] = T.float32(0)
                for i in T.unroll(tpk):
                    s[0] = s[0] + red[T.ceildiv(info[4], slots) % 2 * threads + tx // tpk * tpk + i]
                last = T.meta_var(T.And(has_last, tx < tpk))
                m_new[0] = T.max(m[0], T.if_then_else(last, s[0], T.float32(NEG)))
                w[0] = T.exp2(m[0] - m_new[0])
                p[0] = T.if_then_else(last, T.exp2(s[0] - m_new[0]), T.float32(0))
                l_run[0] = l_run[0] * w[0] + p[0]
                for j in T.unroll(dpt):
                    acc[j] = acc[j] * w[0] + p[0] * new_sh[threads + j * tpk + tx % tpk]
                m[0] = m_new[0]
            # the slots combined: their maxima, sums and outputs
            ml_sh[tx] = m[0]
            ml_sh[threads + tx] = l_run[0]
            T.tvm_storage_sync("shared")
            m_new[0] = T.float32(NEG)
            for i in T.unroll(slots):
                m_new[0] = T.max(m_new[0], ml_sh[i * tpk])
            w[0] = T.exp2(m[0] - m_new[0])
            for j in T.unroll(dpt):
                o_sh[tx // tpk * d + j * tpk + tx % tpk] = acc[j] * w[0]
            l_run[0] = T.float32(0)
            for i in T.unroll(slots):
                l_run[0] = l_run[0] + ml_sh[threads + i * tpk] * T.exp2(ml_sh[i * tpk] - m_new[0])
            T.tvm_storage_sync("shared")
            s[0] = T.float32(0)  # dimension tx % d, the slots of lane tx // d
            for i in T.unroll(slots // lanes):
                s[0] = s[0] + o_sh[(i * lanes + tx // d) * d + tx % d]
            red[tx] = s[0]
            T.tvm_storage_sync("shared")
            s[0] = T.float32(0)
            for i in T.unroll(lanes):
                s[0] = s[0] + red[i * d + tx % d]
            if tx < d:
                if chunks == 1:  # the whole sequence: the final output (no merge launch)
                    output[b, hk, tx] = T.Cast(
                        dtype, T.if_then_else(l_run[0] > T.float32(0), s[0] / l_run[0], T.float32(0))
                    )
                    if tx == 0:
                        lse[b, hk] = T.if_then_else(
                            l_run[0] > T.float32(0), m_new[0] + T.log2(l_run[0]), T.float32(NEG)
                        )
                else:
                    part_o[((b * h_qo + hk) * chunks + c) * d + tx] = s[0]
                    if tx == 0:
                        part_ml[((b * h_qo + hk) * chunks + c) * 2] = m_new[0]
                        part_ml[((b * h_qo + hk) * chunks + c) * 2 + 1] = l_run[0]

    return paged_decode_func(
        h_qo, h_kv, d, page, dtype, (min_pages, single_pages, max_chunks), fused, partial, merge
    )
