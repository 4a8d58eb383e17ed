"""A decoded token's RoPE and KV append inside llmchat's WGSL decode attention (WebGPU/Vulkan).

For every layer TVM's paged KV cache launches three kernels when one token is decoded:
split-rotary (q, k, v out of the fused projection, RoPE on q and k), transpose-append (k and v
into their page slot) and the attention. On NVIDIA's Vulkan driver a dispatch costs ~5 µs
whatever it does (an empty one: 5.4 µs), so the first two cost about as much as a GEMV. The CUDA
path folds them into its attention kernel with recorded device pointers
(:mod:`.cuda_rope_append`); WGSL has no pointers, so here the add-on does the recording:

- the PrimFunc computing each layer's fused q/k/v projection (whatever kernel it became) calls
  the add-on's ``llmchat.webgpu.record_qkv`` with its output from its host code, before its launch;
- TVM's split-rotary and append PrimFuncs launch their kernels only for more than one token (the
  host-side condition of :func:`.cuda_rope_append.skip_single_token`);
- the decode attention is llmchat's v2 kernel built ``fused`` (:func:`.wgsl_attention.decode_kernel_v2`):
  for one sequence its host code calls ``llmchat.webgpu.substitute_next``, so the add-on binds
  the recorded projection in place of ``Q`` for the next launch; the kernel applies RoPE to the
  token's q and k as TVM's split-rotary does, writes the new key and value to their page slot
  (one workgroup per KV head) and takes them from the projection where it meets the last key.

Only where every attention call of the module takes q/k/v from a PrimFunc's output (through
reshapes), split-rotary and append are TVM's own for default RoPE, the KV cache applies RoPE
(``RopeMode.NORMAL``) and the v2 kernel takes the shapes; otherwise nothing changes.

**By default only for head_dim up to 64** (:data:`AUTO_MAX_HEAD_DIM`), from the H200 (NVIDIA's
Vulkan driver, bench protocol, decode tok/s, fused against ``off`` in one call,
benchmarks/results/h200-2026-12-03-s14/ab5.tgz): Qwen2.5-0.5B (head_dim 64) 806.8 against 762.2;
Qwen2.5-3B (128) 356.1 against 374.8; Llama-2-7B (128) 215.7 against 258.7. Those fused kernels
chose between the page and the new key with a select around each page load, which TVM's WGSL
writes as a branch: 32 loads a thread each behind its own branch on the 7B shape, 16 on the 3B, 8
on the 0.5B, in the order of the losses. The kernel now loads the pages unconditionally and puts
the new key in where it stages the tile; **that version has not run on a GPU yet** (the session's
device time was spent), so the head_dim rule stands until an A/B (``raon`` against ``raoff`` in
``benchmarks/wgsl_gemv_ab.sh``) says otherwise. ``LLMCHAT_WGSL_ROPE_APPEND=on`` fuses every
head_dim, ``off`` none (part of the library cache key).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from app.inference.pipelines.cuda_rope_append import (
    FUSED_ATTR,
    _qkv_producers,
    mark_fused,
    rope_append_funcs,
)

#: the switch: ``on`` fuses every head_dim, ``off`` keeps TVM's split-rotary and append launches
#: for one token, unset (``auto``) fuses head_dims up to :data:`AUTO_MAX_HEAD_DIM`
SWITCH = "LLMCHAT_WGSL_ROPE_APPEND"
#: the widest head ``auto`` fuses (module docstring: measured faster at 64, slower at 128)
AUTO_MAX_HEAD_DIM = 64
#: the add-on's packed function the q/k/v projection's host code calls with its output
RECORD_QKV = "llmchat.webgpu.record_qkv"


def mode() -> str:
    """``auto`` (unset), ``on`` or ``off`` (``LLMCHAT_WGSL_ROPE_APPEND``; ``0``/``no``/``false``
    mean off, ``1``/``yes``/``true`` on)."""
    raw = os.environ.get(SWITCH, "").strip().lower()
    if raw in ("off", "0", "no", "false"):
        return "off"
    return "on" if raw in ("on", "1", "yes", "true") else "auto"


def enabled() -> bool:
    """Whether the fusion may be made (not ``LLMCHAT_WGSL_ROPE_APPEND=off``)."""
    return mode() != "off"


@dataclass
class Plan:
    """What :func:`mark` found, for :func:`record_pass` after the schedules: the names of the
    PrimFuncs whose output is a q/k/v projection the attention reads."""

    producers: set[str] = field(default_factory=set)


def _is_prim_func(func: Any) -> bool:
    from tvm import tirx

    return isinstance(func, tirx.PrimFunc)


def mark(mod: Any, plan: Plan, max_threads: int, shared_bytes: int, variant: str) -> Any:
    """``mod`` with split-rotary and append launching only for more than one token, the decode
    attention marked fused and ``plan.producers`` filled; ``mod`` unchanged where that is not
    safe (module docstring)."""
    from app.inference.pipelines.wgsl_attention import split_decode_attention

    funcs = rope_append_funcs(mod) if variant.startswith("split-v2") else None
    if funcs is None:
        return mod
    attention = mod[funcs[2]]
    q = attention.params[0]
    head_dim = int(q.shape[-1]) if hasattr(q, "shape") and len(q.shape) == 3 else 0
    if mode() == "auto" and not 0 < head_dim <= AUTO_MAX_HEAD_DIM:
        return mod
    fused_attention = attention.with_attr(FUSED_ATTR, True)
    if split_decode_attention(fused_attention, max_threads, shared_bytes, variant) is None:
        return mod
    producers = _qkv_producers(mod, records=_is_prim_func)
    if not producers:
        return mod
    plan.producers = {gv.name_hint for gv in producers}
    return mark_fused(mod, funcs)


def mark_pass(plan: Plan, max_threads: int, shared_bytes: int, variant: str) -> Any:
    """Module pass: :func:`mark` (after the fusions, before the attention pass and the schedules)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="llmchat_wgsl_mark_rope_append")
    def _pass(mod: Any, _ctx: Any) -> Any:
        return mark(mod, plan, max_threads, shared_bytes, variant)

    return _pass


def record(func: Any) -> Any:
    """``func`` with a host-side call of :data:`RECORD_QKV` on its output (its last parameter)
    before its body."""
    from tvm import tirx

    call = tirx.Evaluate(tirx.call_packed(RECORD_QKV, func.params[-1]))
    return func.with_body(tirx.SeqStmt([call, func.body]))


def record_pass(plan: Plan) -> Any:
    """Module pass: :func:`record` on the PrimFuncs :func:`mark` named (after the schedules)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="llmchat_wgsl_record_qkv")
    def _pass(mod: Any, _ctx: Any) -> Any:
        targets = [gv for gv in mod.functions if gv.name_hint in plan.producers]
        if not targets:
            return mod
        mod = mod.clone()
        for gv in targets:
            mod.update_func(gv, record(mod[gv]))
        return mod

    return _pass
