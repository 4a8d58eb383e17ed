"""The decode step's gate_up GEMV and the SiLU·mul after it as one CUDA kernel.

A Llama-style MLP computes ``silu(gate) * up`` from one fused gate_up projection. TVM compiles that
into a GEMV with ``2n`` float16 outputs and a ``fused_split_silu_multiply`` kernel that turns them
into ``n``; in a CUDA graph every such tiny kernel costs ~2-3 us whatever it does.
:func:`fuse_silu_gate_pass` replaces the pair, where the GEMV is a batch-1 ``q4f16_1`` GEMV that
llmchat's kernel takes, by one call of ``llmchat::q4f16_gemv`` in its SiLU-pairs mode (MODE 3:
every warp computes gate rows and the matching up rows and writes ``silu(gate) * up`` in the same
half arithmetic as TVM's kernel; output bit-identical). H200, weights rotating through 32 layers:
Llama-2-7B 14.96 -> 14.24 us, Qwen2.5-3B 9.43 -> 8.35 us, Qwen2.5-0.5B 4.77 -> 3.69 us per layer.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from app.inference.pipelines.cuda_gemv import choose_layout, gemv_launch, match_q4f16_gemv
from app.inference.pipelines.tir_facts import bare_prim_func, static_shape, tir_call

#: how TVM's FuseOps names the kernel of ``silu(split(x)[0]) * split(x)[1]``
SILU_GATE_PREFIX = "fused_split_silu_multiply"
#: the kernel's epilogue mode for SiLU-gated row pairs
SILU_PAIRS_MODE = 3


@cache
def reference_silu_gate(n: int) -> Any:
    """The PrimFunc TVM's own passes make of ``silu(split(h)[0]) * split(h)[1]`` for a float16
    ``[1, 1, 2n]`` tensor ``h``: what a kernel must be, exactly, to be replaced."""
    import tvm
    from tvm import relax

    bb = relax.BlockBuilder()
    h = relax.Var("h", relax.TensorType((1, 1, 2 * n), "float16"))
    with bb.function("main", [h]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(h, 2, axis=-1))
            gate, up = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
            out = bb.emit_output(bb.emit(relax.op.multiply(relax.op.nn.silu(gate), up)))
        bb.emit_func_output(out)
    passes = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    mod = tvm.transform.Sequential(passes)(bb.get())
    return next(f for gv, f in mod.functions.items() if gv.name_hint.startswith(SILU_GATE_PREFIX))


def silu_gate_width(name: str, func: Any) -> int | None:
    """``n`` when ``func`` (called ``name``) is TVM's split-silu-multiply of a float16
    ``[1, 1, 2n]`` tensor into ``[1, 1, n]`` and nothing else (structurally equal to
    :func:`reference_silu_gate`), else None."""
    import tvm_ffi
    from tvm import tirx

    if (
        not isinstance(func, tirx.PrimFunc)
        or not re.fullmatch(SILU_GATE_PREFIX + r"\d*", name)
        or len(func.params) != 2
    ):
        return None
    src, out = func.params
    src_shape, out_shape = static_shape(src), static_shape(out)
    if str(src.dtype) != "float16" or str(out.dtype) != "float16" or src_shape is None or out_shape is None:
        return None
    if len(src_shape) != 3 or len(out_shape) != 3 or src_shape[:2] != [1, 1] or out_shape[:2] != [1, 1]:
        return None
    n = out_shape[2]
    if n == 0 or src_shape[2] != 2 * n:
        return None
    same = tvm_ffi.structural_equal(bare_prim_func(func), bare_prim_func(reference_silu_gate(n)))
    return n if same else None


def silu_gate_func(gemv: Any, out: Any) -> Any | None:
    """A scheduled PrimFunc taking ``gemv``'s inputs and writing the gated ``out`` buffer with one
    kernel launch, or None when ``gemv`` is not a plain float16 q4f16_1 GEMV whose layout pairs rows."""
    from tvm import tirx

    m = match_q4f16_gemv(gemv)
    if m is None or m.bias is not None or m.residual is not None or str(m.out.dtype) != "float16":
        return None
    layout = choose_layout(m.out_features, m.in_features)
    if layout is None or layout.rows_per_warp % 2 or static_shape(out)[-1] * 2 != m.out_features:
        return None
    body = gemv_launch(m, layout, SILU_PAIRS_MODE, out)
    return tirx.PrimFunc([*gemv.params[:3], out], body).with_attr(
        {"tirx.is_scheduled": True, "tirx.noalias": True}
    )


def _fuse_block(block: Any, mod: Any, builder: Any, fused: dict[tuple[str, str], Any]) -> Any | None:
    """``block`` with its GEMV + SiLU pairs fused (new kernels added through ``builder`` and
    remembered in ``fused`` by (GEMV name, SiLU name)), or None when it has none."""
    from tvm import relax

    users = relax.analysis.udchain(block)
    values = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
    bindings, dropped = [], set()
    for binding in block.bindings:
        call = tir_call(binding.value) if isinstance(binding, relax.VarBinding) else None
        if call is None or len(call[1]) != 1 or not silu_gate_width(call[0].name_hint, mod[call[0]]):
            bindings.append(binding)
            continue
        hidden = call[1][0]  # the GEMV's output: a dataflow var read by this call only
        inner = tir_call(values.get(hidden)) if isinstance(hidden, relax.DataflowVar) else None
        if inner is None or len(users.get(hidden, [])) != 1:
            bindings.append(binding)
            continue
        key = (inner[0].name_hint, call[0].name_hint)
        if key not in fused:
            prim = silu_gate_func(mod[inner[0]], mod[call[0]].params[-1])
            fused[key] = prim and builder.add_func(prim, f"{key[0]}_silu_gate")
        if fused[key] is None:
            bindings.append(binding)
            continue
        value = builder.normalize(relax.call_tir(fused[key], relax.Tuple(inner[1]), binding.var.ty))
        bindings.append(relax.VarBinding(binding.var, value))
        dropped.add(hidden)
    if not dropped:
        return None
    return relax.DataflowBlock([b for b in bindings if b.var not in dropped])


def fuse_silu_gate(mod: Any) -> Any:
    """``mod`` with every ``y = silu_gate(gemv(x, w, s))`` in a Relax dataflow block (the GEMV's
    output used by nothing else) turned into one ``call_tir`` of :func:`silu_gate_func`; the
    replaced kernels leave the module where nothing else calls them (prompts have their own)."""
    from app.inference.pipelines.tir_facts import rewrite_dataflow_blocks

    return rewrite_dataflow_blocks(mod, lambda block, builder, fused: _fuse_block(block, mod, builder, fused))


def fuse_silu_gate_pass() -> Any:
    """Module pass: :func:`fuse_silu_gate` (after FuseTIR, before the dlight rules)."""
    import tvm

    @tvm.transform.module_pass(opt_level=0, name="llmchat_fuse_silu_gate")
    def _pass(mod: Any, _ctx: Any) -> Any:
        return fuse_silu_gate(mod)

    return _pass
