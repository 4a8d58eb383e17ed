"""The decode RMSNorm kernel rule on CUDA: which PrimFuncs it takes (TVM's own rms_norm of one
float16 row, with its epsilon) and which it leaves. The kernel itself runs in the GPU suite
(tests/gpu: ``make test-gpu``), against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from app.inference.pipelines.cuda_rms_norm import CudaRmsNorm, match_rms_norm, reference_rms_norm

CUDA_TARGET = {
    "kind": "cuda",
    "arch": "sm_90",
    "max_shared_memory_per_block": 49152,
    "max_threads_per_block": 1024,
    "thread_warp_size": 32,
    "host": {"kind": "llvm"},
}


def _fused(build):
    """The PrimFuncs TVM's passes make of the Relax function ``build(bb, x, w)``."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, tvm.tirx.Var("n", "int64"), 896), "float16"))
    w = relax.Var("w", relax.TensorType((896,), "float16"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x, w))
        bb.emit_func_output(out)
    passes = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    mod = tvm.transform.Sequential(passes)(bb.get())
    return [f for gv, f in mod.functions.items() if gv.name_hint != "main"]


def _model_norms(preset: str, **overrides):
    """The PrimFuncs of the model's module after FuseTIR (what llmchat's rules see), by name:
    built from the model's own export, independently of :func:`reference_rms_norm`."""
    import dataclasses

    from tvm import relax

    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config

    target = tvm.target.Target(CUDA_TARGET)
    cfg = dataclasses.replace(preset_config(preset, "q4f16_1"), **overrides)
    mod, _ = export_model(cfg, target)
    passes = [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(passes)(mod)
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def _run_on_cpu(func, *arrays):
    """``func`` compiled for the CPU, run on ``arrays`` (inputs, then the output's zeros)."""
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    lib["main"](*tensors)
    return tensors[-1].numpy()


@pytest.mark.parametrize(("k", "eps"), [(64, 1e-5), (128, 1e-6)])
def test_takes_the_models_decode_norm_with_its_epsilon(k, eps):
    """The rule takes exactly the decode step's norms of a real model (one float16 row, the
    config's epsilon), and what it takes computes RMSNorm: the model's function, compiled for the
    CPU, against numpy's float64 RMSNorm with the epsilon the rule found."""
    funcs = _model_norms("tiny-llama", hidden_size=k, rms_norm_eps=eps)
    found = {name: match_rms_norm(f) for name, f in funcs.items()}
    taken = sorted(name for name, m in found.items() if m is not None)
    assert taken, f"no norm taken among {sorted(funcs)}"
    assert all(found[name] == (k, pytest.approx(eps)) for name in taken)
    assert all("rms_norm" in name for name in taken)
    # the prompt's norms ([1, n, K], a shape variable) keep TVM's kernel
    assert any("rms_norm" in name and found[name] is None for name in funcs)
    rng = np.random.default_rng(k)
    w = (1 + 0.5 * rng.standard_normal(k)).astype(np.float16)
    # rows of ordinary size, and rows so small that the epsilon weighs as much as their mean square
    for scale in (3.0, 3 * np.sqrt(eps)):
        x = (scale * rng.standard_normal((1, 1, k))).astype(np.float16)
        x64, w64 = x.astype(np.float64), w.astype(np.float64)
        expected = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w64
        for name in taken:
            got = _run_on_cpu(funcs[name], x, w, np.zeros((1, 1, k), np.float16)).astype(np.float64)
            np.testing.assert_allclose(
                got,
                expected,
                rtol=2e-3,
                atol=2e-3 * np.abs(expected).max(),
                err_msg=f"{name}, rows of scale {scale:.1e}",
            )
    for name in taken:
        new = CudaRmsNorm().replace(funcs[name])
        script = new.script()
        assert f"llmchat::rms_norm_row<{k}>" in script
        assert f'T.launch_thread("threadIdx.x", {(k // 8 + 31) // 32 * 32})' in script
        assert 'T.launch_thread("blockIdx.x", 1)' in script


def test_leaves_prompt_rows_other_work_and_odd_sizes_alone():
    from tvm import relax

    # a prompt's norm ([1, n, K]) keeps TVM's kernel
    (prompt,) = _fused(lambda bb, x, w: bb.emit(relax.op.nn.rms_norm(x, w, axes=[-1], epsilon=1e-5)))
    assert match_rms_norm(prompt) is None
    # a norm fused with more work is not a plain norm
    assert match_rms_norm(reference_rms_norm(4096, 1e-5).with_body(reference_rms_norm(64, 1e-5).body)) is None
    # rows that do not split into 16-byte loads
    assert match_rms_norm(reference_rms_norm(100, 1e-5)) is None
    assert CudaRmsNorm().is_target_available(tvm.target.Target(CUDA_TARGET))
    assert not CudaRmsNorm().is_target_available(tvm.target.Target("llvm"))
