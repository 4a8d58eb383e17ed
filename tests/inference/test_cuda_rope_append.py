"""A decoded token's RoPE and KV append inside llmchat's decode attention (sm_90): which functions
the pass marks, the code they become, and when it leaves a module alone. The kernels run on the
H200 only: ``benchmarks/gpu_decode.py run`` checks logits and tokens against TVM's own pipeline."""

from __future__ import annotations

import dataclasses

import pytest
import tvm

from app.inference.compile.build import export_model
from app.inference.engine.random_model import preset_config
from app.inference.pipelines import cuda_rope_append as cra
from app.inference.pipelines import gpu, gpu_choices
from app.inference.pipelines.cuda_kernels import RECORD_QKV_ATTR

CUDA_TARGET = {
    "kind": "cuda",
    "arch": "sm_90",
    "max_shared_memory_per_block": 49152,
    "max_threads_per_block": 1024,
    "thread_warp_size": 32,
    "host": {"kind": "llvm"},
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _fused_tir(preset: str = "tiny-llama", arch: str = "sm_90", **overrides):
    """The model's module after FuseTIR (the state llmchat's Relax passes see), and its target."""
    from tvm import relax

    target = tvm.target.Target({**CUDA_TARGET, "arch": arch})
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
        return tvm.transform.Sequential(passes)(mod), target


def _marked(mod, attr):
    return {
        gv.name_hint: f.attrs[attr]
        for gv, f in mod.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and attr in f.attrs
    }


@pytest.mark.parametrize("preset", ["tiny-llama", "qwen2.5-0.5b"])  # qwen2: q/k/v with a bias
def test_marks_the_qkv_matmuls_the_kv_kernels_and_the_attention(preset):
    mod, target = _fused_tir(preset)
    assert gpu_choices.fuse_rope_append(target)
    marked = cra.mark_rope_append(mod)
    # the decode GEMV and the prompt GEMM that compute the fused q/k/v projection record it
    recorders = _marked(marked, RECORD_QKV_ATTR)
    assert len(recorders) == 2
    kinds = sorted("gemv" if cra.match_q4f16_gemv(marked[name]) else "gemm" for name in recorders)
    assert kinds == ["gemm", "gemv"]
    # split-rotary (tokens: its qkv, parameter 0) and append (its k, parameter 1) skip one token
    assert {k: int(v) for k, v in _marked(marked, cra.SKIP_SINGLE_ATTR).items()} == {
        cra.SPLIT_ROTARY: 0,
        cra.TRANSPOSE_APPEND: 1,
    }
    assert list(_marked(marked, cra.FUSED_ATTR)) == [cra.DECODE_ATTENTION]
    # nothing else changed: the same functions, the same calls
    assert {gv.name_hint for gv in marked.functions} == {gv.name_hint for gv in mod.functions}


def test_skipped_kernels_run_only_for_more_than_one_token():
    mod, _ = _fused_tir()
    marked = cra.mark_rope_append(mod)
    for name, param in ((cra.SPLIT_ROTARY, 0), (cra.TRANSPOSE_APPEND, 1)):
        func = marked[name]
        skipped = cra.skip_single_token(func)
        assert isinstance(skipped.body, tvm.tirx.IfThenElse) and skipped.body.else_case is None
        cond = skipped.body.condition
        assert cond.b.value == 1 and cond.a.same_as(func.params[param].shape[0])
        assert skipped.body.then_case.same_as(func.body)
    assert cra.skip_single_token(marked[cra.DECODE_ATTENTION]) is None


def test_cuda_source_has_the_recording_matmuls_and_the_fused_attention():
    from app.inference.compile import cuda_support

    target = tvm.target.Target(CUDA_TARGET)
    mod, _ = export_model(preset_config("tiny-llama", "q4f16_1"), target)
    with cuda_support.cuda_build_hooks(target) as info, tvm.transform.PassContext(opt_level=3):
        tvm.compile(mod, target, relax_pipeline=gpu.gpu_pipeline(target))
    src = info["sources"][0]
    # the recording in the source of the GEMV and of both prompt GEMMs (WMMA and mma.sync)
    assert src.count("fused_qkv_src = out;") == 3
    # tiny-llama: 4 query heads, 2 kv heads, head_dim 16: qkv has (4 + 2 * 2) * 16 = 128 outputs
    assert "llmchat::q4f16_gemv<64, 128, 4, 1, 1, false, half, true>" in src
    assert "llmchat::q4f16_gemm<64, 128, 64, 1, false, half, true>" in src
    assert "llmchat::decode_attention<4, 2, 16, 16, 16, 1, 8, true, true>" in src
    # prompts still split, rotate and append through TVM's kernels
    assert "fused_rope_kernel" in src and "tir_kv_cache_transpose_append_kernel" in src


def test_left_alone_with_rope_scaling_or_without_clusters():
    mod, target = _fused_tir(rope_scaling=LLAMA3_SCALING)
    assert gpu_choices.fuse_rope_append(target)
    assert cra.mark_rope_append(mod) is mod  # the split-rotary kernel is not TVM's default RoPE
    mod, target = _fused_tir(arch="sm_80")
    assert not gpu_choices.fuse_rope_append(target)  # the fused attention was run with clusters only


def test_left_alone_when_an_attention_input_is_not_a_recording_matmul(monkeypatch):
    mod, _ = _fused_tir()
    # TVM's own GEMV (LLMCHAT_GPU_GEMV=tvm) cannot record: the whole module stays as it is
    monkeypatch.setattr(cra, "_records", lambda func: False)
    assert cra.mark_rope_append(mod) is mod
    monkeypatch.setenv("LLMCHAT_GPU_GEMV", "tvm")
    assert not gpu_choices.fuse_rope_append(tvm.target.Target(CUDA_TARGET))
