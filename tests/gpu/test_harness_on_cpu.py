"""The GPU suite's harness on the CPU (part of ``make test``): the same kernel cases (inputs,
argument order, numpy float64 references, checks) run through TVM's own CPU functions, and every
CUDA case is built for sm_90 (llmchat's rules must take each function; nvcc is not needed for
that). The engine's end-to-end checks (tests/gpu/engine_checks.py) run here on the CPU pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm

from app.inference.pipelines import cuda_gemm
from tests.gpu import kernels

#: targets (made in the tests: collecting this file under a runtime-only TVM, which cannot make
#: one, must work: tests/gpu/prebuilt.py)
SM90 = {
    "kind": "cuda",
    "arch": "sm_90",
    "max_shared_memory_per_block": 49152,
    "max_threads_per_block": 1024,
    "thread_warp_size": 32,
    "host": {"kind": "llvm"},
}


def _cpu():
    return tvm.target.Target("llvm")


def small_cases() -> list[kernels.Case]:
    """Small shapes of every kernel family (the CPU runs TVM's unscheduled functions)."""
    return [
        kernels.gemv_case(32, 4, "f32"),
        kernels.gemv_case(96, 12, "f16"),
        kernels.gemv_case(128, 64, "bias"),
        kernels.gemv_case(256, 32, "res"),
        kernels.silu_gate_case(64, 64),
        kernels.gemm_case(96, 64, "f16", rows=(1, 65)),
        kernels.gemm_case(128, 128, "res", rows=(3,)),
        kernels.gemm_case(256, 3072, "bias", rows=(3, 2689)),  # sm_90: the mma.sync kernel from 2,689 rows
        kernels.gemm_case(64, 64, "f32", rows=(2,)),
        kernels.argmax_case(1),
        kernels.argmax_case(1000),
        kernels.rms_norm_case(8, 1e-5),
        kernels.rms_norm_case(896, 1e-6),
        kernels.decode_attention_case(4, 2, 64, [[1], [15, 16, 17], [300]]),
        kernels.prefill_attention_case(
            4,
            2,
            32,
            [([1], [1], True), ([5, 64, 65], [5, 64, 65], True), ([3], [20], True), ([7], [9], False)],
        ),
        kernels.paged_prefill_attention_case(
            4,
            2,
            32,
            [
                ([1], [1], False),
                ([7], [17], False),
                ([3, 65], [1, 300], False),
                ([4, 9], [0, 40], False),
                ([0, 9], [33, 40], False),
                ([33], [100], True),
            ],
        ),
    ]


def test_the_cases_pass_on_tvms_own_cpu_functions(tmp_path):
    cases = small_cases()
    lib = kernels.build(cases, _cpu(), tmp_path)
    assert kernels.run_all(lib, cases, tvm.cpu()) == []


def test_a_wrong_result_is_caught(tmp_path):
    """The checks fail on wrong outputs: each case's runs with one input changed after the
    reference was computed."""
    cases = [
        kernels.gemv_case(96, 12, "f16"),
        kernels.argmax_case(1000),
        kernels.rms_norm_case(64, 1e-5),
        kernels.decode_attention_case(4, 2, 64, [[40]]),
        kernels.prefill_attention_case(4, 2, 32, [([9], [9], True)]),
        kernels.paged_prefill_attention_case(4, 2, 32, [([9], [40], False)]),
    ]
    for case in cases:
        for run in case.runs:
            first = run.args[0]
            if case.name.startswith("argmax"):
                first[..., 17] = 1e38  # a new maximum
            else:
                first[..., 0] += 4  # an input the reference did not see
    lib = kernels.build(cases, _cpu(), tmp_path)
    failures = kernels.run_all(lib, cases, tvm.cpu())
    assert len(failures) == sum(len(c.runs) for c in cases), failures


@pytest.mark.parametrize("with_cluster", [False, True])
def test_every_cuda_case_is_built_from_llmchats_rules(with_cluster):
    """The CUDA side of the suite's cases, for sm_90: each function is llmchat's kernel launch."""
    from tests.gpu.test_cuda_kernels import (
        decode_attention_cases,
        gqa_decode_cases,
        matmul_cases,
        paged_prefill_cases,
        prefill_cases,
        small_op_cases,
    )

    max_cluster = 16 if with_cluster else 0
    sm90 = tvm.target.Target(SM90)
    cases = [
        *matmul_cases(),
        *small_op_cases(),
        *decode_attention_cases(max_cluster),
        *(gqa_decode_cases(max_cluster) if with_cluster else []),
        *prefill_cases(),
        *paged_prefill_cases(),
    ]
    for case in cases:
        script = case.build(sm90).script()
        assert "llmchat::" in script, case.name
        if "_gqa_" in case.name:  # a long-context kernel and the cluster kernel by the keys, or one alone
            heads = 'T.launch_thread("threadIdx.y", 8)'
            assert script.count(heads) == (2 if "_gqa_auto_" in case.name else 1), case.name
            assert ("clusterCtaIdx" in script) == ("_gqa_auto_" in case.name), case.name
            mma = "_128_" in case.name and "_groups_" not in case.name
            long = "decode_attention_mma<" if mma else ", 32, 4, 8, false>"
            assert long in script, case.name
        if case.name.startswith("gemm_"):  # wide layers: the mma.sync kernel too (sm_90)
            k, n = (int(v) for v in case.name.split("_")[1].split("x"))
            assert ("llmchat::q4f16_gemm_mma<" in script) == cuda_gemm.takes_mma(k, n), case.name
    assert len({c.name for c in cases}) == len(cases)


def test_paged_layout_and_reference_agree_with_dense_attention():
    """The paged reference against plain dense attention over the same keys (pages shuffled)."""
    rng = np.random.default_rng(1)
    lengths, h_q, h_kv, d = [33, 16], 4, 2, 8
    pages, indptr, values, last = kernels.paged_kv(lengths, h_kv, d, rng)
    q = rng.standard_normal((2, h_q, d))
    out, lse = kernels.decode_reference(q, pages, indptr, values, lengths, 0.5)
    for b, n in enumerate(lengths):
        rows = [(values[indptr[b] + t // kernels.PAGE], t % kernels.PAGE) for t in range(n)]
        assert last[b] == n - (len(values[indptr[b] : indptr[b + 1]]) - 1) * kernels.PAGE
        for h in range(h_q):
            k = np.array([pages[p, 0, h // 2, s] for p, s in rows], np.float64)
            v = np.array([pages[p, 1, h // 2, s] for p, s in rows], np.float64)
            s = k @ q[b, h] * 0.5
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[b, h], p @ v / p.sum())
            np.testing.assert_allclose(lse[b, h], np.log2(np.exp(s).sum()))


def test_engine_checks_on_the_cpu_pipeline(tiny_model_dir, monkeypatch):
    """The GPU suite's end-to-end checks on the CPU: llmchat's CPU pipeline against the float64
    reference and against TVM's plain pipeline, greedy decoding through every path."""
    from app.inference.engine.tvm_engine import load_engine
    from tests.gpu import engine_checks

    model_dir = tiny_model_dir("llama", "q4f16_1")
    vocab = json.loads((model_dir / "mlc-chat-config.json").read_text())["vocab_size"]
    monkeypatch.delenv("LLMCHAT_TVM_PIPELINE", raising=False)
    engine = load_engine(model_dir, device="cpu")
    try:
        assert engine_checks.check_against_reference(engine, model_dir, 1e-4) > 0
        tokens = engine_checks.check_device_greedy(engine, steps=12)
        assert len(set(tokens)) > 1
        # a second turn after greedy steps on the device and a rollback: as a fresh prefill
        assert engine_checks.check_kv_reuse(engine, vocab, 1e-4) <= 1e-4
        monkeypatch.setenv("LLMCHAT_TVM_PIPELINE", "default")
        plain = load_engine(model_dir, device="cpu")
        try:
            assert engine_checks.check_against_engine(engine, plain, vocab, 1e-4) > 0
            # the long-prompt checks: 200 tokens in 7 chunks of 32, then 4 greedy steps
            assert engine_checks.check_long_context_against_engine(engine, plain, vocab, 200, 4, 1e-4) > 0
            prompt = engine_checks.long_prompt(vocab, 200, seed=12)
            assert len(engine_checks.check_device_greedy(engine, steps=6, start=prompt)) == 6
            # and a check that fails: another model's logits
            other = load_engine(tiny_model_dir("qwen2", "q4f16_1"), device="cpu")
            try:
                with pytest.raises(AssertionError, match="off the other engine"):
                    engine_checks.check_against_engine(engine, other, vocab, 1e-2)
                with pytest.raises(AssertionError, match="long context: logits off the other engine"):
                    engine_checks.check_long_context_against_engine(engine, other, vocab, 100, 2, 1e-2)
            finally:
                other.close()
        finally:
            plain.close()
    finally:
        engine.close()
