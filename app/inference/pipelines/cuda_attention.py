"""Attention kernels of TVM's paged KV cache, replaced on CUDA by llmchat's.

Decode: split along the sequence (``llmchat::decode_attention``).

TVM 0.27's ``batch_decode_paged_kv`` kernel runs one thread block per KV head: 32 blocks for
Llama-2-7B and 2 for Qwen2.5 on a GPU with 132 multiprocessors, and its time grows with the
context. :func:`split_decode_attention_pass` keeps that PrimFunc's signature and puts in front of
its body by a launch of llmchat's kernel on (chunks x head groups x sequences) blocks; from sm_90
on the chunks of a query head form a thread-block cluster and merge through distributed shared
memory (before that, through a static scratch area: a batch too large for it runs unsplit). The
kernel expects the rotary embedding applied before the cache (llmchat's models use
``RopeMode.NORMAL``; anything else stops with a CUDA error instead of a wrong answer).

Decode at depth for GQA-4 models (Llama-3-8B: 32 query heads, 8 kv heads, head dim 128). The
cluster kernel's blocks each take one query head, so every key is read through L2 once per query
head: four times per kv head. Blocks of the 4 query heads sharing a kv head (8 warps, 32 chunks
for 8 kv heads: 256 blocks, merged through the global scratch area) read each key once. H200,
random weights, q4f16_1, ``gpu_decode.py depth``, best of 2, tok/s, session 9 (throwaway patch,
benchmarks/results/h200-2026-12-02-8b-depth-gqa/): after 0 / 4,096 / 8,192 tokens, one head per
block in clusters 544.2 / 418.4 / 334.1 and 529.0 / 406.0 / 330.9; 4 heads per block 504.2 / 426.6
/ 376.9 and 486.3 / 428.2 / 375.5 (+13 % after 8,192, +2-5 % after 4,096, -7-8 % at 0); with fewer
chunks for short sequences (at least 32 or 128 keys each) still 462.5 or 437.8 against 500.9 after
1,024 tokens. So on sm_90, for ``h_qo // h_kv == 4`` only, the PrimFunc's host code picks the
kernel by the sequence's keys (``page_table_values`` holds every page of the batch: pages x page
size >= the threshold x sequences, and the batch's states fit the scratch area): a long-context
kernel from :data:`GQA_MIN_KEYS` (3,072) keys (between the measured 1,024, where one head per block
wins, and 4,096), else the cluster kernel.

Since session 12 the long-context kernel is ``llmchat::decode_attention_mma`` wherever it applies
(2 to 8 query heads per kv head, head dim 128, :func:`long_context_kernel`): the query heads of a
kv head as the rows of tensor-core MMAs, each key read once per kv head, blocks of 8 warps
(session 17: 128 blocks per sequence, :func:`mma_chunks`; the thresholds :data:`MMA_MIN_KEYS`
and :data:`MMA_MIN_KEYS_FEW_KV`, measured again after its merge was made one trip to L2).
Alone (benchmarks/kernels/gqa_decode_check.cu, H200, us per layer in a 32-layer CUDA graph;
benchmarks/results/h200-2026-12-02-s12/gqa), Llama-3-8B after 4,096 / 8,192 keys: 13.60 / 17.63
against 16.69 / 24.32 for the 4-head blocks and 18.19 / 32.39 for the cluster kernel (1,024 keys:
10.35 against the cluster kernel's 7.50, hence the threshold). With fewer kv heads it wins later
(fewer blocks): from :data:`MMA_MIN_KEYS_FEW_KV` keys. Qwen2.5-7B (7 heads, padded to 8) after
8,192 keys 18.04 against 27.05, Qwen2.5-3B 17.65 against 24.89. The 4-head blocks stay for GQA-4
shapes the MMA kernel does not take (head dim 64). ``LLMCHAT_CUDA_GQA_DECODE=cluster|groups|mma``
forces one of them and ``LLMCHAT_CUDA_GQA_MIN_KEYS`` moves the threshold (A/B;
:func:`.gpu_choices.cuda_gqa_decode`). GPUs before sm_90 are unchanged.

Prompt: TVM's ``batch_prefill_ragged_kv`` (a prompt chunk attending to its own keys) computed
attention on CUDA cores (374 us per Llama-2-7B layer for a 512-token prompt on the H200, 15 % of
the prompt's time); :func:`prefill_attention_pass` launches ``llmchat::prefill_attention`` instead,
a FlashAttention-2 style kernel on tensor cores (41 us for the same shape).

Prompt at depth: every chunk of a prompt after the first (and every later turn) also attends to the
keys already in the paged KV cache, through TVM's ``batch_prefill_paged_kv`` (CUDA cores; TVM then
merges it with the chunk's own attention by the two LSEs). :func:`prefill_paged_attention_pass`
launches ``llmchat::prefill_paged_attention`` instead: the same tensor-core kernel, its keys and
values read through the page table.
"""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.cuda_kernels import launch, prim_func_pass
from app.inference.pipelines.cuda_rope_append import FUSED_ATTR
from app.inference.pipelines.tir_facts import static_int

