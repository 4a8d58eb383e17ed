"""A decoded token's RoPE and KV append inside llmchat's WGSL decode attention (WebGPU/Vulkan).

For every layer TVM's paged KV cache launches three kernels when one token is decoded:
split-rotary (q, k, v out of the fused projection, RoPE on q and k), transpose-append (k and v
into their page slot) and the attention. On NVIDIA's Vulkan driver each costs a few µs whatever
it does (about 2.1 µs of GPU time between dependent dispatches, more in the GPU profile), so the
first two cost about as much as a small GEMV. The CUDA
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

**On by default, every head_dim.** The first fused kernels chose between the page and the new
key with a select around each page load, which TVM's WGSL writes as a branch (32 loads a thread
behind their own branch on the 7B shape), and were slower at head_dim 128 (session 14,
benchmarks/results/h200-2026-12-03-s14/ab5.tgz: Qwen2.5-3B 356.1 fused against 374.8, Llama-2-7B
215.7 against 258.7). The kernel now loads the pages unconditionally and puts the new key in where
it stages the tile. H200, NVIDIA's Vulkan driver, bench protocol, decode tok/s, one device call
(benchmarks/results/h200-2026-12-03-s15/call2): Qwen2.5-3B 401.1 fused against 380.9 / 374.0
(``cur`` before and after), Llama-2-7B 264.4 against 263.1 / 262.4; with the vector quantized once
(``int8-q8`` of :mod:`.wgsl_fusion`) 410.9 against 387.7 and 294.0 against 295.6. The 0.5B (head
dim 64) measured 806.8 fused against 762.2 in session 14. ``LLMCHAT_WGSL_ROPE_APPEND=off`` keeps
TVM's two launches (part of the library cache key).
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

#: the switch: ``off`` keeps TVM's split-rotary and append launches for one token; unset or ``on``
#: fuses them (module docstring)
SWITCH = "LLMCHAT_WGSL_ROPE_APPEND"
#: the add-on's packed function the q/k/v projection's host code calls with its output
RECORD_QKV = "llmchat.webgpu.record_qkv"


def mode() -> str:
    """``on`` (unset, ``on``, ``1``, ...) or ``off`` (``LLMCHAT_WGSL_ROPE_APPEND=off``;
    ``0``/``no``/``false`` too)."""
    raw = os.environ.get(SWITCH, "").strip().lower()
    return "off" if raw in ("off", "0", "no", "false") else "on"


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
