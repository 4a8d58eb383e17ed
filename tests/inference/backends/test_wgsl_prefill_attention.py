"""llmchat's prompt attention for WGSL (``pipelines/wgsl_prefill_attention``): TVM's
``batch_prefill_ragged_kv`` replaced by llmchat's kernel, compiled to WGSL and run on a real Vulkan
driver (lavapipe in CI) against a float64 numpy reference (output and base-2 log-sum-exp),
causal and not, several sequences in one batch, grouped heads; and the pass in a model's pipeline."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.inference.backends.vulkan_env import need_vulkan
from tests.inference.test_cpu_attention import PAGE, _paged_cache, _reference

CASES = [
    # query heads, kv heads, head_dim, rows of each sequence
    (4, 2, 64, [1, 16, 37]),  # one row, half a tile, across tiles
    (9, 3, 64, [1, 33, 100]),  # SmolLM2-135M's heads (group 3)
    (14, 2, 64, [300]),  # Qwen2.5-0.5B's (group 7), ten tiles
    (16, 2, 128, [1, 33, 517]),  # Qwen2.5-3B's (group 8)
    (8, 8, 128, [64, 5]),  # Llama's plain multi-head, a whole number of tiles
]


@pytest.fixture(scope="module")
def webgpu_target():
    need_vulkan()
    import tvm

    from app.inference.backends import webgpu

    return tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}))


@pytest.mark.parametrize(
    ("h_qo", "h_kv", "d", "lengths"), CASES, ids=[f"{c[0]}x{c[1]}-d{c[2]}" for c in CASES]
)
def test_prefill_attention_matches_float64_reference(webgpu_target, tmp_path, h_qo, h_kv, d, lengths):
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines import wgsl_vector_params
    from app.inference.pipelines.wgsl_prefill_attention import prefill_kernel, shared_bytes

    assert shared_bytes(d) <= int(webgpu_target.attrs["max_shared_memory_per_block"])
    dev = webgpu.device(0)
    wgsl_vector_params.install()  # as every WebGPU build of llmchat's
    func = prefill_kernel(h_qo, h_kv, d).with_attr("global_symbol", "main")
    tvm.compile(tvm.IRModule({"main": func}), target=webgpu_target).export_library(str(tmp_path / "a.so"))
    kernel = tvm.runtime.load_module(str(tmp_path / "a.so"))["main"]
    rng = np.random.default_rng(h_qo * d + len(lengths))
    total = sum(lengths)
    q = rng.standard_normal((total, h_qo, d)).astype("float16")
    k = rng.standard_normal((total, h_kv, d)).astype("float16")
    v = rng.standard_normal((total, h_kv, d)).astype("float16")
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype("int32")

    def t(a):
        return tvm.runtime.tensor(a, dev)

    for causal in (1, 0):
        out = t(np.full(q.shape, np.nan, "float16"))
        lse = t(np.full(q.shape[:2], np.nan, "float32"))
        zeros_q, zeros_b = t(np.zeros(total, "int32")), t(np.zeros(len(lengths), "int32"))
        scalars = (causal, 0, 1.0, 1e4, d**-0.5)  # causal, rotary_mode, rope scale and theta, sm_scale
        kernel(t(q), t(indptr), t(k), t(v), t(indptr), zeros_q, zeros_b, out, lse, *scalars)
        got, got_lse = out.numpy().astype(np.float64), lse.numpy()
        for b, (lo, hi) in enumerate(itertools.pairwise(indptr)):
            ref, ref_lse = _reference(q[lo:hi], k[lo:hi], v[lo:hi], causal)
            err = np.abs(got[lo:hi] - ref).max()
            assert err <= 3e-3 * max(1.0, np.abs(ref).max()), (b, causal, err)
            assert np.abs(got_lse[lo:hi] - ref_lse).max() <= 1e-3, (b, causal)


PAGED_CASES = [
    # query heads, kv heads, head_dim, keys in the cache and queries of each sequence
    (4, 2, 64, [16, 17, 1, 33], [1, 5, 20, 3]),  # a page exactly, one past it, one key, two pages
    (9, 3, 64, [100, 0], [7, 2]),  # SmolLM2-135M's heads; a sequence with nothing cached
    (16, 2, 128, [300, 45], [40, 33]),  # Qwen2.5-3B's, ten key tiles
]


@pytest.mark.parametrize(
    ("h_qo", "h_kv", "d", "kv_lengths", "q_lengths"),
    PAGED_CASES,
    ids=[f"{c[0]}x{c[1]}-d{c[2]}" for c in PAGED_CASES],
)
def test_paged_prefill_attention_matches_float64_reference(
    webgpu_target, tmp_path, h_qo, h_kv, d, kv_lengths, q_lengths
):
    """A chunk's queries against the keys already in the cache's scattered pages (the KV cache
    calls it not causal; causal too where a sequence has as many keys as queries or more); unused
    slots hold NaN, as stale memory may; no cached key gives zeros and TVM's -5e4."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines import wgsl_vector_params
    from app.inference.pipelines.wgsl_prefill_attention import prefill_kernel

    dev = webgpu.device(0)
    wgsl_vector_params.install()
    func = prefill_kernel(h_qo, h_kv, d, paged=True, page=PAGE).with_attr("global_symbol", "main")
    tvm.compile(tvm.IRModule({"main": func}), target=webgpu_target).export_library(str(tmp_path / "p.so"))
    kernel = tvm.runtime.load_module(str(tmp_path / "p.so"))["main"]
    rng = np.random.default_rng(d + sum(kv_lengths))
    pages, page_indptr, page_values, last, keys, vals = _paged_cache(rng, "float16", h_kv, kv_lengths, d)
    q_indptr = np.concatenate([[0], np.cumsum(q_lengths)]).astype("int32")
    q = rng.standard_normal((q_indptr[-1], h_qo, d)).astype("float16")

    def t(a):
        return tvm.runtime.tensor(a, dev)

    for causal in (0, 1):
        out = t(np.full(q.shape, np.nan, "float16"))
        lse = t(np.full(q.shape[:2], np.nan, "float32"))
        zeros_b, zeros_q = t(np.zeros(len(kv_lengths), "int32")), t(np.zeros(len(q), "int32"))
        buffers = (t(q), t(q_indptr), t(pages), t(page_indptr), t(page_values), t(last), zeros_b, zeros_q)
        kernel(*buffers, out, lse, causal, 0, 1.0, 1e4, d**-0.5)
        got, got_lse = out.numpy().astype(np.float64), lse.numpy()
        for b, (lo, hi) in enumerate(itertools.pairwise(q_indptr)):
            if kv_lengths[b] == 0:
                assert np.all(got[lo:hi] == 0) and np.all(got_lse[lo:hi] == -5e4), b
                continue
            if causal and hi - lo > kv_lengths[b]:
                continue  # more queries than keys: a shape the cache never asks for causally
            ref, ref_lse = _reference(q[lo:hi], keys[b], vals[b], causal)
            err = np.abs(got[lo:hi] - ref).max()
            assert err <= 3e-3 * max(1.0, np.abs(ref).max()), (b, causal, err)
            assert np.abs(got_lse[lo:hi] - ref_lse).max() <= 1e-3, (b, causal)


