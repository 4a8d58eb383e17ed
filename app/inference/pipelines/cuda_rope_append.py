"""A decoded token's RoPE and KV append done by llmchat's decode attention kernel (CUDA).

For every layer TVM's paged KV cache runs three kernels when one token is decoded: split-rotary
(q, k, v out of the fused projection, RoPE on q and k), transpose-append (k and v into their
page slot) and the attention; in a CUDA graph each costs ~2-3 us whatever it does. With
:func:`mark_rope_append` (after FuseTIR) and :func:`skip_single_token` (after the schedules):

- the matmul computing each layer's fused q/k/v projection (llmchat's GEMV or prompt GEMM)
  records its output buffer for the attention (:data:`~.cuda_kernels.RECORD_QKV_ATTR`);
- TVM's split-rotary and append PrimFuncs launch their kernels only for more than one token (a
  condition in their host code: a one-token batch is the only one that takes the decode kernel);
- the decode attention PrimFunc is marked (:data:`FUSED_ATTR`), and llmchat's kernel then reads
  q, k and v of the token from the recorded projection, applies RoPE exactly as TVM's kernel
  does and writes the new key and value to their page slot itself.

Only when every attention call of the module takes its q/k/v from such a matmul (through
reshapes, which stay views of its output), the split-rotary and append PrimFuncs are TVM's own
for default RoPE (structurally equal to TVM's constructors; no RoPE scaling) and the cache applies
RoPE (``RopeMode.NORMAL``); otherwise the module is left as it is.
"""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.cuda_gemm import match_q4f16_gemm
from app.inference.pipelines.cuda_gemv import choose_layout, match_q4f16_gemv
from app.inference.pipelines.cuda_kernels import RECORD_QKV_ATTR, prim_func_pass
from app.inference.pipelines.tir_facts import (
    bare_prim_func,
    float_constants,
    root_blocks,
    static_int,
    tir_call,
)

#: PrimFunc attribute of the decode attention: llmchat's kernel does RoPE and the append itself
FUSED_ATTR = "llmchat.fused_rope_append"
#: PrimFunc attribute of split-rotary and append: their kernels run only for more than one token
#: (the attribute's value: the parameter whose buffer's first axis counts the tokens)
SKIP_SINGLE_ATTR = "llmchat.skip_single_token"
#: names TVM's KV cache gives its split-rotary, append and decode attention PrimFuncs
SPLIT_ROTARY = "fused_rope"
TRANSPOSE_APPEND = "tir_kv_cache_transpose_append"
DECODE_ATTENTION = "batch_decode_paged_kv"
ATTENTION_CALL = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
CREATE_CALL = "vm.builtin.paged_attention_kv_cache_create"
#: the create call's argument holding the RoPE mode, and RopeMode.NORMAL's value
ROPE_MODE_ARG = 8
ROPE_NORMAL = 1


def is_default_rope(func: Any) -> bool:
    """Whether ``func`` is TVM's split-rotary PrimFunc for default RoPE (scale 1, full rotary
    dim, no scaling) with some theta: structurally equal to what TVM's constructor builds."""
    import tvm_ffi
    from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map

    if len(func.params) != 6:
        return False
    qkv, _, q, k = func.params[:4]
    if any(not hasattr(b, "shape") or len(b.shape) != 3 for b in (qkv, q, k)):
        return False
    h_q, h_kv, d = static_int(q.shape[1]), static_int(k.shape[1]), static_int(q.shape[2])
    if None in (h_q, h_kv, d) or d % 16:
        return False
    for theta in float_constants(func):
        ref = llama_rope_with_position_map(theta, 1.0, d, h_q, h_kv, str(qkv.dtype), {}, d)
        if tvm_ffi.structural_equal(bare_prim_func(func), bare_prim_func(ref)):
            return True
    return False


def is_plain_append(func: Any) -> bool:
    """Whether ``func`` is TVM's transpose-append PrimFunc (structurally)."""
    import tvm_ffi
    from tvm.relax.frontend.nn.llm._page_kernels import _kv_cache_transpose_append

    if len(func.params) != 4:
        return False
    pages = func.params[0]
    if not hasattr(pages, "shape") or len(pages.shape) != 5:
        return False
    h_kv, page, d = (static_int(x) for x in pages.shape[2:])
    if None in (h_kv, page, d):
        return False
    ref = _kv_cache_transpose_append(h_kv, d, str(pages.dtype), page)
    return bool(tvm_ffi.structural_equal(bare_prim_func(func), bare_prim_func(ref)))


def _packed_call(value: Any, name: str) -> list[Any] | None:
    """The arguments of ``value`` when it calls the packed function ``name``, else None."""
    from tvm import relax

    if not isinstance(value, relax.Call) or len(value.args) < 1:
        return None
    callee = value.args[0]
    if not isinstance(callee, relax.ExternFunc) or str(callee.global_symbol) != name:
        return None
    if len(value.args) == 2 and isinstance(value.args[1], relax.Tuple):
        return list(value.args[1].fields)
    return list(value.args[1:])


