"""Fewer dispatches per decode step on WGSL (WebGPU/Vulkan): a GEMV computes its own input.

On Vulkan every dispatch costs a fixed few microseconds whatever it does (on an H200 with
NVIDIA's driver about 2.1 µs of GPU time between dependent dispatches, and 5-6.6 µs of host time
to record and submit each one, which the decode loop overlaps: benchmarks/results/
h200-2026-12-04-s19/callE), and a decode step of a small model is largely such costs. Two
kernels of every layer only prepare the next GEMV's input vector:

- the RMSNorm before the q/k/v and the gate/up projections (and the final norm before the
  logits): ``half(rsqrt(sum(x^2) / K + eps) * x * w)``;
- the SiLU gate before the down projection: ``silu(h[:n]) * h[n:]``.

:func:`fuse_prologues` replaces each such pair (prologue kernel -> GEMV reading only its output)
by one kernel. The GEMV is first scheduled alone by the rules :mod:`.gpu` applies to it (whatever
GEMV rule that is: llmchat's ``DecodeGEMV`` or dlight's), then the prologue's blocks are put in
front of it and scheduled into its workgroups (:func:`graft_prologue`):

- element-wise blocks are inlined where the GEMV reads its vector (into the staging in
  workgroup memory where the rule stages the vector, else into the reduction itself);
- the sum of squares (a reduction) and the rsqrt after it are computed by every workgroup, the
  sum spread over the workgroup's ``threadIdx.x`` threads (a cross-thread reduction).

The arithmetic is the prologue's own (TVM's blocks, inlined; the float16 rounding of the
normalized value is kept); only the sum of squares is added in another order. A prologue is only
fused where it is TVM's own ``rms_norm`` or split-SiLU-multiply of a float16 ``[1, 1, K]`` row
(structurally equal to what TVM's passes make of the Relax op), its output feeds nothing else,
and the GEMV recomputes it cheaply (:data:`MAX_RECOMPUTED_WEIGHTS`; ``LLMCHAT_WGSL_FUSION=all``
lifts that limit).

**Two ways, by ``LLMCHAT_WGSL_FUSION``:**

- **default (``int8``-style, :func:`fuse_int8_pass`)**: llmchat's int8 GEMV kernel
  (:func:`.wgsl_q4_gemv.dp4a_kernel`, written by hand) computes the SiLU gate of the gate_up
  GEMV's output (each set of lanes computes gate rows and their up rows and writes
  ``silu(gate) * up``) and, for rows up to :data:`INT8_NORM_MAX_K`, the RMSNorm of its input
  (every workgroup sums the squares before staging the row). H200, NVIDIA's Vulkan driver,
  decode tok/s Qwen2.5-0.5B / 3B / Llama-2-7B (benchmarks/results/h200-2026-12-03-s13): 681.4 /
  344.9 / 244.8 with every kernel apart, 720.5 / 359.0 / 248.5 with the gate inside, 737.0 /
  321.1 / 228.7 with the norm inside every GEMV (hence the limit), 804.4 / 362.9 / 250.6 with the
  default (a later call of the same session).
  ``int8`` takes both everywhere, ``int8-norm`` / ``int8-silu`` one of them, ``off`` neither.
  **The vector quantized once** (default; ``int8-noq8`` without it): where the norm stays apart
  (rows over :data:`INT8_NORM_MAX_K`), its kernel (:func:`.wgsl_q4_gemv.q8_norm`, one workgroup)
  writes the vector already quantized to int8 and the GEMV after it reads those words instead of
  staging the vector in every workgroup: the same launches, the same arithmetic bit for bit, less
  work in each GEMV workgroup. H200, bench protocol, one device call
  (benchmarks/results/h200-2026-12-03-s15/call2): Llama-2-7B 295.6 tok/s against 263.1 / 262.4
  (the default before, first and last), Qwen2.5-3B 387.7 against 380.9 / 374.0.
  **The down projection's vector quantized by gate_up** (default; ``int8-q8`` without it): the
  gate_up kernel's workgroups own 32 gated outputs each (4 rows a set of 16 lanes) and write them
  quantized, one thread per workgroup, as the down projection's staging would; the down
  projection reads the words. H200 (benchmarks/results/h200-2026-12-03-s16/call2): Qwen2.5-3B
  440.9 tok/s against 413.9 / 413.6, Llama-2-7B 296.4 against 291.5 / 291.8.
  **The norm folded into the GEMVs around it** (default; ``int8-q8ns`` only for rows up to
  :data:`NORM_OUT_MAX_K`, ``int8-q8s`` never): where the norm's input is a GEMV's output (the
  o and the down projections), that GEMV also writes ``x * w`` quantized (a scale per 16 values:
  a workgroup's rows) and each half group's sum of ``x^2``; the GEMVs after the norm read those
  words and multiply their sums by ``rsqrt(mean(x^2) + eps)``, which scales every int8 group
  alike. Two launches a layer fewer (the first layer's norm, after the embedding, keeps its
  kernel). H200 (benchmarks/results/h200-2026-12-04-s19/callD): Qwen2.5-3B 473.0 tok/s against
  441.0 / 442.8 with the norm's kernel; the Llama-2-7B's 4,096-wide rows, no faster then (294.6
  against 296.0, with session 14's decode attention), gained once its attention was key-parallel:
  409.6 tok/s against 377.7 / 379.2 (benchmarks/results/h200-2026-12-04-s21/callB), hence every
  width since session 21.
- **grafted (``on`` or ``all``, :func:`fuse_prologues_pass`)**: the prologue's own blocks put in
  front of the GEMV as the rules schedule it (the rest of this docstring). On the H200 the fused
  library decoded the Llama-2-7B shape at 87.3 tok/s against 153.4 with the separate kernels
  (benchmarks/results/h200-2026-12-02-wgsl-fusion/): 65 launches fewer per step, but the fused
  GEMVs are far slower than the launches they save.

A GPU profile with a timestamp after every dispatch (``LLMCHAT_WEBGPU_PROFILE=1``) overstates
what a small kernel costs in a real step (each timestamp adds about 6-7 µs there): fusions are
judged by the bench protocol's decode speed, never by the profile alone.
"""