#: the PrimFunc TVM's paged KV cache uses for decode attention (no sliding window)
DECODE_ATTENTION = "batch_decode_paged_kv"
#: the PrimFunc TVM's paged KV cache uses for a prompt chunk's attention to its own keys
PREFILL_ATTENTION = "batch_prefill_ragged_kv"
#: the PrimFunc TVM's paged KV cache uses for a prompt chunk's attention to the cached keys (no
#: sliding window: that one is ``batch_prefill_paged_kv_sliding_window`` and stays TVM's)
PAGED_PREFILL_ATTENTION = "batch_prefill_paged_kv"
#: query rows per thread block of llmchat::prefill_attention
PREFILL_ROWS = 64
#: thread blocks the split aims at (a few waves on a large GPU)
TARGET_BLOCKS = 256
#: chunks per (sequence, query head) when the chunks merge inside a thread-block cluster (sm_90):
#: the largest portable cluster, or 16 (non-portable; H100/H200) when fewer than 32 query heads
#: would leave the GPU short of blocks on long contexts. H200, 32 layers in a CUDA graph:
#: Llama-2-7B (32 heads) 8 chunks: 5.32 us at 266 keys, 21.2 us at 4,096 (16 chunks: 26.1);
#: Qwen2.5-3B (16 heads) 16 chunks: 4.76 us at 266 keys, 10.9 us at 4,096 (8 chunks: 4.01 and
#: 14.0; the global-memory merge: 7.31 and 13.9)
CLUSTER_CHUNKS = 8
WIDE_CLUSTER_CHUNKS = 16
#: warps per block with cluster merging (8: Llama-2-7B, 1,024 keys: 8.42 us, 4 warps: 10.02 us)
CLUSTER_WARPS = 8
#: query heads per kv head of the models that take 4 heads per block for long sequences on sm_90
GQA_GROUP = 4
#: warps of those blocks (Llama-3-8B after 8,192 tokens: 8 warps 376.9 tok/s, 4 warps 304.5)
GQA_WARPS = 8
#: keys per sequence from which they are taken (``auto``; LLMCHAT_CUDA_GQA_MIN_KEYS)
GQA_MIN_KEYS = 3072
#: LLMCHAT_CUDA_GQA_DECODE: by the keys (``auto``), always one head per block (clusters), always
#: 4 heads per block (GQA-4), always the tensor-core kernel (groups of 2 to 8 heads, head dim 128)
GQA_MODES = ("auto", "cluster", "groups", "mma")
#: llmchat::decode_attention_mma: blocks per sequence (chunks x kv heads; chunks 1..32) and warps
#: per block. H200, benchmarks/kernels/gqa_decode_check.cu, us per layer in a 32-layer CUDA graph,
#: session 17 (merge loads issued together, two steps' loads in flight;
#: benchmarks/results/h200-2026-12-03-s17): Llama-3-8B (8 kv heads) after 1,024 / 4,096 / 8,192
#: keys: 16 chunks of 8 warps 7.11 / 10.68 / 15.65, 32 chunks 10.74 / 14.10 / 18.82 (session 12's
#: kernel, 32 chunks: 10.49 / 13.60 / 17.59); Qwen2.5-7B (4 kv heads) after 4,096 / 8,192: 32
#: chunks 11.43 / 13.99, 16 chunks 10.93 / 14.53; Qwen2.5-3B (2) 32 chunks 10.86 / 12.71, 16
#: chunks 10.66 / 13.76
MMA_BLOCKS = 128
MMA_WARPS = 8
#: ``auto``'s threshold (keys per sequence) for the tensor-core kernel with 8 or more kv heads (same
#: check, Llama-3-8B: the cluster kernel 4.90 / 7.58 / 11.13 us after 266 / 1,024 / 2,048 keys,
#: the tensor-core kernel 5.92 / 7.11 / 8.26)
MMA_MIN_KEYS = 1024
#: and with fewer kv heads, whose fewer blocks leave the cluster kernel ahead longer (Qwen2.5-7B's 4
#: kv heads after 2,048 / 3,072 keys: cluster 9.75 / 12.67, tensor cores 10.19 / 10.84 with 32
#: chunks; Qwen2.5-3B's 2: 8.95 / 11.66 against 9.96 / 10.41)
MMA_MIN_KEYS_FEW_KV = 3072
#: the kernel's scratch area for chunks merged through global memory (cuda_kernels.cu
#: ATTN_SCRATCH_ROWS / ATTN_SCRATCH_FLOATS): a batch whose states do not fit runs unsplit
ATTN_SCRATCH_ROWS = 8192
ATTN_SCRATCH_FLOATS = 8192 * 128


