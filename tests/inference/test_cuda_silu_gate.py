"""The gate_up GEMV + SiLU·mul fusion on CUDA: which call pairs it fuses, which it leaves, and the
kernel launch it builds (the kernel's output is checked bit for bit against TVM's SiLU kernel on
the H200: benchmarks/kernels and ``benchmarks/gpu_decode.py run``)."""

from __future__ import annotations

import tvm

from app.inference.pipelines import cuda_silu_gate
from app.inference.quantization import get_format
from app.inference.quantization.base import dequant_matmul_te

K, N = 256, 1024  # a gate_up projection: 512 gate rows, 512 up rows


def _gemv(in_f: int = K, out_f: int = N, fmt_name: str = "q4f16_1"):
    from tvm import te

    fmt = get_format(fmt_name)
    specs = fmt.param_specs(out_f, in_f)
    x = te.placeholder((1, 1, in_f), "float16", name="x")
    params = [te.placeholder(shape, dtype, name=name) for name, (shape, dtype) in specs.items()]
    out = dequant_matmul_te(fmt, list(specs), in_f, out_f, "float16")(x, *params)
    return te.create_prim_func([x, *params, out])


def _module(act: str = "silu", extra_use: bool = False, fmt_name: str = "q4f16_1"):
    """A Relax module with a decode MLP's gate_up GEMV followed by split + act * up, fused by
    TVM's own passes the way the engine's pipeline does before llmchat's passes."""
    from tvm import relax
    from tvm.script import relax as R

    bb = relax.BlockBuilder()
    gemv = bb.add_func(_gemv(fmt_name=fmt_name), "dequant_matmul")
    specs = get_format(fmt_name).param_specs(N, K)
    x = relax.Var("x", R.Tensor((1, 1, K), "float16"))
    weights = [relax.Var(name, R.Tensor(shape, dtype)) for name, (shape, dtype) in specs.items()]
    with bb.function("decode", [x, *weights]):
        with bb.dataflow():
            h = bb.emit(relax.call_tir(gemv, relax.Tuple([x, *weights]), R.Tensor((1, 1, N), "float16")))
            parts = bb.emit(relax.op.split(h, 2, axis=-1))
            gate, up = bb.emit(relax.TupleGetItem(parts, 0)), bb.emit(relax.TupleGetItem(parts, 1))
            activated = bb.emit(relax.op.nn.silu(gate) if act == "silu" else relax.op.nn.gelu(gate))
            y = bb.emit(relax.op.multiply(activated, up))
            if extra_use:
                y = bb.emit(relax.op.add(y, relax.op.strided_slice(h, [2], [0], [N // 2])))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    passes = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    return tvm.transform.Sequential(passes)(mod)


def _callees(mod) -> list[str]:
    return [gv.name_hint for gv in tvm.relax.analysis.all_global_vars(mod["decode"])]


def test_gate_up_gemv_and_silu_become_one_kernel():
    mod = _module()
    before = _callees(mod)
    assert "dequant_matmul" in before and any(n.startswith("fused_split_silu_multiply") for n in before)
    fused = cuda_silu_gate.fuse_silu_gate(mod)
    after = _callees(fused)
    assert after == ["dequant_matmul_silu_gate"]
    func = fused["dequant_matmul_silu_gate"]
    script = func.script()
    # rows 4 per warp (2 gate + 2 up), split-K 2 for 8 groups of 32, SiLU-pairs epilogue (MODE 3)
    assert "llmchat::q4f16_gemv<256, 1024, 4, 1, 3, false, half>" in script
    assert 'T.launch_thread("blockIdx.x", 64)' in script  # 1024 rows / (4 rows x 4 warps)
    assert [list(p.shape) for p in func.params][-1] == [1, 1, N // 2]
    assert func.attrs["tirx.is_scheduled"]
    # the replaced kernels are gone from the module
    names = {gv.name_hint for gv in fused.get_global_vars()}
    assert "dequant_matmul" not in names and not any(n.startswith("fused_split_silu") for n in names)


def test_other_activations_and_shared_outputs_are_left_alone():
    gelu = _module(act="gelu")
    assert cuda_silu_gate.fuse_silu_gate(gelu).same_as(gelu)
    shared = _module(extra_use=True)  # the GEMV's output is read twice: it must stay
    assert "dequant_matmul" in _callees(cuda_silu_gate.fuse_silu_gate(shared))
    unquantized = _module(fmt_name="q0f16")  # not a q4f16_1 GEMV: llmchat's kernel does not take it
    assert cuda_silu_gate.fuse_silu_gate(unquantized).same_as(unquantized)


def test_silu_gate_width_checks_name_shapes_and_body():
    mod = _module()
    gv = next(g for g in mod.get_global_vars() if g.name_hint.startswith("fused_split_silu_multiply"))
    assert cuda_silu_gate.silu_gate_width(gv.name_hint, mod[gv]) == N // 2
    assert cuda_silu_gate.silu_gate_width("fused_split_gelu_multiply", mod[gv]) is None
    assert cuda_silu_gate.silu_gate_width(gv.name_hint, _gemv()) is None
    # the name is not enough: a kernel that computes something else under it is not replaced
    gelu = _module(act="gelu")
    other = next(f for g, f in gelu.functions.items() if g.name_hint.startswith("fused_split_gelu"))
    assert cuda_silu_gate.silu_gate_width("fused_split_silu_multiply", other) is None