from __future__ import annotations

import os
from typing import Any

from app.inference.pipelines.cuda_rms_norm import reference_rms_norm
from app.inference.pipelines.cuda_silu_gate import silu_gate_width
from app.inference.pipelines.tir_facts import (
    bare_prim_func,
    float_constants,
    rewrite_dataflow_blocks,
    static_shape,
    tir_call,
)

#: the switch (``on`` or ``all`` fuses; unset or ``off`` keeps the prologue kernels); part of the
#: library cache key
FUSION_ENV = "LLMCHAT_WGSL_FUSION"
#: a GEMV whose schedule reads its vector inside the reduction (no staging) recomputes the
#: prologue once per row it computes: fused only up to this many weights (out x in features).
#: The Qwen2.5-0.5B GEMVs (at most 9,728 x 896) are below it, its tied 151,936-row logits GEMV
#: and the 7B MLP's are not.
MAX_RECOMPUTED_WEIGHTS = 16 << 20


def use_wgsl_fusion(target: Any) -> bool:
    """Whether :func:`fuse_prologues_pass` (the grafted fusion) runs for ``target``: on webgpu
    with ``LLMCHAT_WGSL_FUSION=on`` (or ``all``); not by default (slower on the H200, module doc)."""
    choice = os.environ.get(FUSION_ENV, "").strip().lower()
    return target.kind.name == "webgpu" and choice in ("on", "1", "yes", "all")


def use_int8_fusion(target: Any) -> bool:
    """Whether :func:`fuse_int8_pass` runs for ``target``: on webgpu by default (or with
    ``LLMCHAT_WGSL_FUSION=int8``) where ``q4-auto`` is the first GEMV rule (the default of
    :mod:`.wgsl_gemv`); ``off`` keeps every kernel apart, ``on``/``all`` the grafted fusion."""
    from app.inference.pipelines import wgsl_gemv
    from app.inference.pipelines.wgsl_q4_gemv import WgslQ4Gemv

    if target.kind.name != "webgpu" or not int8_fusion_parts():
        return False
    first = wgsl_gemv.rules()[:1]
    return bool(first) and isinstance(first[0], WgslQ4Gemv) and first[0].layout is None


def recompute_limit() -> int | None:
    """:data:`MAX_RECOMPUTED_WEIGHTS`, or None (no limit) with ``LLMCHAT_WGSL_FUSION=all``: to
    measure whether a GEMV recomputing its prologue per row still gains from one dispatch less
    (the 3B and 7B down projections)."""
    return None if os.environ.get(FUSION_ENV, "").strip().lower() == "all" else MAX_RECOMPUTED_WEIGHTS


def rms_norm_eps(func: Any) -> float | None:
    """The epsilon of ``func`` when it is TVM's rms_norm of a float16 ``[1, 1, K]`` row, else None."""
    import tvm_ffi
    from tvm import tirx

    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 3:
        return None
    x, w, out = func.params
    shapes = [static_shape(b) if hasattr(b, "shape") else None for b in (x, w, out)]
    if any(s is None for s in shapes) or any(str(b.dtype) != "float16" for b in (x, w, out)):
        return None
    xs, ws, os_ = shapes
    if len(xs) != 3 or xs[:2] != [1, 1] or xs != os_ or ws != [xs[2]]:
        return None
    bare = bare_prim_func(func)
    for eps in sorted(float_constants(func)):
        if tvm_ffi.structural_equal(bare, bare_prim_func(reference_rms_norm(xs[2], eps))):
            return eps
    return None