def cluster_chunks(heads: int, max_cluster: int) -> int:
    """Chunks (= blocks of a cluster) per query head: enough for :data:`TARGET_BLOCKS` blocks,
    within ``max_cluster``."""
    if heads * CLUSTER_CHUNKS >= TARGET_BLOCKS or max_cluster < WIDE_CLUSTER_CHUNKS:
        return CLUSTER_CHUNKS
    return WIDE_CLUSTER_CHUNKS


def mma_chunks(h_kv: int) -> int:
    """Chunks per (sequence, kv head) of llmchat::decode_attention_mma: :func:`num_chunks` aiming
    at :data:`MMA_BLOCKS` blocks per sequence."""
    return num_chunks(h_kv, MMA_BLOCKS)


def heads_per_block(group: int) -> int:
    """Query heads one block handles (of the ``group`` sharing a kv head): 2 when the group
    divides evenly, else 1 (registers: every thread keeps each head's query and output)."""
    return 2 if group % 2 == 0 else 1


def num_chunks(head_blocks: int, target: int = TARGET_BLOCKS) -> int:
    """Chunks per sequence and head block: a power of two near ``target`` / head_blocks, 1..32 (the
    global-memory merge gives each chunk one lane of a warp)."""
    chunks = 1
    while chunks < 32 and chunks * head_blocks < target:
        chunks *= 2
    return chunks


def _address(buf: Any) -> Any:
    """The address of ``buf``'s first element (its element offset included)."""
    from tvm import tirx

    return tirx.address_of(tirx.BufferLoad(buf, [tirx.IntImm("int32", 0)] * len(buf.shape)))


