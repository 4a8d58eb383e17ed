"""Decode attention split along the keys for WGSL (WebGPU/Vulkan), in place of TVM's.

TVM 0.27's ``batch_decode_paged_kv`` runs one workgroup per (sequence, KV head) that scans every
key serially: 2 workgroups for Qwen2.5-3B, 32 for Llama-2-7B, and the step time grows with the
context. :func:`split_decode_attention` keeps that PrimFunc's signature (TVM's paged KV cache
calls it by name) and gives it a new body, one of two variants (``LLMCHAT_WGSL_ATTENTION``:
``split-v2`` by default, ``split-v1`` for A/B comparisons, ``tvm`` keeps TVM's kernel). v2 runs a
KV head with one query head (Llama-2-7B) on :mod:`.wgsl_attention_keys`' kernel, keys in
parallel (:data:`DEFAULT_KEY_THREADS` threads a key; ``split-v2-key0`` keeps v2's own kernel there).

**split-v1** (:func:`decode_kernel`), two launches:

1. ``partial``: a grid of (chunks, query-head groups x sequences) workgroups. A workgroup takes
   ``heads`` query heads of one KV head (one thread per (head, dimension)) and one chunk of a
   sequence's keys, in tiles of ``tile`` keys staged as float32 in padded workgroup memory: the
   scores of a tile (each by ``head_dim / tile`` threads, partial sums added in workgroup
   memory), then an online softmax and the weighted values. It writes its unnormalized output
   with its running maximum and sum (log2 domain, as TVM's kernel) to a scratch workspace.
2. ``merge``: one workgroup per (query head, sequence) rescales and adds the chunks' partials,
   writes the output and the log-sum-exp (base 2, TVM's convention).

The chunk count comes from the page table's size (``nnz_pages``, known on the host): about
:data:`TARGET_WORKGROUPS` workgroups per sequence, chunks of at least one page.

Why v1 is slow at short contexts (H200 profile of Qwen2.5-0.5B at 3-67 keys: 33.85 us partial +
8.62 us merge per layer; an empty dispatch ~5 us): Qwen2.5-0.5B's group of 7 query heads is odd,
so ``heads`` is 1: 64 threads per workgroup, 14 workgroups per chunk that each load the same keys
and values again; the tile is 64 keys whatever the context, so at 3-67 keys (chunks of one page,
16 keys) each thread still loads 64 keys and 64 values (each behind its own page-table load,
clamped loads of the tile's padding included) and runs 64-step serial max and exp2 loops over
the padded tile, with 4 barriers per tile; and the merge is always a second dispatch.

**split-v2** (:func:`decode_kernel_v2`, default):

1. one workgroup per (chunk, KV head x sequence, head split) for up to
   :data:`DEFAULT_V2_HEADS` (4) query heads of the KV head (the group padded to a power of two
   and split over ``hsplit`` workgroups: 2 for both Qwen2.5 shapes' 8, 1 for Llama-2-7B's 1),
   ``min(256, heads x head_dim)`` threads: the staged keys and values serve all of the
   workgroup's query heads (v1 loaded them once per head group). Before session 14 one
   workgroup took all 8 heads: each thread then summed a whole 128-dim dot product per key,
   and the Qwen2.5-3B shape ran on 2 workgroups (H200: 361 -> 380 tok/s with the split);
2. a tile of 32 keys (16 for head_dim 128 in 32 KiB of workgroup memory, lavapipe's) holds K
   and V together: one thread per (head, key) score (several when heads x tile < 256, their
   sums added while reading the scores), then each thread keeps its head's tile scores in
   registers for the max and the exp2/weighted-value loop over its ``head_dim x heads / 256``
   output dimensions (2 or 4);
3. the next tile's keys and values are loaded into registers right after this tile is staged, so
   their global loads are in flight during this tile's scores and softmax (software pipelining);
4. chunks: one chunk (one launch, no merge: the partial writes the output and the lse) while the
   page table holds at most :data:`SINGLE_CHUNK_KEYS` keys' pages; beyond, chunks of at least one
   tile, at most ``TARGET_WORKGROUPS_V2 / (KV heads x hsplit)`` of them; the merge launch sits under a
   host-side ``if`` (the host knows ``nnz_pages``), and merges with ``256 / head_dim`` lanes per
   output dimension (one online pass each, then one barrier).

Barriers and serial steps per workgroup, counted from the kernels' structure (**not measured**;
Qwen2.5-0.5B, H200 profile, one sequence; "serial" = the longest dependent chain of one thread:
dot-product FMAs + max steps + exp2 steps, per-thread global loads separately):

- 64 keys. v1: 4 chunks x 14 groups = 56 WGs of 1 tile: 4 barriers, 128 loads/thread,
  64 + 64 + 64 = 192 serial, then the merge launch (4 chunks). v2: 1 chunk x 2 KV heads = 2 WGs
  of 2 tiles: 6 barriers, 48 loads/thread (16 a tile, the next tile's in flight, 16 past the
  end), 2 x (64 + 32 + 32) = 256 serial, no merge launch.
- 1,024 keys. v1: 16 chunks x 14 = 224 WGs of 4 pages (1 tile): 4 barriers, 128 loads, 192
  serial; merge over 16 chunks. v2: 32 chunks x 2 = 64 WGs of 2 pages (1 tile): 3 barriers, 32
  loads, 128 serial; merge: 32 chunks over 4 lanes = 8 steps and 1 barrier.
- 4,096 keys. v1: 18 x 14 = 252 WGs of 15 pages (4 tiles): 16 barriers, 512 loads, 768 serial;
  merge over 18 chunks. v2: 64 chunks x 2 = 128 WGs of 4 pages (2 tiles): 6 barriers, 48 loads,
  256 serial; merge: 16 steps and 1 barrier.

(Qwen2.5-3B, head_dim 128: v1 runs 8 head groups of 2 heads, 256 threads, tile 64: per tile 4
barriers, 64 + 64 loads/thread, 64 FMAs + 64 max + 64 exp2 serial, and 8 x 16 chunks of one page
at 64 keys; v2 runs 2 workgroups of 8 heads, tile 32: per tile 3 barriers, 16 + 16 loads/thread,
128 FMAs + 32 max + 32 exp2 serial, one launch up to 128 keys.) v2 does more serial work at 64
keys than v1 does for its one padded tile, but in one launch instead of two, with fewer loads
per thread (48 against 128) and the keys loaded once per KV head instead of once per query-head
group. Whether it is faster is for the H200 to tell: not measured.

Common to both: the scratch is a host-level ``global`` allocation (the device API's workspace
pool); kernels cannot allocate ``global`` memory on WebGPU. These kernels use no subgroup
operations (also on a ``-sgN`` profile): every reduction goes through workgroup memory, and no
workgroup-memory access sits under an ``if`` (TVM's barrier pass refuses that).

The keys in the cache must already carry the rotary embedding: the pass replaces the kernel only
in a module whose KV cache is created with ``RopeMode.NORMAL`` (llmchat's models; TVM's runtime
then passes ``rotary_mode`` 0 at decode). Shapes it does not handle (sliding window, head_dim
over the thread limit or not a power of two, dtypes other than float16/float32; for v1 also 16 KV
heads or more) keep TVM's kernel.

**Fused** (v2 built with ``fused``, :mod:`.wgsl_rope_append`): for one sequence the kernel also
does what TVM's split-rotary and append kernels did for the decoded token, which then launch
nothing: the add-on binds the recorded q/k/v projection in place of ``Q``; q and the new key get
RoPE (TVM's float32 arithmetic, rounded to half), the first workgroup of each KV head whose chunk
holds the last key writes the key and value to their page slot, and every workgroup that meets
the last key takes it from the projection instead of the page (no ordering between workgroups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from app.inference.pipelines.cuda_kernels import prim_func_pass
from app.inference.pipelines.cuda_rope_append import FUSED_ATTR, _rope_mode_normal
from app.inference.pipelines.tir_facts import static_int

#: the PrimFunc TVM's paged KV cache uses for decode attention (no sliding window)
DECODE_ATTENTION = "batch_decode_paged_kv"
#: workgroups the split aims at, over the query-head groups and chunks of one sequence
TARGET_WORKGROUPS = 256
#: the most keys a tile stages (workgroup memory: tile x (head_dim + 1) float32)
MAX_TILE = 64
#: TVM's "minus infinity" of the running maximum (log2 domain), kept for the same lse
NEG = -5e4
#: the kernel variants (``LLMCHAT_WGSL_ATTENTION``): v2 by default, v1 for A/B comparisons
VARIANTS = ("split-v2", "split-v1")
DEFAULT_VARIANT = "split-v2"
LOG2E = math.log2(math.e)
PARAMS = [
    "Q",
    "pages",
    "page_table_indptr",
    "page_table_values",
    "length_info",
    "k_rope_pos_offset",
    "q_rope_position",
    "output",
    "lse",
    "rotary_mode",
    "rope_scale",
    "rope_theta",
    "sm_scale",
]


@dataclass(frozen=True)
class SplitLayout:
    """How :func:`decode_kernel` splits the work: ``heads`` query heads per workgroup (one thread
    per head and dimension: ``threads`` = heads x head_dim), ``tile`` keys per step, chunks of at
    least ``min_pages`` pages and at most ``max_chunks`` per (sequence, head group)."""

    heads: int
    threads: int
    tile: int
    min_pages: int
    max_chunks: int


#: KV heads from which split-v1 keeps TVM's kernel (one workgroup per KV head): H200, NVIDIA's Vulkan
#: driver, Llama-2-7B shape (32 KV heads), 512-token replies: 155 tok/s with TVM's kernel, 123 with
#: v1 (its second dispatch per layer and one head per workgroup cost more than the split gains); the
#: Qwen2.5 shapes (2 KV heads) went 290 -> 408 (0.5B) and 110 -> 217 (3B) tok/s with it. v2 takes
#: these shapes too (``split-v2-tvmmany`` keeps TVM's kernel there, for A/B runs): 250.9 -> 264.6
#: tok/s on the 7B shape (benchmarks/results/h200-2026-12-03-s14/)
TVM_KERNEL_MIN_KV_HEADS = 16


def split_layout(
    h_qo: int, h_kv: int, d: int, page: int, max_threads: int, shared_bytes: int
) -> SplitLayout | None:
    """The layout for these shapes within the target's limits, or None (TVM's kernel stays)."""
    if h_qo % h_kv or d > max_threads or d & (d - 1) or d < 4:
        return None
    if h_kv >= TVM_KERNEL_MIN_KV_HEADS:  # enough workgroups already: TVM's kernel is faster there
        return None
    group = h_qo // h_kv
    heads = 1
    while group % (heads * 2) == 0 and heads * 2 * d <= max_threads and heads * 2 * d <= 256:
        heads *= 2
    threads = heads * d
    tile = min(d, MAX_TILE)
    while tile > heads and tile * (d + 1) * 4 + (heads * d + 2 * threads) * 4 > shared_bytes:
        tile //= 2
    if tile < heads or tile * (d + 1) * 4 + (heads * d + 2 * threads) * 4 > shared_bytes:
        return None
    min_pages = 1  # one page: more workgroups on short contexts, at half a tile's work
    max_chunks = max(1, TARGET_WORKGROUPS // (h_qo // heads))
    return SplitLayout(heads, threads, tile, min_pages, max_chunks)


def chunk_span(page: int) -> Any:
    """A TVMScript macro ``span(info, page_table_indptr, length_info, b, c, chunk_pages)`` that
    fills ``info[0:4]`` for sequence ``b`` and chunk ``c`` of the split kernels: the sequence's
    first page-table entry, its length in keys, the chunk's first key and its keys (0 past the
    sequence's end)."""
    from tvm.script import tirx as T

    @T.macro
    def span(info: Any, page_table_indptr: Any, length_info: Any, b: Any, c: Any, chunk_pages: Any) -> None:
        info[0] = page_table_indptr[b]
        info[1] = T.if_then_else(
            info[0] != page_table_indptr[b + 1],
            (page_table_indptr[b + 1] - info[0] - 1) * page + length_info[b],
            0,
        )  # sequence length
        info[2] = c * chunk_pages * page  # first key of the chunk
        info[3] = T.max(T.min(chunk_pages * page, info[1] - info[2]), 0)  # keys of the chunk

    return span