def is_rms_norm(func: Any) -> bool:
    """Whether ``func`` is TVM's rms_norm of a float16 ``[1, 1, K]`` row (any epsilon)."""
    return rms_norm_eps(func) is not None


def prologue_kind(name: str, func: Any) -> str | None:
    """``"rms_norm"`` or ``"silu_gate"`` when ``func`` (called ``name``) is a prologue this
    module fuses into the GEMV after it, else None."""
    if silu_gate_width(name, func):
        return "silu_gate"
    if is_rms_norm(func):
        return "rms_norm"
    return None


def _blocks(stmt: Any) -> list[Any]:
    """Every block under ``stmt``, in order."""
    import tvm_ffi
    from tvm import s_tir

    found: list[Any] = []
    tvm_ffi.structural_walk(stmt, [(s_tir.SBlock, found.append)])
    return found


def _thread_extent(stmt: Any, tag: str) -> int | None:
    """The extent of the first loop of ``stmt`` bound to ``tag`` (``threadIdx.x``), or None."""
    import tvm_ffi
    from tvm import tirx

    found: list[int] = []

    def visit(loop: Any) -> None:
        binding = loop.thread_binding
        if not found and binding is not None and str(binding.thread_tag) == tag:
            extent = loop.extent
            if isinstance(extent, tirx.IntImm):
                found.append(int(extent.value))

    tvm_ffi.structural_walk(stmt, [(tirx.For, visit)])
    return found[0] if found else None


def schedule_alone(func: Any, rules: list[Any], target: Any) -> Any | None:
    """``func`` scheduled by ``rules`` (dlight's ApplyDefaultSchedule, as the pipeline runs
    them), or None when no rule took it. The fusion is built on ``DecodeGEMV``'s loop nest:
    llmchat's int8-dot4 kernel (:mod:`.wgsl_q4_gemv`, the default's first rule) has no prologue
    to fuse into, so it is left out here and the GEMVs the fusion takes get ``DecodeGEMV``."""
    import tvm
    from tvm.s_tir import dlight as dl

    from app.inference.pipelines.wgsl_q4_gemv import WgslQ4Gemv

    rules = [r for r in rules if not isinstance(r, WgslQ4Gemv)]
    with target:
        out = dl.ApplyDefaultSchedule(*rules)(tvm.IRModule({"main": func}))["main"]
    if out.attrs is None or not out.attrs.get("tirx.is_scheduled", False):
        return None
    return out


def _staged(scheduled: Any, vec: Any) -> bool:
    """Whether every block of ``scheduled`` that reads ``vec`` only copies it into workgroup
    memory (the prologue then runs once per element and workgroup)."""
    readers = [b for b in _blocks(scheduled.body) if any(r.source.same_as(vec) for r in b.reads)]
    return bool(readers) and all(all(str(w.source.scope()) == "shared" for w in b.writes) for b in readers)


def graft_prologue(prologue: Any, scheduled_gemv: Any) -> Any | None:
    """One scheduled PrimFunc computing ``scheduled_gemv`` (a GEMV whose first parameter is the
    vector, scheduled already) on ``prologue``'s output, with the prologue's work done inside
    the GEMV's kernel; parameters: the prologue's inputs, then the GEMV's other parameters.
    None when the GEMV is not one kernel over ``blockIdx.x`` or a schedule step fails."""
    import tvm_ffi
    from tvm import s_tir, tirx

    vec, p_out = scheduled_gemv.params[0], prologue.params[-1]
    if static_shape(vec) != static_shape(p_out) or str(vec.dtype) != str(p_out.dtype):
        return None
    tx = _thread_extent(scheduled_gemv.body, "threadIdx.x")
    if tx is None:
        return None
    # the prologue's blocks write the GEMV's vector buffer (now an intermediate)
    p_body = tvm_ffi.structural_map(prologue.body, [(type(p_out), lambda b: vec if b.same_as(p_out) else b)])
    p_root, g_root = p_body.block, scheduled_gemv.body.block
    p_names = [b.name_hint for b in _blocks(p_root.body)]
    root = s_tir.SBlock(
        [],
        [],
        [],
        "root",
        tirx.SeqStmt([p_root.body, g_root.body]),
        alloc_buffers=[*p_root.alloc_buffers, vec, *g_root.alloc_buffers],
    )
    attrs = {k: v for k, v in (scheduled_gemv.attrs or {}).items() if k != "global_symbol"}
    func = tirx.PrimFunc(
        [*prologue.params[:-1], *scheduled_gemv.params[1:]], s_tir.SBlockRealize([], True, root)
    ).with_attrs(attrs)
    try:
        return _schedule_prologue(s_tir.Schedule(func), p_names, tx)
    except Exception as err:  # a structure this schedule does not handle: keep two kernels
        from app.debug_log import log

        log.debug("WGSL fusion kept the prologue kernel: %s: %s", type(err).__name__, err)
        return None