def split_decode_attention(
    func: Any, max_cluster: int = 0, gqa: str = "auto", gqa_min_keys: int = 0
) -> Any | None:
    """``func`` (TVM's ``batch_decode_paged_kv``) with llmchat's kernel in front, or None when
    its shapes are not the ones the kernel handles. ``max_cluster`` > 0 (sm_90 and later: 8, or
    16 where non-portable clusters are known to work): one query head per block, and the chunks
    of a head form a thread-block cluster that merges them through distributed shared memory.
    There, ``gqa`` (:data:`GQA_MODES`) picks a kernel for long sequences
    (:func:`long_context_kernel`): ``auto`` from ``gqa_min_keys`` keys per sequence on (0: the
    shape's measured threshold; a branch of the host code between the two launches),
    ``groups`` or ``mma`` always, ``cluster`` never."""
    from tvm import tirx

    names = [str(p) for p in func.params]
    if (
        names[:9]
        != [
            "Q",
            "pages",
            "page_table_indptr",
            "page_table_values",
            "length_info",
            "k_rope_pos_offset",
            "q_rope_position",
            "output",
            "lse",
        ]
        or len(names) != 13
    ):
        return None
    q, pages, _indptr, values, length_info = func.params[:5]
    if (
        str(q.dtype) != "float16"
        or str(pages.dtype) != "float16"
        or len(pages.shape) != 5
        or len(q.shape) != 3
        or len(length_info.shape) != 1
    ):
        return None
    h_qo, d = static_int(q.shape[1]), static_int(q.shape[2])
    h_kv, page = static_int(pages.shape[2]), static_int(pages.shape[3])
    if None in (h_qo, d, h_kv, page) or h_qo % h_kv or d % 8 or d // 8 not in (1, 2, 4, 8, 16, 32):
        return None
    if gqa not in GQA_MODES:
        raise ValueError(f"gqa must be one of {GQA_MODES}, not {gqa!r}")
    cluster = max_cluster > 0
    fused = func.attrs is not None and bool(func.attrs.get(FUSED_ATTR, False))
    if fused and not cluster:
        return None  # the fused RoPE and append run on sm_90 only (cluster or long-context kernels)
    batch = q.shape[0]
    if cluster:
        chunks = cluster_chunks(h_qo, max_cluster)
        body = _decode_launch(func, "decode_attention", chunks, h_qo, CLUSTER_WARPS, (1, True), fused)
    else:
        per_block = heads_per_block(h_qo // h_kv)
        chunks = num_chunks(h_qo // per_block)
        body = _decode_launch(
            func, "decode_attention", chunks, h_qo // per_block, 4, (per_block, False), fused
        )
    kind = long_context_kernel(h_qo, h_kv, d, page, gqa) if cluster else None
    if kind is None:
        return func.with_body(body)
    if kind == "mma":
        chunks = mma_chunks(h_kv)
        long = _decode_launch(func, "decode_attention_mma", chunks, h_kv, MMA_WARPS, None, fused)
    else:
        chunks = num_chunks(h_kv)
        long = _decode_launch(func, "decode_attention", chunks, h_kv, GQA_WARPS, (GQA_GROUP, False), fused)
    if gqa != "auto":
        return func.with_body(long)
    if not gqa_min_keys:
        if kind == "groups":
            gqa_min_keys = GQA_MIN_KEYS
        else:
            gqa_min_keys = MMA_MIN_KEYS if h_kv >= 8 else MMA_MIN_KEYS_FEW_KV
    # page_table_values: the pages of every sequence of the batch (TVM's view of exactly
    # page_table_indptr[-1] entries); keys counted in whole pages
    long_enough = values.shape[0] * page >= batch * gqa_min_keys
    # the batch's (sequence, head, chunk) states fit the scratch area (else the kernel would run
    # every sequence unsplit)
    rows = batch * (h_qo * chunks) <= ATTN_SCRATCH_ROWS
    floats = batch * (h_qo * chunks * d) <= ATTN_SCRATCH_FLOATS
    return func.with_body(tirx.IfThenElse(tirx.all(long_enough, rows, floats), long, body))


def long_context_kernel(h_qo: int, h_kv: int, d: int, page: int, gqa: str) -> str | None:
    """The kernel that takes long sequences on sm_90 in mode ``gqa``: ``mma``
    (llmchat::decode_attention_mma: 2 to 8 query heads per kv head, head dim 128, pages of whole
    16-key steps), ``groups`` (blocks of the 4 heads of a GQA-4 kv head, any head dim), or None
    (the cluster kernel for every length)."""
    group = h_qo // h_kv
    mma = d == 128 and 2 <= group <= 8 and page % 16 == 0
    groups = group == GQA_GROUP
    if gqa == "cluster":
        return None
    if gqa == "groups":
        return "groups" if groups else None
    if mma:
        return "mma"
    return "groups" if groups and gqa == "auto" else None


def _decode_launch(
    func: Any,
    kernel: str,
    chunks: int,
    blocks_y: int,
    warps: int,
    heads: tuple[int, bool] | None,
    fused: bool,
) -> Any:
    """A launch of ``llmchat::<kernel>`` on ``func``'s buffers: ``chunks`` x ``blocks_y`` x
    sequences blocks of ``warps`` warps. ``heads`` = (query heads per block, chunks of a head in
    one thread-block cluster) for ``decode_attention``; None for ``decode_attention_mma`` (the
    query heads of one kv head per block)."""
    from tvm import tirx

    q, pages, indptr, values, length_info, _k_off, q_pos, output, lse = func.params[:9]
    rotary_mode, rope_scale, rope_theta, sm_scale = func.params[9:]
    h_qo, d = static_int(q.shape[1]), static_int(q.shape[2])
    h_kv, page = static_int(pages.shape[2]), static_int(pages.shape[3])
    batch = q.shape[0]
    at = _address
    cluster = heads is not None and heads[1]
    extra = ", true" if fused else ""
    per_block = "" if heads is None else f"{heads[0]}, "
    flag = "" if heads is None else (", true" if cluster else ", false")
    name = f"llmchat::{kernel}<{h_qo}, {h_kv}, {d}, {page}, {chunks}, {per_block}{warps}{flag}{extra}>"
    call = tirx.call_extern(
        "int32",
        name,
        at(q),
        at(pages),
        at(indptr),
        at(values),
        at(length_info),
        at(output),
        at(lse),
        sm_scale,
        batch,
        rotary_mode,
        at(q_pos),
        tirx.Cast("float32", rope_scale),
        tirx.Cast("float32", rope_theta),
    )
    grid: dict[str, Any] = {"blockIdx.x": chunks, "blockIdx.y": blocks_y, "blockIdx.z": batch}
    if cluster:
        grid["clusterCtaIdx.x"] = chunks  # TVM's runtime launches (chunks, 1, 1) clusters
    return launch(call, grid, {"threadIdx.x": 32, "threadIdx.y": warps})


def _replace_kernel_pass(pass_name: str, global_symbol: str, replace: Any) -> Any:
    """Module pass: ``replace(func)`` on the PrimFunc exported as ``global_symbol``."""

    def rewrite(func: Any) -> Any | None:
        if func.attrs is None or str(func.attrs.get("global_symbol", "")) != global_symbol:
            return None
        return replace(func)

    return prim_func_pass(pass_name, rewrite)


def split_decode_attention_pass(max_cluster: int = 0, gqa: str = "auto", gqa_min_keys: int = 0) -> Any:
    """Module pass: :func:`split_decode_attention` on TVM's decode attention PrimFunc."""
    return _replace_kernel_pass(
        "llmchat_split_decode_attention",
        DECODE_ATTENTION,
        lambda func: split_decode_attention(func, max_cluster, gqa, gqa_min_keys),
    )


PREFILL_PARAMS = [
    "q",
    "q_indptr",
    "k",
    "v",
    "kv_indptr",
    "q_rope_position",
    "k_rope_pos_offset",
    "output",
    "lse",
    "causal",
    "rotary_mode",
    "rope_scale",
    "rope_theta",
    "sm_scale",
]


def prefill_attention(func: Any) -> Any | None:
    """``func`` (TVM's ``batch_prefill_ragged_kv``) as a launch of ``llmchat::prefill_attention``,
    or None when its shapes are not the ones the kernel handles (float16, equal static head sizes
    of keys and values, a multiple of 16 up to 128: its 64-key tiles of K and V fill 34 KB of the
    48 KB of static shared memory at 128)."""
    from tvm import tirx

    if [str(p) for p in func.params] != PREFILL_PARAMS:
        return None
    q, q_indptr, k, v, kv_indptr, _q_pos, _k_off, output, lse = func.params[:9]
    causal, rotary_mode, _rope_scale, _rope_theta, sm_scale = func.params[9:]
    if any(str(b.dtype) != "float16" or len(b.shape) != 3 for b in (q, k, v, output)):
        return None
    h_qo, d = static_int(q.shape[1]), static_int(q.shape[2])
    h_kv, d_k, d_v = static_int(k.shape[1]), static_int(k.shape[2]), static_int(v.shape[2])
    if None in (h_qo, d, h_kv) or d_k != d or d_v != d or h_qo % h_kv or d % 16 or d > 128:
        return None
    rows, batch = q.shape[0], q_indptr.shape[0] - 1
    name = f"llmchat::prefill_attention<{h_qo}, {h_kv}, {d}>"
    buffers = (q, q_indptr, k, v, kv_indptr, output, lse)
    call = tirx.call_extern(
        "int32", name, *(_address(b) for b in buffers), batch, causal, rotary_mode, sm_scale
    )
    # one block per 64 query rows of every sequence: at most rows / 64 + batch tiles
    tiles = tirx.floordiv(rows + (PREFILL_ROWS - 1), PREFILL_ROWS) + batch
    kernel = launch(call, {"blockIdx.x": tiles, "blockIdx.y": h_qo}, {"threadIdx.x": 32, "threadIdx.y": 4})
    return func.with_body(kernel)


def prefill_attention_pass() -> Any:
    """Module pass: :func:`prefill_attention` on TVM's prompt attention PrimFunc."""
    return _replace_kernel_pass("llmchat_prefill_attention", PREFILL_ATTENTION, prefill_attention)


PAGED_PREFILL_PARAMS = [
    "q",
    "q_indptr",
    "pages",
    "page_indptr",
    "page_values",
    "length_info",
    "k_rope_pos_offset",
    "q_rope_position",
    "output",
    "lse",
    "causal",
    "rotary_mode",
    "rope_scale",
    "rope_theta",
    "sm_scale",
]


def prefill_paged_attention(func: Any, pipelined: bool = False) -> Any | None:
    """``func`` (TVM's ``batch_prefill_paged_kv``) as a launch of
    ``llmchat::prefill_paged_attention``, or None when its shapes are not the ones the kernel
    handles: float16 queries, pages and output, pages ``[pages, 2, kv heads, page size, head dim]``
    of static sizes, ``length_info`` of one value per sequence (the last page's length: no sliding
    window), head dim a multiple of 16 up to 128 (as :func:`prefill_attention`). ``pipelined``:
    the key tiles copied with cp.async behind the work on the previous one (the kernel's ASYNC)."""
    from tvm import tirx

    if [str(p) for p in func.params] != PAGED_PREFILL_PARAMS:
        return None
    q, q_indptr, pages, page_indptr, page_values, length_info = func.params[:6]
    output, lse = func.params[8:10]
    causal, rotary_mode, _rope_scale, _rope_theta, sm_scale = func.params[10:]
    if any(str(b.dtype) != "float16" for b in (q, pages, output)) or str(lse.dtype) != "float32":
        return None
    if len(q.shape) != 3 or len(output.shape) != 3 or len(pages.shape) != 5 or len(length_info.shape) != 1:
        return None
    if any(str(b.dtype) != "int32" for b in (q_indptr, page_indptr, page_values, length_info)):
        return None
    h_qo, d = static_int(q.shape[1]), static_int(q.shape[2])
    two, h_kv, page, d_kv = (static_int(x) for x in pages.shape[1:])
    h_out, d_out = static_int(output.shape[1]), static_int(output.shape[2])
    if None in (h_qo, d, h_kv, page) or two != 2 or d_kv != d or (h_out, d_out) != (h_qo, d):
        return None
    if page <= 0 or h_qo % h_kv or d % 16 or d > 128:
        return None
    rows, batch = q.shape[0], q_indptr.shape[0] - 1
    flag = ", true" if pipelined else ""
    name = f"llmchat::prefill_paged_attention<{h_qo}, {h_kv}, {d}, {page}{flag}>"
    buffers = (q, q_indptr, pages, page_indptr, page_values, length_info, output, lse)
    call = tirx.call_extern(
        "int32", name, *(_address(b) for b in buffers), batch, causal, rotary_mode, sm_scale
    )
    # as prefill_attention: one block per 64 query rows of every sequence
    tiles = tirx.floordiv(rows + (PREFILL_ROWS - 1), PREFILL_ROWS) + batch
    kernel = launch(call, {"blockIdx.x": tiles, "blockIdx.y": h_qo}, {"threadIdx.x": 32, "threadIdx.y": 4})
    return func.with_body(kernel)


def prefill_paged_attention_pass(pipelined: bool = False) -> Any:
    """Module pass: :func:`prefill_paged_attention` on TVM's paged prompt attention PrimFunc."""
    return _replace_kernel_pass(
        "llmchat_prefill_paged_attention",
        PAGED_PREFILL_ATTENTION,
        lambda func: prefill_paged_attention(func, pipelined),
    )
