"""The decode RMSNorm kernel rule on CUDA: which PrimFuncs it takes (TVM's own rms_norm of one
float16 row, with its epsilon) and which it leaves. The kernel runs on the H200 only:
``benchmarks/gpu_decode.py run`` checks logits and tokens against TVM's own pipeline."""

from __future__ import annotations

import pytest
import tvm

from app.inference.pipelines.cuda_rms_norm import CudaRmsNorm, match_rms_norm, reference_rms_norm

CUDA_TARGET = {"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152,
               "max_threads_per_block": 1024, "thread_warp_size": 32, "host": {"kind": "llvm"}}


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
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    mod = tvm.transform.Sequential(passes)(bb.get())
    return [f for gv, f in mod.functions.items() if gv.name_hint != "main"]


@pytest.mark.parametrize(("k", "eps"), [(4096, 1e-5), (896, 1e-6), (64, 1e-5)])
def test_takes_tvms_rms_norm_of_one_row_with_its_epsilon(k, eps):
    func = reference_rms_norm(k, eps)
    assert match_rms_norm(func) == (k, pytest.approx(eps))
    new = CudaRmsNorm().replace(func)
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