#: where the scalars computed from a reduction live (the rsqrt of the norm): one copy per
#: workgroup, written by one thread before a barrier. Not "local": TVM then stored the rsqrt in
#: the register of the lowered cross-thread sum, which aliases the reduction's workgroup buffer,
#: so threads read a value other threads had already overwritten (seen in the generated WGSL).
SCALAR_SCOPE = "shared"


def reduces_block(stmt: Any) -> bool:
    """Whether the block ``stmt`` has a reduction iterator."""
    return any(int(iv.iter_type) != 0 for iv in stmt.iter_vars)


def _schedule_prologue(sch: Any, names: list[str], tx: int) -> Any:
    """Inline the prologue's element-wise blocks; compute its reductions (and what reads only
    them) per workgroup, the reduction spread over ``tx`` threads."""
    from tvm import tirx

    kernel_loop = None
    per_workgroup = []  # reductions and the scalars computed from them, producers first
    for name in reversed(names):  # consumers first: inlining and compute_at go that way
        block = sch.get_sblock(name)
        stmt = sch.get(block)
        size = 1
        for dim in stmt.writes[0].source.shape:
            size *= int(dim)
        if not reduces_block(stmt) and size > 1:
            sch.compute_inline(block)
            continue
        if kernel_loop is None:
            consumer = sch.get_consumers(block)[0]
            kernel_loop = next(
                lp
                for lp in sch.get_loops(consumer)
                if sch.get(lp).thread_binding is not None
                and str(sch.get(lp).thread_binding.thread_tag) == "blockIdx.x"
            )
        sch.compute_at(block, kernel_loop, preserve_unit_loops=True)
        per_workgroup.append(block)
    for block in per_workgroup:
        stmt = sch.get(block)
        loops = sch.get_loops(block)[1:]  # under the workgroup loop
        if reduces_block(stmt):
            red = loops[-1]
            _, inner = sch.split(red, factors=[None, tx], preserve_unit_iters=True)
            sch.bind(inner, "threadIdx.x")
        sch.set_scope(block, 0, "local" if reduces_block(stmt) else SCALAR_SCOPE)
    out = sch.mod["main"]
    return out.with_attr("tirx.is_scheduled", True) if isinstance(out, tirx.PrimFunc) else None


def is_gemv(func: Any) -> bool:
    """Whether ``func`` reduces its first parameter (the vector) along its last axis against a
    2-D weight parameter: a GEMV (what the fusion targets; an element-wise consumer of the
    prologue's output is left alone)."""
    vec = func.params[0]
    width = int(vec.shape[-1])
    if not any(hasattr(p, "shape") and len(p.shape) == 2 for p in func.params[1:]):
        return False
    for block in _blocks(func.body):
        if not any(r.source.same_as(vec) for r in block.reads):
            continue
        extents = [
            int(iv.dom.extent)
            for iv in block.iter_vars
            if int(iv.iter_type) != 0 and hasattr(iv.dom.extent, "value")
        ]
        if extents and extents[-1] == width:
            return True
    return False


def _weights(gemv: Any) -> int:
    """Out features x in features of a GEMV (its vector and output lengths)."""
    vec, out = gemv.params[0], gemv.params[-1]
    return int(vec.shape[-1]) * int(out.shape[-1])


def fused_func(prologue: Any, gemv: Any, rules: list[Any], target: Any) -> Any | None:
    """The scheduled one-kernel PrimFunc of ``gemv(prologue(...), ...)``, or None when it is
    not worth it or not possible (the GEMV keeps its own kernel)."""
    vec = gemv.params[0]
    shape = static_shape(vec) if hasattr(vec, "shape") else None
    if shape is None or len(shape) != 3 or shape[:2] != [1, 1] or len(gemv.params) < 3:
        return None
    if static_shape(gemv.params[-1]) is None:
        return None
    if not is_gemv(gemv):
        return None
    scheduled = schedule_alone(gemv, rules, target)
    if scheduled is None:
        return None
    limit = recompute_limit()
    if limit is not None and not _staged(scheduled, scheduled.params[0]) and _weights(gemv) > limit:
        return None
    fused = graft_prologue(prologue, scheduled)
    if fused is None:
        return None
    limit = int(target.attrs.get("max_shared_memory_per_block", 16384))
    threads = int(target.attrs.get("max_num_threads", 256))
    if shared_bytes(fused) + 2 * ALLREDUCE_BYTES * threads > limit:
        return None  # the adapter would refuse the kernel: two kernels that it takes
    return fused