def _is_reshape(func: Any) -> bool:
    """Whether ``func`` only reshapes its one input (TVM's check, or FuseOps' chain of reshape
    blocks, which the backend also turns into a view)."""
    from tvm import relax

    if relax.analysis.has_reshape_pattern(func):
        return True
    blocks = root_blocks(func)
    return len(func.params) == 2 and bool(blocks) and all(b.name_hint.startswith("T_reshape") for b in blocks)


def _records(func: Any) -> bool:
    """Whether llmchat's GEMV or GEMM rule will take ``func`` (and can record its output)."""
    m = match_q4f16_gemv(func)
    if m is not None:
        return choose_layout(m.out_features, m.in_features) is not None
    return match_q4f16_gemm(func) is not None


def _qkv_producers(mod: Any, records: Any = None) -> set[Any] | None:
    """The GlobalVars of the matmuls whose outputs the attention calls take, or None when one
    attention call's q/k/v comes from anything else (or there is no attention call). ``records``
    (default: llmchat's CUDA GEMV or GEMM takes it) says whether a PrimFunc can record its output."""
    records = records or _records
    from tvm import relax

    producers: set[Any] = set()
    calls = 0
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for block in func.body.blocks:
            values = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
            for value in values.values():
                args = _packed_call(value, ATTENTION_CALL)
                if args is None:
                    continue
                calls += 1
                source = args[3] if len(args) == 4 else None
                while True:  # through reshapes to the matmul
                    call = tir_call(values.get(source))
                    if call is None:
                        return None
                    callee = mod[call[0]]
                    if len(call[1]) == 1 and _is_reshape(callee):
                        source = call[1][0]
                        continue
                    if not records(callee):
                        return None
                    producers.add(call[0])
                    break
    return producers if calls else None


def _rope_mode_normal(mod: Any) -> bool:
    """Whether the module's KV cache is created with RoPE applied before the cache (NORMAL)."""
    from tvm import relax

    modes = []
    for func in mod.functions.values():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                args = _packed_call(getattr(binding, "value", None), CREATE_CALL)
                if args is not None:
                    mode = args[ROPE_MODE_ARG] if len(args) > ROPE_MODE_ARG else None
                    modes.append(static_int(mode) == ROPE_NORMAL)
    return bool(modes) and all(modes)


def rope_append_funcs(mod: Any) -> tuple[Any, Any, Any] | None:
    """The GlobalVars of the KV cache's split-rotary, append and decode attention PrimFuncs when
    the first two are TVM's own for default RoPE and the cache applies RoPE (``RopeMode.NORMAL``),
    else None: the conditions of any fused RoPE/append (this module's and :mod:`.wgsl_rope_append`)."""
    names = {gv.name_hint: gv for gv in mod.functions}
    kv_funcs = [names.get(n) for n in (SPLIT_ROTARY, TRANSPOSE_APPEND, DECODE_ATTENTION)]
    if any(gv is None for gv in kv_funcs):
        return None
    split_gv, append_gv, attention_gv = kv_funcs
    if not (is_default_rope(mod[split_gv]) and is_plain_append(mod[append_gv]) and _rope_mode_normal(mod)):
        return None
    return split_gv, append_gv, attention_gv


def mark_fused(mod: Any, funcs: tuple[Any, Any, Any]) -> Any:
    """A copy of ``mod`` whose split-rotary and append (``funcs``, :func:`rope_append_funcs`)
    launch only for more than one token and whose decode attention is marked :data:`FUSED_ATTR`."""
    split_gv, append_gv, attention_gv = funcs
    mod = mod.clone()
    # the buffer whose first axis counts the tokens: split-rotary's qkv, append's k
    for gv, tokens_param in ((split_gv, 0), (append_gv, 1)):
        mod.update_func(gv, mod[gv].with_attr(SKIP_SINGLE_ATTR, tokens_param))
    mod.update_func(attention_gv, mod[attention_gv].with_attr(FUSED_ATTR, True))
    return mod


def mark_rope_append(mod: Any) -> Any:
    """``mod`` with the attributes that make one decoded token's RoPE and append part of the
    decode attention (see the module docstring), or ``mod`` unchanged where that is not safe."""
    funcs = rope_append_funcs(mod)
    producers = _qkv_producers(mod) if funcs else None
    if not producers:
        return mod
    mod = mark_fused(mod, funcs)
    for gv in producers:
        mod.update_func(gv, mod[gv].with_attr(RECORD_QKV_ATTR, True))
    return mod


def mark_rope_append_pass() -> Any:
    """Module pass: :func:`mark_rope_append` (after FuseTIR, before the attention and matmul rules)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="llmchat_mark_rope_append")
    def _pass(mod: Any, _ctx: Any) -> Any:
        return mark_rope_append(mod)

    return _pass


def skip_single_token(func: Any) -> Any | None:
    """A PrimFunc marked :data:`SKIP_SINGLE_ATTR` with its body run only for more than one token,
    else None."""
    from tvm import tirx

    if func.attrs is None or SKIP_SINGLE_ATTR not in func.attrs:
        return None
    tokens = func.params[int(func.attrs[SKIP_SINGLE_ATTR])].shape[0]
    return func.with_body(tirx.IfThenElse(tokens > 1, func.body, None))


def skip_single_token_pass() -> Any:
    """Module pass: :func:`skip_single_token` (after the schedules: they need the plain body)."""
    return prim_func_pass("llmchat_skip_single_token", skip_single_token)
