"""The generic CPU schedule for matrix products whose reduction runs along the weight's last axis,
and the knobs of the CPU schedules (:class:`CPUScheduleConfig`).

Every such product that no specialised kernel takes (q0 ``NT`` matmuls, tied lm_heads, the
dequantize-in-reduction products of every weight format) is scheduled with ``tvm.s_tir.Schedule``:
output rows are split over the threads; four rows are computed together (unrolled: the activation
is loaded once for all of them and their FMA chains are independent); the reduction is
``rfactor``-ed into an 8-lane fp32 vector accumulator that stays in registers, with one q4 group
(4 x 8 values) unrolled so its scale is loaded once; the fused epilogue (cast, residual add) runs
per row. With several activation rows (prefill) each activation row meets 32 weight rows while it
is in L1, and when the model materialises the dequantized weight in its own block, 8-row tiles of
it are decoded once per call and reused by every activation row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from app.inference.pipelines.cpu_attention import KERNEL_KIND_ATTR
from app.inference.pipelines.tir_facts import static_int

#: the attribute TVM gives a PrimFunc that is already scheduled (the pipeline leaves those alone)
SCHEDULED_ATTR = "tirx.is_scheduled"


@dataclass(frozen=True)
class CPUScheduleConfig:
    """Knobs of the CPU schedules; defaults suit x86-64 with AVX2/AVX-512 and 2–16 threads."""

    lanes: int = 8  # fp32 lanes of the GEMV accumulator (the words of 8 nibbles decode to 8 lanes)
    rows_per_step: int = 4  # output rows computed together in the GEMV inner loop
    k_unroll: int = 4  # reduction steps unrolled together (4 x 8 lanes = one q4 group of 32)
    row_groups: int = 8  # groups of ``rows_per_step`` rows per thread task when there are many rows
    weight_tile_rows: int = 8  # dequantized weight rows decoded at once for several activation rows
    replace_attention: bool = True  # swap TVM's scalar paged-KV attention kernels for cpu_attention's
    factored_block_gemv: bool = True  # decode GEMVs in block formats: the kernel of cpu_gemv
    # prompt GEMMs in block formats: the register-blocked kernel of cpu_gemm (``LLMCHAT_CPU_GEMM=tvm``:
    # the generic schedule of this module instead)
    prefill_gemm: bool = field(
        default_factory=lambda: os.environ.get("LLMCHAT_CPU_GEMM", "").strip().lower() != "tvm"
    )


def schedule_prim_func(func: Any, target: Any, config: CPUScheduleConfig | None = None) -> Any | None:
    """``func`` with a CPU schedule applied, or None when no rule fits (it then stays as it is)."""
    cfg = config or CPUScheduleConfig()
    try:
        sch = _schedule_matmul(func, target, cfg)
    except Exception as err:  # a kernel the rule does not fit keeps TVM's loop nest
        from app.debug_log import log

        name = func.attrs.get("global_symbol", "?") if getattr(func, "attrs", None) else "?"
        log.debug(
            "CPU matmul schedule did not fit %s (TVM's loop nest kept): %s: %s", name, type(err).__name__, err
        )
        sch = None
    if sch is None:
        return None
    return sch.mod["main"].with_attr(SCHEDULED_ATTR, True).with_attr(KERNEL_KIND_ATTR, "gemv")


def _vars_in(expr: Any) -> set[Any]:
    from tvm.s_tir.dlight.analysis.common_analysis import collect_vars_used_in_prim_expr

    return set(collect_vars_used_in_prim_expr(expr))


def _normalized_blocks(func: Any, keep_weight_block: bool = False) -> tuple[Any, list[Any], Any] | None:
    """A schedule of ``func`` with its spatial producers/consumers inlined, its remaining blocks, and
    (``keep_weight_block``) the block that materialises a 2-D weight ``[n, k]`` for the reduction,
    left as it is; None when there is no such block or nothing could be normalised."""
    from tvm import s_tir
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base import try_inline, try_inline_contiguous_spatial

    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    if not keep_weight_block:
        infos = try_inline_contiguous_spatial(sch, infos)
        return (sch, infos, None) if infos is not None else None
    reductions = [b for b in infos if not b.is_injective()]
    if len(reductions) != 1:
        return None
    red_reads = {str(r.source.name) for r in sch.get(reductions[0].block_rv).reads}
    weight = None
    for b in infos:
        if b.is_injective() and len(b.iters) == 2 and all(static_int(it.dom) for it in b.iters):
            writes = sch.get(b.block_rv).writes
            if len(writes) == 1 and str(writes[0].source.name) in red_reads:
                weight = b
    if weight is None:
        return None
    names = {sch.get(b.block_rv).name_hint for b in infos}  # before inlining removes blocks
    others = [b for b in infos if b is not weight and b.is_injective()]
    try_inline(sch, others)
    remaining = [b for b in normalize_prim_func(sch) or [] if sch.get(b.block_rv).name_hint in names]
    weight = next((b for b in remaining if b.name == weight.name), None)
    rest = [b for b in remaining if weight is None or b.name != weight.name]
    return (sch, rest, weight) if weight is not None else None


# --------------------------------------------------------------------------------------------
# GEMV / matmul with the reduction along the weight's last axis
# --------------------------------------------------------------------------------------------
def _schedule_matmul(func: Any, target: Any, cfg: CPUScheduleConfig) -> Any | None:
    """GEMV / GEMM. When the function materialises the dequantized weight in its own block (a
    ``dequantize`` compute feeding the matmul) and there are several activation rows, that block
    is kept and computed per tile of weight rows, so each weight is decoded once per call instead of
    once per activation row; otherwise the dequantization is inlined into the reduction."""
    sch = _matmul_schedule(func, cfg, keep_weight_block=True)
    return sch if sch is not None else _matmul_schedule(func, cfg, keep_weight_block=False)


def _matmul_schedule(func: Any, cfg: CPUScheduleConfig, keep_weight_block: bool) -> Any | None:
    norm = _normalized_blocks(func, keep_weight_block)
    if norm is None:
        return None
    sch, infos, weight_block = norm
    if len(infos) == 2 and infos[1].is_injective():
        main, epilogue = infos[0], infos[1]
    elif len(infos) == 1:
        main, epilogue = infos[0], None
    else:
        return None
    kinds = main.dom_kind()
    if kinds.count("R") != 1 or not kinds.endswith("R") or len(kinds) < 2:
        return None
    block = sch.get(main.block_rv)
    r_var = main.iters[-1].var
    spatial = main.iters[:-1]
    # The weight: a read indexed by the reduction var in its last axis and by exactly one spatial
    # var (the output column n) that the activation does not use.
    n_pos = None
    for region in block.reads:
        idx_vars = [_vars_in(r.min) for r in region.region]
        if not idx_vars or r_var not in idx_vars[-1]:
            continue
        used = set().union(*idx_vars)
        cand = [i for i, it in enumerate(spatial) if it.var in used]
        if len(cand) == 1 and static_int(spatial[cand[0]].dom) is not None:
            n_pos = cand[0]
    if n_pos is None:
        return None
    # The activation: a read that uses the reduction var but not n.
    n_var = spatial[n_pos].var
    has_vector = any(
        r_var in set().union(*[_vars_in(r.min) for r in region.region])
        and n_var not in set().union(*[_vars_in(r.min) for r in region.region])
        for region in block.reads
    )
    if not has_vector:
        return None
    n_extent = static_int(spatial[n_pos].dom)
    k_extent = static_int(main.iters[-1].dom)
    if n_extent is None or k_extent is None:
        return None
    lanes = cfg.lanes
    while lanes > 1 and k_extent % lanes:
        lanes //= 2
    rows = cfg.weight_tile_rows if weight_block is not None else cfg.rows_per_step
    while rows > 1 and n_extent % rows:
        rows //= 2

    loops = sch.get_loops(main.block_rv)
    m_loops = [lp for i, lp in enumerate(loops[:-1]) if i != n_pos]
    if weight_block is not None and not m_loops:
        return None  # one activation row: decoding inside the reduction is cheaper
    n_loop, k_loop = loops[n_pos], loops[-1]
    sch.reorder(*m_loops, n_loop, k_loop)
    m_loop = sch.fuse(*m_loops) if m_loops else None
    _ko, ki = sch.split(k_loop, factors=[None, lanes])
    rf = sch.rfactor(ki, factor_axis=0)
    # rf block loops: [m], n, ko, ki  ->  n_o, [m], ko, n_i, ki
    rf_loops = sch.get_loops(rf)
    if m_loop is not None:
        m_l, n_l, ko_l, ki_l = rf_loops
    else:
        m_l = None
        n_l, ko_l, ki_l = rf_loops
    if m_l is None:  # decode: one activation row
        n_o, n_i = sch.split(n_l, factors=[None, rows])
        sch.reorder(n_o, ko_l, n_i, ki_l)
        after = n_o
    else:  # several rows (prefill, batched decode): each activation row meets `row_groups` x
        # `rows` weight rows while it is in L1 (no tiling of the dynamic row loop: its predicate
        # made LLVM's code twice as slow)
        groups = cfg.row_groups
        while groups > 1 and (n_extent // rows) % groups:
            groups //= 2
        if weight_block is not None:
            groups = max(1, min(groups, cfg.weight_tile_rows // rows))
            while groups > 1 and (n_extent // rows) % groups:
                groups //= 2
        n_o, n_g, n_i = sch.split(n_l, factors=[None, groups, rows])
        sch.reorder(n_o, m_l, n_g, ko_l, n_i, ki_l)
        after = n_g
        if weight_block is not None:
            # decode a tile of weight rows once, before the loop over activation rows
            sch.compute_at(weight_block.block_rv, n_o, preserve_unit_loops=True)
            w_k = sch.get_loops(weight_block.block_rv)[-1]
            _w_ko, w_ki = sch.split(w_k, factors=[None, lanes])
            sch.vectorize(w_ki)
    sch.parallel(n_o)
    # write-back block (sum over the lanes) and the epilogue go per row group
    sch.reverse_compute_at(main.block_rv, after, preserve_unit_loops=True)
    if epilogue is not None:
        sch.reverse_compute_at(epilogue.block_rv, after, preserve_unit_loops=True)
    sch.unroll(n_i)
    words = k_extent // lanes
    if cfg.k_unroll > 1 and words % cfg.k_unroll == 0 and words > cfg.k_unroll:
        # a few reduction steps unrolled: per-group values (the scale, its conversion) are
        # loaded once for all of them
        ko_l, ko_i = sch.split(ko_l, factors=[None, cfg.k_unroll])
        sch.reorder(ko_i, n_i)
        sch.unroll(ko_i)
    sch.vectorize(ki_l)
    init = sch.decompose_reduction(rf, ko_l)
    sch.vectorize(sch.get_loops(init)[-1])
    if weight_block is not None:
        sch.annotate(n_o, "llmchat.dequantize_tile", 1)
    return sch