#: workgroup memory of one cross-thread reduction per thread (TVM's tree reduction, float32);
#: the fused kernel has at most two (the prologue's sum of squares and the GEMV's own)
ALLREDUCE_BYTES = 4


def shared_bytes(func: Any) -> int:
    """Workgroup memory ``func`` allocates in its blocks (``shared`` scope)."""
    total = 0
    for block in _blocks(func.body):
        for buf in block.alloc_buffers:
            if str(buf.scope()) != "shared":
                continue
            size = 1
            for dim in buf.shape:
                size *= int(dim)
            total += size * max(1, buf.dtype.bits // 8)
    return total


def _fuse_block(block: Any, mod: Any, builder: Any, fused: dict[tuple[str, str], Any], make: Any) -> Any:
    """``block`` with its prologue + GEMV pairs fused, or None when it has none."""
    from tvm import relax

    users = relax.analysis.udchain(block)
    values = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
    bindings, dropped = [], set()
    for binding in block.bindings:
        call = tir_call(binding.value) if isinstance(binding, relax.VarBinding) else None
        vec = call[1][0] if call is not None and call[1] else None
        inner = tir_call(values.get(vec)) if isinstance(vec, relax.DataflowVar) else None
        if (
            inner is None
            or len(users.get(vec, [])) != 1
            or not prologue_kind(inner[0].name_hint, mod[inner[0]])
        ):
            bindings.append(binding)
            continue
        key = (inner[0].name_hint, call[0].name_hint)
        if key not in fused:
            prim = make(mod[inner[0]], mod[call[0]])
            fused[key] = prim and builder.add_func(prim, f"{key[1]}_{key[0]}")
        if fused[key] is None:
            bindings.append(binding)
            continue
        args = relax.Tuple([*inner[1], *call[1][1:]])
        value = builder.normalize(relax.call_tir(fused[key], args, binding.var.ty))
        bindings.append(relax.VarBinding(binding.var, value))
        dropped.add(vec)
    if not dropped:
        return None
    return relax.DataflowBlock([b for b in bindings if b.var not in dropped])


def fuse_prologues(mod: Any, rules: list[Any], target: Any) -> Any:
    """``mod`` with every ``y = gemv(prologue(...), ...)`` in a Relax dataflow block (the
    prologue's output used by nothing else) turned into one ``call_tir`` of
    :func:`fused_func`; kernels nothing calls any more leave the module."""

    def make(prologue: Any, gemv: Any) -> Any | None:
        return fused_func(prologue, gemv, rules, target)

    return rewrite_dataflow_blocks(
        mod, lambda block, builder, fused: _fuse_block(block, mod, builder, fused, make)
    )


def fuse_prologues_pass(rules: list[Any], target: Any) -> Any:
    """Module pass: :func:`fuse_prologues` (after FuseTIR, before the dlight rules; ``rules``
    are the ones the pipeline applies afterwards)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="llmchat_wgsl_fuse_prologues")
    def _pass(mod: Any, _ctx: Any) -> Any:
        return fuse_prologues(mod, rules, target)

    return _pass


def _fuse_int8_block(
    block: Any,
    mod: Any,
    builder: Any,
    fused: dict[tuple[str, ...], Any],
    max_shared: int,
    parts: tuple[str, ...],
) -> Any:
    """``block`` with each batch-1 q4f16_1 GEMV that reads an RMSNorm's output and/or feeds a SiLU
    gate (each read by nothing else) turned into one call of the int8 kernel doing all of it
    (:func:`.wgsl_q4_gemv.fused_gemv`), or None when there is none."""
    from tvm import relax

    from app.inference.pipelines.cuda_gemv import match_q4f16_gemv
    from app.inference.pipelines.wgsl_q4_gemv import fused_gemv, q8_norm, q8_words, q8n_words

    users = relax.analysis.udchain(block)
    by_var = {b.var: b for b in block.bindings if isinstance(b, relax.VarBinding)}
    out: list[Any] = []
    dropped, moved = set(), set()
    gated_q8: dict[Any, Any] = {}  # a gated output written quantized -> its words' variable
    # a GEMV's float16 output -> (its binding's place in ``out``, the GEMV, its arguments, whether
    # it reads quantized words): a GEMV that can also write its output quantized for the norm after
    # it ("q8n")
    producers: dict[Any, tuple[int, Any, list[Any], bool]] = {}
    # a producer's output -> (the variable of its words for the norm, the norm's weight)
    normed: dict[Any, tuple[Any, Any]] = {}

    def vector_index(gemv: Any, m: Any) -> int:
        """The position of a matched GEMV's vector among its arguments."""
        return next(i for i, p in enumerate(gemv.params) if p.same_as(m.x))

    def gemv_reading(var: Any) -> Any | None:
        """The kernel of the one batch-1 q4f16_1 GEMV that reads ``var`` as its vector, if ``var``
        has no other reader."""
        readers = users.get(var, [])
        rcall = tir_call(by_var[readers[0]].value) if len(readers) == 1 and readers[0] in by_var else None
        rm = match_q4f16_gemv(mod[rcall[0]]) if rcall is not None else None
        if rm is None:
            return None
        ri = vector_index(mod[rcall[0]], rm)
        return rcall[0] if ri < len(rcall[1]) and rcall[1][ri].same_as(var) else None

    def fused_fn(key: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
        """The module's function for ``key``: ``fused_gemv(*args, **kwargs)`` added on first use
        (None where the int8 kernel does not take it)."""
        if key not in fused:
            prim = fused_gemv(*args, max_shared=max_shared, **kwargs)
            fused[key] = prim and builder.add_func(prim, "_".join(name for name in key if name))
        return fused[key]

    for binding in block.bindings:
        if binding.var in moved:
            continue  # a SiLU gate now computed by the GEMV before it
        call = tir_call(binding.value) if isinstance(binding, relax.VarBinding) else None
        m = match_q4f16_gemv(mod[call[0]]) if call is not None else None
        if m is None:
            out.append(binding)
            continue
        gv, args = call
        gemv = mod[gv]
        xi = vector_index(gemv, m)
        vec = args[xi] if xi < len(args) else None
        if vec is not None and vec in gated_q8:  # the down projection of a gate written quantized
            reader = fused[("", gv.name_hint, "", "q8", "")]
            new_args = [gated_q8[vec] if i == xi else arg for i, arg in enumerate(args)]
            producers[binding.var] = (len(out), gv, new_args, True)
            out.append(
                relax.VarBinding(
                    binding.var,
                    builder.normalize(relax.call_tir(reader, relax.Tuple(new_args), binding.var.ty)),
                )
            )
            continue
        norm = None
        inner = tir_call(by_var[vec].value) if isinstance(vec, relax.DataflowVar) and vec in by_var else None
        takes_norm = "norm" in parts or ("norm-short" in parts and m.in_features <= INT8_NORM_MAX_K)
        q8 = None  # the norm's kernel writes the vector quantized (q8_norm), the GEMV reads that
        if inner is not None and len(users.get(vec, [])) == 1 and (takes_norm or "q8" in parts):
            eps = rms_norm_eps(mod[inner[0]])
            if eps is not None and takes_norm:
                norm = (inner, eps)
            elif eps is not None:
                q8 = (inner, eps)
        gate = None
        readers = users.get(binding.var, [])
        if (
            "silu" in parts
            and isinstance(binding.var, relax.DataflowVar)
            and len(readers) == 1
            and readers[0] in by_var
        ):
            reader = by_var[readers[0]]
            gcall = tir_call(reader.value)
            if (
                gcall is not None
                and len(gcall[1]) == 1
                and silu_gate_width(gcall[0].name_hint, mod[gcall[0]])
            ):
                gate = (reader, gcall)
        if norm is None and gate is None and q8 is None:
            producers[binding.var] = (len(out), gv, list(args), False)
            out.append(binding)
            continue
        # the norm's vector written by the GEMV before it ("q8n"): no kernel for the norm
        source = None
        if q8 and q8[0][1][0] in producers and _folds_norm(parts, q8[0][1][0]):
            x_var, nw = q8[0][1][0], q8[0][1][1]
            if x_var not in normed or normed[x_var][1].same_as(nw):
                source = _norm_producer(producers[x_var], mod, fused_fn)
        # the gate's output quantized by gate_up itself, for the down projection after it
        down = gemv_reading(gate[0].var) if gate and "q8-silu" in parts else None
        if (
            down is not None
            and fused_fn(("", down.name_hint, "", "q8", ""), mod[down], None, None, q8=True) is None
        ):
            down = None
        key = (
            norm[0][0].name_hint if norm else "",
            gv.name_hint,
            gate[1][0].name_hint if gate else "",
            "q8n" if source else "q8" if q8 else "",
            "q8out" if down else "",
        )
        norm_eps, silu_out = (norm[1] if norm else None), (mod[gate[1][0]].params[-1] if gate else None)
        read_norm = q8[1] if source else None
        fused_fn(
            key, gemv, norm_eps, silu_out, q8=q8 is not None, q8_out=down is not None, read_norm=read_norm
        )
        if fused[key] is None and source:  # the GEMV does not take the norm's scale: its kernel
            source, read_norm = None, None
            key = (*key[:3], "q8", key[4])
            fused_fn(key, gemv, norm_eps, silu_out, q8=True, q8_out=down is not None)
        if fused[key] is None and down is not None:  # no layout for it: the float16 output
            down = None
            key = (*key[:4], "")
            fused_fn(key, gemv, norm_eps, silu_out, q8=q8 is not None, read_norm=read_norm)
        if fused[key] is None:
            out.append(binding)
            continue
        qkey = (q8[0][0].name_hint, "q8") if q8 else None
        if q8 and not source and qkey not in fused:  # only once a GEMV reads it
            fused[qkey] = builder.add_func(q8_norm(m.in_features, q8[1]), "_".join(qkey))
        new_args = []
        for i, arg in enumerate(args):
            new_args += list(norm[0][1]) if (norm and i == xi) else [arg]
        if source:
            x_var, nw = q8[0][1][0], q8[0][1][1]
            if x_var not in normed:  # the producer's binding: its float16 output and the words
                at, pfunc, pargs = source
                words_ty = relax.TensorType((q8n_words(int(x_var.ty.shape[-1])),), "uint32")
                both = relax.DataflowVar(f"{x_var.name}_and_q8n", relax.TupleType([x_var.ty, words_ty]))
                call = relax.call_tir(pfunc, relax.Tuple([*pargs, nw]), [x_var.ty, words_ty])
                qvar = relax.DataflowVar(f"{x_var.name}_q8n", words_ty)
                out[at] = [
                    relax.VarBinding(both, builder.normalize(call)),
                    relax.VarBinding(x_var, builder.normalize(relax.TupleGetItem(both, 0))),
                    relax.VarBinding(qvar, builder.normalize(relax.TupleGetItem(both, 1))),
                ]
                normed[x_var] = (qvar, nw)
            new_args[xi] = normed[x_var][0]
        elif q8:
            qvar = relax.DataflowVar(f"{vec.name}_q8", relax.TensorType((q8_words(m.in_features),), "uint32"))
            staged = relax.call_tir(fused[qkey], relax.Tuple(list(q8[0][1])), qvar.ty)
            out.append(relax.VarBinding(qvar, builder.normalize(staged)))
            new_args[xi] = qvar
        result = gate[0].var if gate else binding.var
        written = result  # what the kernel writes: the result, or its words for the down projection
        if down is not None:
            words = q8_words(int(result.ty.shape[-1]))
            written = relax.DataflowVar(f"{result.name}_q8", relax.TensorType((words,), "uint32"))
            gated_q8[result] = written
        value = builder.normalize(relax.call_tir(fused[key], relax.Tuple(new_args), written.ty))
        out.append(relax.VarBinding(written, value))
        if norm or q8:
            dropped.add(vec)
        if gate:
            moved.add(result)
    if not dropped and not moved:
        return None
    flat = [b for item in out for b in (item if isinstance(item, list) else [item])]
    return relax.DataflowBlock([b for b in flat if b.var not in dropped])


#: ``int8-q8ns`` (the default of sessions 19 and 20) folds an RMSNorm into the GEMVs around it
#: (``q8n``) only for rows of this many values or fewer; the default folds every width (session
#: 21: Llama-2-7B 409.6 against 377.7 / 379.2 tok/s, benchmarks/results/h200-2026-12-04-s21/callB,
#: once its decode attention was key-parallel). Session 19's measurement (H200,
#: NVIDIA's Vulkan driver, decode tok/s by the bench protocol, the kernel as it is, two rounds in
#: one device call (benchmarks/results/h200-2026-12-04-s19/callB): Qwen2.5-3B (2,048) 463.1 /
#: 463.6 against 440.6 / 439.7 with the norm's kernel; Llama-2-7B (4,096) 294.6 / 294.6 against
#: 296.0 / 296.1. The GEMV writing the norm's vector ends with a barrier and one thread
#: quantizing its 16 values, and the GEMVs after it read two scales a group: that costs about
#: what the norm's launch did on the 7B's wider rows, less than it on the 3B's.
NORM_OUT_MAX_K = 2048


def _folds_norm(parts: tuple[str, ...], x_var: Any) -> bool:
    """Whether the norm of ``x_var`` folds into the GEMVs around it (``q8n`` everywhere,
    ``q8n-short`` for rows up to :data:`NORM_OUT_MAX_K`)."""
    width = int(x_var.ty.shape[-1])
    return "q8n" in parts or ("q8n-short" in parts and width <= NORM_OUT_MAX_K)


def _norm_producer(
    producer: tuple[int, Any, list[Any], bool], mod: Any, fused_fn: Any
) -> tuple[int, Any, list[Any]] | None:
    """(its place in the block, the function, its arguments) of ``producer``, the GEMV that writes
    the input of an RMSNorm, as the int8 kernel that writes that output and also its words for the
    norm (``norm_out`` of :func:`.wgsl_q4_gemv.fused_gemv`), or None where it does not take it."""
    at, gv, args, reads_q8 = producer
    key = ("", gv.name_hint, "", "q8" if reads_q8 else "", "q8n_out")
    func = fused_fn(key, mod[gv], None, None, q8=reads_q8, norm_out=True)
    return None if func is None else (at, func, args)


def fuse_int8(mod: Any, max_shared: int, parts: tuple[str, ...] = ("norm", "silu")) -> Any:
    """``mod`` with the RMSNorm before and the SiLU gate after each batch-1 q4f16_1 GEMV (where
    :func:`_fuse_int8_block` finds them) computed inside llmchat's int8 GEMV kernel: on the H200
    the separate kernels cost ~8-10 µs each, mostly Vulkan's fixed cost per dispatch."""
    return rewrite_dataflow_blocks(
        mod, lambda block, builder, fused: _fuse_int8_block(block, mod, builder, fused, max_shared, parts)
    )


#: the default takes the RMSNorm into the int8 GEMV only for rows of this many values or fewer.
#: H200, NVIDIA's Vulkan driver, decode tok/s by the bench protocol, same session
#: (benchmarks/results/h200-2026-12-03-s13/sweep): the norm inside every GEMV after it against
#: its own kernel, Qwen2.5-0.5B (K = 896) 737.0 against 681.4, Qwen2.5-3B (K = 2048) 321.1 against
#: 344.9, Llama-2-7B (K = 4096) 228.7 against 244.8. Each workgroup sums the squares of the row
#: before it stages it: two barriers and a longer start, which costs more than the dispatch it
#: saves on the longer rows.
INT8_NORM_MAX_K = 1024


def int8_fusion_parts() -> tuple[str, ...]:
    """What the int8 GEMV kernel takes in (``LLMCHAT_WGSL_FUSION``): by default (or ``int8-q8n``)
    the SiLU gate (``silu``), the RMSNorm of rows up to :data:`INT8_NORM_MAX_K` (``norm-short``),
    for the longer rows the norm's own kernel writing the vector quantized once (``q8``:
    :func:`.wgsl_q4_gemv.q8_norm`) for the GEMVs after it to read instead of each of their
    workgroups quantizing it, and gate_up writing its gated output quantized for the down
    projection (``q8-silu``); where a GEMV writes the norm's input, no kernel for the norm at all
    (``q8n``: that GEMV writes the vector quantized, the GEMVs after the norm apply its scale;
    only the first layer's norm, after the embedding, keeps its kernel). For A/B runs
    ``int8-q8ns`` that only for rows up to :data:`NORM_OUT_MAX_K` (``q8n-short``: sessions 19
    and 20), ``int8-q8s`` never (session 16's), ``int8-q8`` also without ``q8-silu``,
    ``int8-noq8`` also without ``q8``, ``int8`` the norm and the gate everywhere, ``int8-norm`` /
    ``int8-silu`` one of them; none for any other value (``off``)."""
    choice = os.environ.get(FUSION_ENV, "").strip().lower()
    return {
        "": ("norm-short", "silu", "q8", "q8-silu", "q8n"),
        "int8-q8ns": ("norm-short", "silu", "q8", "q8-silu", "q8n-short"),
        "int8-q8n": ("norm-short", "silu", "q8", "q8-silu", "q8n"),
        "int8-q8s": ("norm-short", "silu", "q8", "q8-silu"),
        "int8-q8": ("norm-short", "silu", "q8"),
        "int8-noq8": ("norm-short", "silu"),
        "int8": ("norm", "silu"),
        "int8-norm": ("norm",),
        "int8-silu": ("silu",),
    }.get(choice, ())


def fuse_int8_pass(target: Any) -> Any:
    """Module pass: :func:`fuse_int8` (after FuseTIR, before the dlight rules)."""
    import tvm

    max_shared = int(target.attrs.get("max_shared_memory_per_block", 16384))

    @tvm.transform.module_pass(opt_level=0, name="llmchat_wgsl_fuse_int8")
    def _pass(mod: Any, _ctx: Any) -> Any:
        return fuse_int8(mod, max_shared, int8_fusion_parts())

    return _pass