def decode_kernel(h_qo: int, h_kv: int, d: int, page: int, dtype: str, layout: SplitLayout) -> Any:
    """The split decode attention as a scheduled PrimFunc with ``batch_decode_paged_kv``'s
    parameters (no sliding window)."""
    from tvm.script import tirx as T

    group = h_qo // h_kv
    heads, threads, tile = layout.heads, layout.threads, layout.tile
    tpp = d // tile  # threads per (head, key) score
    pairs = heads * tile  # scores per tile
    loads = tile * d // threads  # elements of a K or V tile each thread stages
    row = d + 1  # padded row of a staged tile (no bank conflicts between keys)
    head_groups = h_qo // heads
    min_pages, max_chunks = layout.min_pages, layout.max_chunks
    span = chunk_span(page)

    # pylint: disable=too-many-locals
    @T.prim_func(private=True)
    def kernel(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, h_qo, d), dtype)
        pages = T.match_buffer(
            pages_handle, (max_num_pages, 2, h_kv, page, d), dtype, elem_offset=pages_elem_offset
        )
        page_table_indptr = T.match_buffer(
            page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_table_values = T.match_buffer(
            page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        k_rope_pos_offset = T.match_buffer(  # noqa: F841
            k_rope_pos_offset_handle,
            (B,),
            "int32",
            elem_offset=k_rope_pos_offset_elem_offset,
        )
        q_rope_position = T.match_buffer(  # noqa: F841
            q_rope_position_handle,
            (B,),
            "int32",
            elem_offset=q_rope_position_elem_offset,
        )
        output = T.match_buffer(output_handle, (B, h_qo, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_qo), "float32")
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)

        chunk_pages = T.meta_var(T.max(min_pages, T.ceildiv(nnz_pages, max_chunks)))
        chunks = T.meta_var(T.max(1, T.ceildiv(nnz_pages, chunk_pages)))
        part_o = T.decl_buffer((B * h_qo * chunks * d,), "float32", scope="global")
        part_ml = T.decl_buffer((B * h_qo * chunks * 2,), "float32", scope="global")

        with T.launch_thread("blockIdx.x", chunks) as c:
            by = T.launch_thread("blockIdx.y", head_groups * B)  # WebGPU: no blockIdx.z
            hg = T.meta_var(by % head_groups)
            b = T.meta_var(by // head_groups)
            hk = T.meta_var(hg * heads // group)  # the KV head of the workgroup's query heads
            tx = T.launch_thread("threadIdx.x", threads)
            q_sh = T.decl_buffer((threads,), "float32", scope="shared")
            kv_sh = T.decl_buffer((tile * row,), "float32", scope="shared")
            red = T.decl_buffer((threads,), "float32", scope="shared")
            s_sh = T.decl_buffer((threads,), "float32", scope="shared")
            info = T.decl_buffer((4,), "int32", scope="local")  # 1st page, length, chunk start, chunk keys
            m = T.decl_buffer((1,), "float32", scope="local")
            m_new = T.decl_buffer((1,), "float32", scope="local")
            l_run = T.decl_buffer((1,), "float32", scope="local")
            acc = T.decl_buffer((1,), "float32", scope="local")
            part = T.decl_buffer((1,), "float32", scope="local")
            p = T.decl_buffer((1,), "float32", scope="local")

            span(info, page_table_indptr, length_info, b, c, chunk_pages)
            q_sh[tx] = T.Cast("float32", Q[b, hg * heads + tx // d, tx % d]) * sm_scale * LOG2E
            m[0] = T.float32(NEG)
            l_run[0] = T.float32(0)
            acc[0] = T.float32(0)
            for t in range(T.ceildiv(info[3], tile)):
                T.tvm_storage_sync("shared")
                for i in T.unroll(loads):
                    key = T.meta_var((i * threads + tx) // d)  # of the tile
                    col = T.meta_var((i * threads + tx) % d)
                    pos = T.meta_var(T.max(T.min(info[2] + t * tile + key, info[1] - 1), 0))  # clamped
                    slot = T.meta_var(page_table_values[info[0] + pos // page])
                    kv_sh[key * row + col] = T.if_then_else(
                        t * tile + key < info[3],
                        T.Cast("float32", pages[slot, 0, hk, pos % page, col]),
                        T.float32(0),
                    )
                T.tvm_storage_sync("shared")
                part[0] = T.float32(0)
                for j in T.unroll(tile):
                    part[0] = (
                        part[0]
                        + q_sh[(tx // tpp) // tile * d + j * tpp + tx % tpp]
                        * kv_sh[(tx // tpp) % tile * row + j * tpp + tx % tpp]
                    )
                red[tx] = part[0]
                T.tvm_storage_sync("shared")
                part[0] = T.float32(0)
                for i in T.unroll(tpp):
                    part[0] = part[0] + red[tx % pairs * tpp + i]
                s_sh[tx] = part[0]
                for i in T.unroll(loads):
                    key = T.meta_var((i * threads + tx) // d)  # of the tile
                    col = T.meta_var((i * threads + tx) % d)
                    pos = T.meta_var(T.max(T.min(info[2] + t * tile + key, info[1] - 1), 0))  # clamped
                    slot = T.meta_var(page_table_values[info[0] + pos // page])
                    kv_sh[key * row + col] = T.if_then_else(
                        t * tile + key < info[3],
                        T.Cast("float32", pages[slot, 1, hk, pos % page, col]),
                        T.float32(0),
                    )
                T.tvm_storage_sync("shared")
                m_new[0] = m[0]
                for k in range(tile):
                    m_new[0] = T.max(
                        m_new[0],
                        T.if_then_else(t * tile + k < info[3], s_sh[tx // d * tile + k], T.float32(NEG)),
                    )
                p[0] = T.exp2(m[0] - m_new[0])
                l_run[0] = l_run[0] * p[0]
                acc[0] = acc[0] * p[0]
                for k in range(tile):
                    p[0] = T.if_then_else(
                        t * tile + k < info[3], T.exp2(s_sh[tx // d * tile + k] - m_new[0]), T.float32(0)
                    )
                    l_run[0] = l_run[0] + p[0]
                    acc[0] = acc[0] + p[0] * kv_sh[k * row + tx % d]
                m[0] = m_new[0]
            part_o[((b * h_qo + hg * heads + tx // d) * chunks + c) * d + tx % d] = acc[0]
            if tx % d == 0:
                part_ml[((b * h_qo + hg * heads + tx // d) * chunks + c) * 2] = m[0]
                part_ml[((b * h_qo + hg * heads + tx // d) * chunks + c) * 2 + 1] = l_run[0]

        with T.launch_thread("blockIdx.x", h_qo) as hq:
            b2 = T.launch_thread("blockIdx.y", B)
            tx2 = T.launch_thread("threadIdx.x", d)
            mm = T.decl_buffer((1,), "float32", scope="local")
            ll = T.decl_buffer((1,), "float32", scope="local")
            oo = T.decl_buffer((1,), "float32", scope="local")
            w = T.decl_buffer((1,), "float32", scope="local")
            mm[0] = T.float32(NEG)
            for ci in range(chunks):
                mm[0] = T.max(mm[0], part_ml[((b2 * h_qo + hq) * chunks + ci) * 2])
            ll[0] = T.float32(0)
            oo[0] = T.float32(0)
            for ci in range(chunks):
                w[0] = T.exp2(part_ml[((b2 * h_qo + hq) * chunks + ci) * 2] - mm[0])
                ll[0] = ll[0] + part_ml[((b2 * h_qo + hq) * chunks + ci) * 2 + 1] * w[0]
                oo[0] = oo[0] + part_o[((b2 * h_qo + hq) * chunks + ci) * d + tx2] * w[0]
            output[b2, hq, tx2] = T.Cast(
                dtype, T.if_then_else(ll[0] > T.float32(0), oo[0] / ll[0], T.float32(0))
            )
            if tx2 == 0:
                lse[b2, hq] = T.if_then_else(ll[0] > T.float32(0), mm[0] + T.log2(ll[0]), T.float32(NEG))

    return kernel


#: keys of the sequence up to which v2 runs one chunk per (sequence, KV head) and no merge launch
SINGLE_CHUNK_KEYS = 128
#: v2: workgroups aimed at over the chunks and KV heads of one sequence at long contexts
TARGET_WORKGROUPS_V2 = 128
#: v2: the most query heads of a workgroup (0: all of its KV head's; ``split-v2-headsN`` for A/B).
#: H200, NVIDIA's Vulkan driver, bench protocol (decode tok/s, Qwen2.5-0.5B / 3B): all (8) 799.3 /
#: 360.3 and 761.9 / 361.8 (first and last set of the run), 4 heads 808.3 / 379.9, 2 heads 794.8 /
#: 379.7, 1 head 752.9 / 367.5 (benchmarks/results/h200-2026-12-03-s14/)
DEFAULT_V2_HEADS = 4
#: v2: the most keys of a tile (K and V staged as float32: 2 x tile x (head_dim + 1) x 4 bytes)
MAX_TILE_V2 = 32
#: threads a key of :mod:`.wgsl_attention_keys`' kernel, v2's for a KV head with one query head
#: (``split-v2-keyN`` for A/B, ``key0``: v2's own kernel). H200, NVIDIA's Vulkan driver, bench
#: protocol, Llama-2-7B decode tok/s: v2's kernel 300.2 / 300.0 (first and last set of the run),
#: 4 threads 337.1, 8 threads 371.8 / 370.2, 16 threads 378.8; the attention launch at 3-67 keys
#: 30.2 us -> 18.8 us (8 threads; benchmarks/results/h200-2026-12-04-s20/)
DEFAULT_KEY_THREADS = 16


@dataclass(frozen=True)
class KVHeadLayout:
    """How :func:`decode_kernel_v2` splits the work: one workgroup per (chunk, KV head, sequence)
    for all ``group`` query heads of the KV head (padded to ``heads``, a power of two) with
    ``threads`` threads, ``tile`` keys per step, chunks of at least ``min_pages`` pages (one chunk
    up to ``single_pages`` pages) and at most ``max_chunks`` of them. ``hsplit`` > 1: the padded
    group is split over that many workgroups of ``heads`` query heads each (same keys, fewer
    products per thread)."""

    group: int
    heads: int
    threads: int
    tile: int
    min_pages: int
    single_pages: int
    max_chunks: int
    hsplit: int = 1


def _v2_shared_bytes(heads: int, d: int, threads: int, tile: int) -> int:
    return (2 * tile * (d + 1) + heads * d + threads) * 4


@dataclass(frozen=True)
class V2Options:
    """The A/B options of a ``split-v2[-singleN][-tvmmany][-headsN][-wgN][-keyN]`` variant name (the
    defaults are the product's): ``singleN`` runs one chunk up to N keys (default
    :data:`SINGLE_CHUNK_KEYS`); ``tvmmany`` keeps TVM's kernel for :data:`TVM_KERNEL_MIN_KV_HEADS`
    KV heads or more (``all``, the old switch that took them, is the default now); ``headsN``
    gives each workgroup at most N query heads (a power of two, 0 for all of its KV head's;
    default :data:`DEFAULT_V2_HEADS`); ``wgN`` aims at N workgroups per sequence at long contexts
    (default 0: :data:`TARGET_WORKGROUPS_V2` for v2's kernel,
    :data:`.wgsl_attention_keys.TARGET_WORKGROUPS_KEYS` for the key-parallel one); ``keyN`` (a
    power of two) runs a KV head with one query head on :mod:`.wgsl_attention_keys`' kernel, N
    threads a key (default :data:`DEFAULT_KEY_THREADS`; ``key0``: v2's own kernel there)."""

    single_keys: int = SINGLE_CHUNK_KEYS
    every_kv_head_count: bool = True
    max_heads: int = DEFAULT_V2_HEADS
    target_workgroups: int = 0
    key_threads: int = DEFAULT_KEY_THREADS


def v2_options(variant: str) -> V2Options:
    """:class:`V2Options` of a ``split-v2...`` variant name; ValueError names an unknown option."""
    opts: dict[str, Any] = {}
    for opt in variant.split("-")[2:]:
        num = opt.lstrip("abcdefghijklmnopqrstuvwxyz")
        word = opt[: len(opt) - len(num)]
        if word == "single" and num.isdigit():
            opts["single_keys"] = int(num)
        elif opt == "all":
            opts["every_kv_head_count"] = True
        elif opt == "tvmmany":
            opts["every_kv_head_count"] = False
        elif word == "heads" and num.isdigit() and not int(num) & (int(num) - 1):
            opts["max_heads"] = int(num)
        elif word == "wg" and num.isdigit() and int(num) > 0:
            opts["target_workgroups"] = int(num)
        elif word == "key" and num.isdigit() and not int(num) & (int(num) - 1):
            opts["key_threads"] = int(num)
        else:
            raise ValueError(f"{variant!r}: unknown option {opt!r} of split-v2")
    return V2Options(**opts)


def kv_head_layout(
    h_qo: int,
    h_kv: int,
    d: int,
    page: int,
    max_threads: int,
    shared_bytes: int,
    options: V2Options | None = None,
) -> KVHeadLayout | None:
    """The v2 layout for these shapes within the target's limits (``options``: the product's
    defaults unless given), or None (TVM's kernel stays)."""
    o = options or V2Options()
    single_keys, every_kv_head_count, max_heads = o.single_keys, o.every_kv_head_count, o.max_heads
    if h_qo % h_kv or d > max_threads or d & (d - 1) or d < 4:
        return None
    if h_kv >= TVM_KERNEL_MIN_KV_HEADS and not every_kv_head_count:  # A/B: TVM's kernel there
        return None
    group = h_qo // h_kv
    padded = 1 << (group - 1).bit_length()
    heads = min(padded, max_heads) if max_heads > 0 else padded
    hsplit = padded // heads
    threads = min(max_threads, 256, heads * d)
    if threads < heads:
        return None
    tile = min(MAX_TILE_V2, threads // heads)
    while tile > 1 and _v2_shared_bytes(heads, d, threads, tile) > shared_bytes:
        tile //= 2
    if _v2_shared_bytes(heads, d, threads, tile) > shared_bytes or tile * d < threads:
        return None
    min_pages = max(1, -(-tile // page))  # a chunk of at least one tile
    single_pages = max(1, single_keys // page) if single_keys > 0 else 0
    max_chunks = max(1, (o.target_workgroups or TARGET_WORKGROUPS_V2) // (h_kv * hsplit))
    return KVHeadLayout(group, heads, threads, tile, min_pages, single_pages, max_chunks, hsplit)


#: the add-on's packed function of the fused RoPE and append (:mod:`.wgsl_rope_append`): the
#: next launch's buffer argument N becomes the recorded q/k/v projection
SUBSTITUTE_NEXT = "llmchat.webgpu.substitute_next"


def _rope(T: Any, qkv: Any, h: Any, c: Any, d: int, pos: Any, scale: Any, theta: Any, dtype: str) -> Any:
    """Head ``h``, dimension ``c`` of the one token's fused q/k/v projection ``qkv`` with RoPE at
    position ``pos``: TVM's ``llama_rope_with_position_map`` arithmetic (float32, the partner
    dimension negated in the first half, rounded to ``dtype``), theta and scale as parameters."""
    freq = T.Cast("float32", pos) * scale / T.pow(theta, T.Cast("float32", c * 2 % d) / T.float32(d))
    partner = T.Cast("float32", qkv[0, h, (c + d // 2) % d]) * T.if_then_else(
        c < d // 2, T.float32(-1), T.float32(1)
    )
    return T.Cast(dtype, T.cos(freq) * T.Cast("float32", qkv[0, h, c]) + T.sin(freq) * partner)


def _q_value(
    T: Any,
    Q: Any,
    b: Any,
    h: Any,
    c: Any,
    fused: bool,
    B: Any,
    d: int,
    pos: Any,
    scale: Any,
    theta: Any,
    dtype: str,
) -> Any:
    """Query head ``h``, dimension ``c``: ``Q``'s, or with ``fused`` and one sequence the recorded
    projection's with RoPE (:func:`_rope`)."""
    if not fused:
        return Q[b, h, c]
    return T.if_then_else(B == 1, _rope(T, Q, h, c, d, pos[0], scale, theta, dtype), Q[b, h, c])


def _staged(T: Any, loaded: Any, new: Any, is_new: Any) -> Any:
    """What a thread stages for one key element: the loaded one as float32, or (``is_new``, the
    fused kernel's last key) the new token's."""
    if is_new is False:
        return T.Cast("float32", loaded)
    return T.if_then_else(is_new, new, T.Cast("float32", loaded))


def new_token_kv(h_qo: int, h_kv: int, d: int, dtype: str) -> Any:
    """A TVMScript macro ``token_kv(new_kv, Q, B, hk, col, q_rope_position, rope_scale,
    rope_theta)`` for the fused kernels: ``new_kv[0:2]`` = dimension ``col`` of KV head ``hk``'s
    new key (with RoPE) and value, read from the recorded q/k/v projection bound as ``Q`` (with
    more than one sequence ``Q`` is the real q and head 0 is read instead, unused)."""
    from tvm.script import tirx as T

    @T.macro
    def token_kv(
        new_kv: Any,
        Q: Any,
        B: Any,
        hk: Any,
        col: Any,
        q_rope_position: Any,
        rope_scale: Any,
        rope_theta: Any,
    ) -> None:
        new_kv[0] = T.Cast(
            "float32",
            _rope(
                T,
                Q,
                T.if_then_else(B == 1, h_qo + hk, 0),
                col,
                d,
                q_rope_position[0],
                rope_scale,
                rope_theta,
                dtype,
            ),
        )
        new_kv[1] = T.Cast("float32", Q[0, T.if_then_else(B == 1, h_qo + h_kv + hk, 0), col])

    return token_kv


def merge_chunks(h_qo: int, d: int, lanes: int, dtype: str) -> Any:
    """The merge launch of the split kernels as a TVMScript macro ``merge(chunks, part_o, part_ml,
    output, lse, B)``: one workgroup per (query head, sequence) of ``lanes x d`` threads, each
    lane an online pass over its chunks' partials (``part_o``: unnormalized outputs, ``part_ml``:
    running maximum and sum, log2 domain), then one barrier to combine the lanes; writes the
    output and the base-2 log-sum-exp."""
    from tvm.script import tirx as T

    @T.macro
    def merge(chunks: Any, part_o: Any, part_ml: Any, output: Any, lse: Any, B: Any) -> None:
        with T.launch_thread("blockIdx.x", h_qo) as hq:
            b2 = T.launch_thread("blockIdx.y", B)
            tx2 = T.launch_thread("threadIdx.x", lanes * d)
            o_sh = T.decl_buffer((lanes * d,), "float32", scope="shared")
            m_sh = T.decl_buffer((lanes * d,), "float32", scope="shared")
            l_sh = T.decl_buffer((lanes * d,), "float32", scope="shared")
            mm = T.decl_buffer((1,), "float32", scope="local")
            mi = T.decl_buffer((1,), "float32", scope="local")
            mx = T.decl_buffer((1,), "float32", scope="local")
            ll = T.decl_buffer((1,), "float32", scope="local")
            oo = T.decl_buffer((1,), "float32", scope="local")
            w = T.decl_buffer((1,), "float32", scope="local")
            w2 = T.decl_buffer((1,), "float32", scope="local")
            mm[0] = T.float32(NEG)
            ll[0] = T.float32(0)
            oo[0] = T.float32(0)
            for ci in range(T.ceildiv(chunks, lanes)):  # this lane's chunks, one pass
                idx = T.meta_var(T.min(ci * lanes + tx2 // d, chunks - 1))
                live = T.meta_var(ci * lanes + tx2 // d < chunks)
                base = T.meta_var((b2 * h_qo + hq) * chunks + idx)
                mi[0] = T.if_then_else(live, part_ml[base * 2], T.float32(NEG))
                mx[0] = T.max(mm[0], mi[0])
                w[0] = T.exp2(mm[0] - mx[0])
                w2[0] = T.if_then_else(live, T.exp2(mi[0] - mx[0]), T.float32(0))
                ll[0] = ll[0] * w[0] + part_ml[base * 2 + 1] * w2[0]
                oo[0] = oo[0] * w[0] + part_o[base * d + tx2 % d] * w2[0]
                mm[0] = mx[0]
            o_sh[tx2] = oo[0]
            m_sh[tx2] = mm[0]
            l_sh[tx2] = ll[0]
            T.tvm_storage_sync("shared")
            mx[0] = T.float32(NEG)
            for i in T.unroll(lanes):
                mx[0] = T.max(mx[0], m_sh[i * d + tx2 % d])
            ll[0] = T.float32(0)
            oo[0] = T.float32(0)
            for i in T.unroll(lanes):
                w[0] = T.exp2(m_sh[i * d + tx2 % d] - mx[0])
                ll[0] = ll[0] + l_sh[i * d + tx2 % d] * w[0]
                oo[0] = oo[0] + o_sh[i * d + tx2 % d] * w[0]
            if tx2 < d:
                output[b2, hq, tx2] = T.Cast(
                    dtype, T.if_then_else(ll[0] > T.float32(0), oo[0] / ll[0], T.float32(0))
                )
            if tx2 == 0:
                lse[b2, hq] = T.if_then_else(ll[0] > T.float32(0), mx[0] + T.log2(ll[0]), T.float32(NEG))

    return merge


def paged_decode_func(
    h_qo: int,
    h_kv: int,
    d: int,
    page: int,
    dtype: str,
    chunking: tuple[int, int, int],
    fused: bool,
    partial: Any,
    merge: Any,
) -> Any:
    """A split decode attention as a PrimFunc with ``batch_decode_paged_kv``'s signature (TVM's
    paged KV cache calls it by that name), shared by :func:`decode_kernel_v2` and
    :func:`.wgsl_attention_keys.decode_kernel_keys`: the buffers, the chunks (``chunking``:
    ``(min_pages, single_pages, max_chunks)``; one chunk while the page table holds at most
    ``single_pages`` pages, else chunks of at least ``min_pages``, at most ``max_chunks``), the
    partials' workspace, the recorded q/k/v bound as ``Q`` when ``fused`` and one sequence, then
    the kernel's ``partial`` launch (a TVMScript macro taking ``B, chunks, chunk_pages, Q, pages,
    page_table_indptr, page_table_values, length_info, q_rope_position, output, lse, part_o,
    part_ml, rope_scale, rope_theta, sm_scale``) and, past one chunk, ``merge``
    (:func:`merge_chunks`) under a host-side ``if``."""
    from tvm.script import tirx as T

    min_pages, single_pages, max_chunks = chunking

    # pylint: disable=too-many-locals
    @T.prim_func(private=True)
    def kernel(
        Q_handle: T.handle,
        pages_handle: T.handle,
        page_table_indptr_handle: T.handle,
        page_table_values_handle: T.handle,
        var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle,
        q_rope_position_handle: T.handle,
        output_handle: T.handle,
        lse_handle: T.handle,
        rotary_mode: T.int32,
        rope_scale: T.float32,
        rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        B = T.int32()
        nnz_pages = T.int32()
        max_num_pages = T.int32()
        pages_elem_offset = T.int64()
        page_indptr_elem_offset = T.int32()
        page_values_elem_offset = T.int32()
        k_rope_pos_offset_elem_offset = T.int32()
        q_rope_position_elem_offset = T.int32()
        length_info_elem_offset = T.int32()
        Q = T.match_buffer(Q_handle, (B, h_qo, d), dtype)
        pages = T.match_buffer(
            pages_handle, (max_num_pages, 2, h_kv, page, d), dtype, elem_offset=pages_elem_offset
        )
        page_table_indptr = T.match_buffer(
            page_table_indptr_handle, (B + 1,), "int32", elem_offset=page_indptr_elem_offset
        )
        page_table_values = T.match_buffer(
            page_table_values_handle, (nnz_pages,), "int32", elem_offset=page_values_elem_offset
        )
        k_rope_pos_offset = T.match_buffer(  # noqa: F841
            k_rope_pos_offset_handle,
            (B,),
            "int32",
            elem_offset=k_rope_pos_offset_elem_offset,
        )
        q_rope_position = T.match_buffer(
            q_rope_position_handle,
            (B,),
            "int32",
            elem_offset=q_rope_position_elem_offset,
        )
        output = T.match_buffer(output_handle, (B, h_qo, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_qo), "float32")
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_info_elem_offset)

        split_pages = T.meta_var(T.max(min_pages, T.ceildiv(nnz_pages, max_chunks)))
        chunk_pages = T.meta_var(T.if_then_else(nnz_pages <= single_pages, T.max(nnz_pages, 1), split_pages))
        chunks = T.meta_var(T.max(1, T.ceildiv(nnz_pages, chunk_pages)))
        part_o = T.decl_buffer((B * h_qo * chunks * d,), "float32", scope="global")
        part_ml = T.decl_buffer((B * h_qo * chunks * 2,), "float32", scope="global")

        if fused:  # noqa: SIM102 (a Python condition around a TIR one)
            if B == 1:  # the partial launch below reads the recorded q/k/v projection as Q
                T.evaluate(T.call_packed(SUBSTITUTE_NEXT, Q, 0))

        partial(
            B,
            chunks,
            chunk_pages,
            Q,
            pages,
            page_table_indptr,
            page_table_values,
            length_info,
            q_rope_position,
            output,
            lse,
            part_o,
            part_ml,
            rope_scale,
            rope_theta,
            sm_scale,
        )
        if chunks > 1:  # on the host: one chunk wrote the output already
            merge(chunks, part_o, part_ml, output, lse, B)

    return kernel


def decode_kernel_v2(
    h_qo: int, h_kv: int, d: int, page: int, dtype: str, layout: KVHeadLayout, fused: bool = False
) -> Any:
    """The v2 decode attention (module docstring) as a scheduled PrimFunc with
    ``batch_decode_paged_kv``'s parameters (no sliding window). ``fused``: for one sequence
    (``B == 1``, a decoded token) the kernel reads the token's q, k and v from the recorded q/k/v
    projection (the add-on binds it in place of ``Q``, :mod:`.wgsl_rope_append`), applies RoPE
    itself and writes the new key and value to their page slot; more sequences read ``Q`` and
    the pages as TVM's split-rotary and append left them."""
    from tvm.script import tirx as T

    group, heads, threads, tile, hsplit = (
        layout.group,
        layout.heads,
        layout.threads,
        layout.tile,
        layout.hsplit,
    )
    pairs = heads * tile  # scores of a tile (padded heads included)
    tpp = threads // pairs  # threads per score
    dpp = d // tpp  # products each of them adds
    tph = threads // heads  # threads per query head in the softmax and weighted values
    outs = d // tph  # output dimensions of a thread
    loads = tile * d // threads  # elements of a K (and a V) tile each thread loads
    row = d + 1  # padded row of a staged tile (no bank conflicts between keys)
    min_pages, single_pages, max_chunks = layout.min_pages, layout.single_pages, layout.max_chunks
    lanes = max(1, min(256, threads) // d)  # merge: threads per output dimension
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
            by = T.launch_thread("blockIdx.y", h_kv * hsplit * B)  # WebGPU: no blockIdx.z
            hk = T.meta_var(by // hsplit % h_kv)
            b = T.meta_var(by // (h_kv * hsplit))
            hb = T.meta_var(by % hsplit * heads)  # the workgroup's first query head of the group
            tx = T.launch_thread("threadIdx.x", threads)
            q_sh = T.decl_buffer((heads * d,), "float32", scope="shared")
            k_sh = T.decl_buffer((tile * row,), "float32", scope="shared")
            v_sh = T.decl_buffer((tile * row,), "float32", scope="shared")
            red = T.decl_buffer((threads,), "float32", scope="shared")
            # fused: the new token's key (with RoPE) and value at this thread's dimension
            new_kv = T.decl_buffer((2,), "float32", scope="local")
            info = T.decl_buffer((4,), "int32", scope="local")  # 1st page, length, chunk start, chunk keys
            kr = T.decl_buffer((loads,), dtype, scope="local")  # the next tile's keys and values
            vr = T.decl_buffer((loads,), dtype, scope="local")
            s_loc = T.decl_buffer((tile,), "float32", scope="local")
            acc = T.decl_buffer((outs,), "float32", scope="local")
            m = T.decl_buffer((1,), "float32", scope="local")
            m_new = T.decl_buffer((1,), "float32", scope="local")
            l_run = T.decl_buffer((1,), "float32", scope="local")
            part = T.decl_buffer((1,), "float32", scope="local")
            p = T.decl_buffer((1,), "float32", scope="local")

            span(info, page_table_indptr, length_info, b, c, chunk_pages)
            for i in T.unroll(heads * d // threads):
                hq = T.meta_var(hb + (i * threads + tx) // d)  # of the KV head's query heads (padded)
                q_sh[i * threads + tx] = T.if_then_else(
                    hq < group,
                    T.Cast(
                        "float32",
                        _q_value(
                            T,
                            Q,
                            b,
                            hk * group + T.min(hq, group - 1),
                            (i * threads + tx) % d,
                            fused,
                            B,
                            d,
                            q_rope_position,
                            rope_scale,
                            rope_theta,
                            dtype,
                        ),
                    )
                    * sm_scale
                    * LOG2E,
                    T.float32(0),
                )
            m[0] = T.float32(NEG)
            l_run[0] = T.float32(0)
            for j in T.unroll(outs):
                acc[j] = T.float32(0)
            if fused:
                # a thread stages dimension tx % head_dim of every key (threads: a multiple of it);
                # with more than one sequence Q is the real q and head 0 is read instead (unused)
                token_kv(new_kv, Q, B, hk, tx % d, q_rope_position, rope_scale, rope_theta)
                # the new token's key and value into their page slot: threads tx < head_dim of the
                # first workgroup of the KV head whose chunk holds the last key
                if B == 1 and by % hsplit == 0 and c == (info[1] - 1) // (chunk_pages * page) and tx < d:
                    for kv in T.unroll(2):
                        pages[
                            page_table_values[info[0] + (info[1] - 1) // page],
                            kv,
                            hk,
                            (info[1] - 1) % page,
                            tx,
                        ] = T.Cast(dtype, new_kv[kv])
            for i in T.unroll(loads):  # tile 0 into registers
                key = T.meta_var((i * threads + tx) // d)
                col = T.meta_var((i * threads + tx) % d)
                pos = T.meta_var(T.max(T.min(info[2] + key, info[1] - 1), 0))  # clamped
                slot = T.meta_var(page_table_values[info[0] + pos // page])
                kr[i] = pages[slot, 0, hk, pos % page, col]
                vr[i] = pages[slot, 1, hk, pos % page, col]
            for t in range(T.ceildiv(info[3], tile)):
                T.tvm_storage_sync("shared")  # the previous tile's readers are done
                for i in T.unroll(loads):
                    key = T.meta_var((i * threads + tx) // d)
                    col = T.meta_var((i * threads + tx) % d)
                    valid = T.meta_var(t * tile + key < info[3])
                    # fused, one sequence: the last key is the new token's, from the projection (the
                    # page loads stay unconditional: TVM's WGSL puts a branch around a load in a
                    # select, and 32 such loads a thread cost the Llama-2-7B shape 17 % on the H200)
                    new = T.meta_var(fused and T.And(B == 1, info[2] + t * tile + key == info[1] - 1))
                    k_sh[key * row + col] = T.if_then_else(
                        valid, _staged(T, kr[i], new_kv[0], new), T.float32(0)
                    )
                    v_sh[key * row + col] = T.if_then_else(
                        valid, _staged(T, vr[i], new_kv[1], new), T.float32(0)
                    )
                T.tvm_storage_sync("shared")
                for i in T.unroll(loads):  # the next tile's loads, in flight during this tile's work
                    key = T.meta_var((i * threads + tx) // d)
                    col = T.meta_var((i * threads + tx) % d)
                    pos = T.meta_var(T.max(T.min(info[2] + (t + 1) * tile + key, info[1] - 1), 0))
                    slot = T.meta_var(page_table_values[info[0] + pos // page])
                    kr[i] = pages[slot, 0, hk, pos % page, col]
                    vr[i] = pages[slot, 1, hk, pos % page, col]
                part[0] = T.float32(0)
                for j in T.unroll(dpp):  # score (head, key) of this thread: dpp of its products
                    part[0] = (
                        part[0]
                        + q_sh[(tx // tpp) // tile * d + j * tpp + tx % tpp]
                        * k_sh[(tx // tpp) % tile * row + j * tpp + tx % tpp]
                    )
                red[tx] = part[0]
                T.tvm_storage_sync("shared")
                m_new[0] = m[0]
                for k in T.unroll(tile):  # the tile's scores of this thread's query head
                    part[0] = T.float32(0)
                    for i in T.unroll(tpp):
                        part[0] = part[0] + red[((tx // tph) * tile + k) * tpp + i]
                    s_loc[k] = T.if_then_else(t * tile + k < info[3], part[0], T.float32(NEG))
                    m_new[0] = T.max(m_new[0], s_loc[k])
                p[0] = T.exp2(m[0] - m_new[0])
                l_run[0] = l_run[0] * p[0]
                for j in T.unroll(outs):
                    acc[j] = acc[j] * p[0]
                for k in T.unroll(tile):
                    p[0] = T.if_then_else(t * tile + k < info[3], T.exp2(s_loc[k] - m_new[0]), T.float32(0))
                    l_run[0] = l_run[0] + p[0]
                    for j in T.unroll(outs):
                        acc[j] = acc[j] + p[0] * v_sh[k * row + j * tph + tx % tph]
                m[0] = m_new[0]
            hq2 = T.meta_var(hb + tx // tph)  # this thread's query head (of the KV head's, padded)
            if hq2 < group:
                if chunks == 1:  # the whole sequence: the final output (no merge launch)
                    for j in T.unroll(outs):
                        output[b, hk * group + hq2, j * tph + tx % tph] = T.Cast(
                            dtype, T.if_then_else(l_run[0] > T.float32(0), acc[j] / l_run[0], T.float32(0))
                        )
                    if tx % tph == 0:
                        lse[b, hk * group + hq2] = T.if_then_else(
                            l_run[0] > T.float32(0), m[0] + T.log2(l_run[0]), T.float32(NEG)
                        )
                else:
                    for j in T.unroll(outs):
                        part_o[((b * h_qo + hk * group + hq2) * chunks + c) * d + j * tph + tx % tph] = acc[j]
                    if tx % tph == 0:
                        part_ml[((b * h_qo + hk * group + hq2) * chunks + c) * 2] = m[0]
                        part_ml[((b * h_qo + hk * group + hq2) * chunks + c) * 2 + 1] = l_run[0]

    return paged_decode_func(
        h_qo, h_kv, d, page, dtype, (min_pages, single_pages, max_chunks), fused, partial, merge
    )


def split_decode_attention(
    func: Any, max_threads: int, shared_bytes: int, variant: str = DEFAULT_VARIANT
) -> Any | None:
    """``func`` (TVM's ``batch_decode_paged_kv``) with the split kernels as its body, or None when
    its shapes are not the ones handled. The new body ignores ``rotary_mode`` (keys and query must
    carry RoPE already: :func:`split_decode_attention_pass` checks the module's KV cache)."""
    if [str(p) for p in func.params] != PARAMS:
        return None
    q, pages, _indptr, _values, length_info = func.params[:5]
    dtype = str(q.dtype)
    if (
        dtype not in ("float16", "float32")
        or str(pages.dtype) != dtype
        or len(pages.shape) != 5
        or len(q.shape) != 3
        or len(length_info.shape) != 1
    ):
        return None
    h_qo, d = static_int(q.shape[1]), static_int(q.shape[2])
    h_kv, page = static_int(pages.shape[2]), static_int(pages.shape[3])
    if None in (h_qo, d, h_kv, page):
        return None
    fused = bool(func.attrs is not None and func.attrs.get(FUSED_ATTR, False))
    if variant == "split-v1":
        layout = None if fused else split_layout(h_qo, h_kv, d, page, max_threads, shared_bytes)
        new = None if layout is None else decode_kernel(h_qo, h_kv, d, page, dtype, layout)
    else:
        options = v2_options(variant)
        from app.inference.pipelines import wgsl_attention_keys as keys

        key_layout = keys.key_layout(h_qo, h_kv, d, page, max_threads, shared_bytes, options)
        if key_layout is not None:  # one query head a KV head: keys in parallel
            return _with_attrs(keys.decode_kernel_keys(h_qo, h_kv, d, page, dtype, key_layout, fused), func)
        layout2 = kv_head_layout(h_qo, h_kv, d, page, max_threads, shared_bytes, options)
        if layout2 is not None and fused and (layout2.threads < d or layout2.threads % d):
            layout2 = None  # the fused kernel: thread t stages dimension t % head_dim of every key
        new = None if layout2 is None else decode_kernel_v2(h_qo, h_kv, d, page, dtype, layout2, fused)
    return None if new is None else _with_attrs(new, func)


def _with_attrs(new: Any, func: Any) -> Any:
    """``new`` with ``func``'s attributes (its global symbol, the fused mark) but its own
    scheduling ones."""
    for key, value in (func.attrs or {}).items():
        if key not in ("tirx.is_scheduled", "tirx.noalias"):
            new = new.with_attr(key, value)
    return new


def split_decode_attention_pass(max_threads: int, shared_bytes: int, variant: str = DEFAULT_VARIANT) -> Any:
    """Module pass: :func:`split_decode_attention` on TVM's decode attention PrimFunc, in a
    module whose KV cache is created with ``RopeMode.NORMAL`` (else TVM's kernel stays: it
    applies RoPE itself when ``rotary_mode`` is 1)."""
    import tvm

    def rewrite(func: Any) -> Any | None:
        if func.attrs is None or str(func.attrs.get("global_symbol", "")) != DECODE_ATTENTION:
            return None
        return split_decode_attention(func, max_threads, shared_bytes, variant)

    replace = prim_func_pass("llmchat_wgsl_split_decode_attention_funcs", rewrite)

    @tvm.transform.module_pass(opt_level=0, name="llmchat_wgsl_split_decode_attention")
    def _pass(mod: Any, _ctx: Any) -> Any:
        return replace(mod) if _rope_mode_normal(mod) else mod

    return _pass