def test_supported_shapes_and_workgroup_memory():
    from app.inference.pipelines.wgsl_prefill_attention import shared_bytes, supported

    assert shared_bytes(128) <= 32768  # lavapipe's and WebGPU's common 32 KiB limit
    assert supported(32, 32, 128, "float16", 49152)  # Llama-2-7B
    assert supported(14, 2, 64, "float16", 16384) is False  # 64-dim tiles need 18.4 KiB
    assert supported(14, 2, 64, "float16", 32768)
    assert not supported(8, 8, 96, "float16", 49152)  # head_dim not 64 or 128
    assert not supported(8, 8, 64, "float32", 49152)
    assert not supported(6, 4, 64, "float16", 49152)  # query heads not whole groups


def test_pass_replaces_the_prompt_attention_of_a_model():
    """The GPU pipeline's attention passes on a webgpu target swap SmolLM2-135M's prompt attention
    kernels (head_dim 64, RopeMode.NORMAL; the chunk's own keys and the cache's pages) for llmchat's
    with TVM's signatures; a module whose KV cache applies RoPE inside attention keeps TVM's."""
    import tvm
    from tvm import relax

    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config
    from app.inference.pipelines import gpu
    from app.inference.pipelines.cuda_attention import PAGED_PREFILL_ATTENTION, PREFILL_ATTENTION
    from tests.inference.backends.test_webgpu_attention import _profile_target

    target = _profile_target("wgsl-f16-wg32768-t256")
    mod, _ = export_model(preset_config("smollm2-135m", "q4f16_1"), target)
    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.FuseTIR()])(mod)
        new = tvm.transform.Sequential(gpu.attention_passes(target))(mod)
        alone = tvm.IRModule({PREFILL_ATTENTION: mod[PREFILL_ATTENTION]})
        from app.inference.pipelines.wgsl_prefill_attention import prefill_attention_pass

        plain = prefill_attention_pass(32768)(alone)
    for symbol in (PREFILL_ATTENTION, PAGED_PREFILL_ATTENTION):  # the chunk's own keys, the cache's
        old_f, new_f = mod[symbol], new[symbol]
        assert [str(p) for p in new_f.params] == [str(p) for p in old_f.params]
        assert str(new_f.attrs["global_symbol"]) == symbol
        assert "alpha" in new_f.script() and "alpha" not in old_f.script()
    assert plain[PREFILL_ATTENTION].same_as(mod[PREFILL_ATTENTION])  # no NORMAL-RoPE KV cache: kept
