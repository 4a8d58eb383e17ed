"""Models on Vulkan (TVM's WGSL through llmchat's WebGPU device API; lavapipe in CI) against the
float64 numpy reference: the tiny model of every family and weight format, same tolerances and
same greedy tokens as the CPU tests; multi-turn KV reuse, rollback and greedy decoding batched
on the device; the default model's greedy replies against the CPU engine's."""

from __future__ import annotations

import numpy as np
import pytest

from app.inference.engine.tvm_engine import load_engine
from tests.inference.backends.vulkan_env import need_vulkan
from tests.inference.reference import check_engine_against_reference

CASES = [
    # family, quantization, relative tolerance (float16 compute on the GPU, as on CUDA); q4f16_1's
    # decode GEMVs round the activations to int8 per 32 values (pipelines/wgsl_q4_gemv.py, as
    # llama.cpp's q8_1): the tiny llama's decode logits then differ by up to 1.2-1.3e-2 of the
    # largest (lavapipe, session 10), against under 1e-2 with float activations
    ("llama", "q4f32_1", 1e-4),
    ("llama", "q4f16_1", 2e-2),
    ("qwen2", "q4f32_1", 1e-4),
    ("qwen2", "q4f16_1", 1e-2),
    ("qwen2", "q0f16", 1e-2),
    ("llama3", "q0f32", 1e-4),
    ("llama-mha", "q4f32_1", 1e-4),  # the key-parallel decode attention, as Llama-2-7B's
    ("llama-mha", "q4f16_1", 2e-2),  # ... with RoPE and the KV append fused into it
]
PROMPT_LEN = 45  # two prefill chunks of the tiny models
DECODE_STEPS = 16


@pytest.fixture(autouse=True)
def _vulkan():
    need_vulkan()


@pytest.mark.parametrize(("family", "quantization", "tol"), CASES, ids=[f"{f}-{q}" for f, q, _ in CASES])
def test_logits_match_reference_on_vulkan(tiny_model_dir, family, quantization, tol):
    model_dir = tiny_model_dir(family, quantization)
    check_engine_against_reference(model_dir, "vulkan", tol, PROMPT_LEN, DECODE_STEPS)


def test_greedy_batches_rollback_and_kv_reuse_on_vulkan(tiny_model_dir):
    """Greedy decoding with the library's argmax on the device (ids fed back without a round
    trip), a rollback of unused steps, and a second turn that reuses the KV cache: every logit
    equals a fresh prefill of the same tokens."""
    from app.inference.backends import webgpu

    model_dir = tiny_model_dir("llama", "q4f32_1")
    engine = load_engine(model_dir, device="vulkan")
    try:
        rt = engine.runtime
        assert rt.has_device_argmax, "the Vulkan library should export the device argmax"
        prompt = list(range(5, 25))
        first = rt.prefill(prompt)
        t0 = int(np.argmax(first))
        before = webgpu.stats(rt.device.index)
        picked = rt.decode_greedy_ahead(t0, 8)
        after = webgpu.stats(rt.device.index)
        assert after["readbacks"] - before["readbacks"] == 1, "8 greedy steps should read back once"
        # host argmax, one step at a time, from a fresh prefill
        rt2 = load_engine(model_dir, device="vulkan").runtime
        logits = rt2.prefill(prompt)
        host = []
        tok = int(np.argmax(logits))
        for _ in range(8):
            logits = rt2.decode(tok)
            tok = int(np.argmax(logits))
            host.append(tok)
        assert picked == host
        # roll back 3 unused steps: the cache equals prompt + t0 + picked[:4]
        rt.popn(3)
        assert rt.kv_sequence_length() == len(prompt) + 5
        second_turn = [7, 8, 9]
        got = rt.prefill(second_turn)
        rt2.clear()
        want = rt2.prefill([*prompt, t0, *picked[:4], *second_turn])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["llama-d128", "qwen2-d64", "llama-mha-d128"])
def test_the_gpu_suites_engine_checks_on_vulkan(tiny_model_dir, name):
    """The GPU suite's Vulkan checks (tests/gpu/test_engine_vulkan.py) on its small models, here on
    lavapipe: head_dim 128 and 64, grouped and multi-head attention, a second turn on the kept
    KV cache, a 1,000-token prompt over several chunks. (Session 24 found TVM's merge of two
    partial softmaxes wrong on lavapipe through them: the suite had only run on the H200.)"""
    import json

    from tests.gpu.test_engine_vulkan import MODELS, run_engine_checks

    family, overrides = MODELS[name]
    model_dir = tiny_model_dir(family, "q4f16_1", **overrides)
    vocab = json.loads((model_dir / "mlc-chat-config.json").read_text())["vocab_size"]
    engine = load_engine(model_dir, device="vulkan")
    try:
        assert engine.runtime.has_device_argmax
        run_engine_checks(engine, model_dir, vocab, name)
    finally:
        engine.close()


@pytest.mark.parametrize("vocab", [1, 7, 255, 256, 257, 1000, 49152, 151936])
def test_workgroup_argmax_matches_numpy_first_index_on_ties(vocab, tmp_path):
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines.gpu_argmax import argmax_kernel

    func = argmax_kernel(vocab).with_attr("global_symbol", "argmax")
    target = tvm.target.Target({"kind": "webgpu", "host": "llvm"})
    lib = tvm.compile(tvm.IRModule({"argmax": func}), target=target)
    lib.export_library(str(tmp_path / "argmax.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "argmax.so"))
    dev = webgpu.device(0)
    rng = np.random.default_rng(vocab)
    cases = [rng.standard_normal(vocab).astype("float32")]
    tied = rng.integers(-3, 3, vocab).astype("float32")  # many ties of the maximum
    cases.append(tied)
    last = np.full(vocab, -1e30, "float32")
    last[-1] = 5.0
    cases.append(last)
    for logits in cases:
        out = tvm.runtime.empty((1,), "int32", dev)
        lib["argmax"](tvm.runtime.tensor(logits.reshape(1, 1, vocab), dev), out)
        assert int(out.numpy()[0]) == int(np.argmax(logits))


def test_the_chats_generation_loop_on_vulkan_gives_the_host_argmax_tokens(tiny_model_dir, monkeypatch):
    """generate(): greedy batches queued ahead of the one being read (read back behind queued
    work through the add-on's read-back slots) — the same tokens as numpy's argmax step by step.
    A batch lasts AHEAD_BURST_S of steps; that is set long here, so that the batches' lengths (and
    the read-back count below) do not depend on how busy the machine is (CI, 4 workers on 2 cores:
    22 read-backs for 40 steps with the real 33 ms)."""
    import threading

    from app.inference.api import SamplingParams
    from app.inference.backends import webgpu
    from app.inference.engine import generation
    from app.inference.engine.generation import GenerationResult, generate

    monkeypatch.setattr(generation, "AHEAD_BURST_S", 60.0)

    engine = load_engine(tiny_model_dir("qwen2", "q4f16_1"), device="vulkan")
    try:
        rt = engine.runtime
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        steps = 40
        before = webgpu.stats(rt.device.index)
        result = GenerationResult()
        for _ in generate(
            rt,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=steps + 1),
            kv_ids=[],
            cancel=threading.Event(),
            result=result,
        ):
            pass
        after = webgpu.stats(rt.device.index)
        rt.clear()
        logits = rt.prefill(prompt)
        host = [int(np.argmax(logits))]
        for _ in range(steps):
            host.append(int(np.argmax(rt.decode(host[-1]))))
        assert result.token_ids[: steps + 1] == host[: steps + 1]
        # ids came back in batches, not one read back per token
        assert after["readbacks"] - before["readbacks"] < steps // 2
    finally:
        engine.close()


@pytest.mark.parametrize("case", ["max_tokens", "stop_token", "cancel"])
def test_stopping_inside_queued_batches_leaves_exactly_the_conversation_on_vulkan(tiny_model_dir, case):
    """Two greedy batches in flight (the ids read behind queued work): a reply that stops inside
    them rolls every unused step back; the KV cache then equals a fresh prefill of what was kept."""
    import threading

    from app.inference.api import SamplingParams
    from app.inference.engine.generation import GenerationResult, generate

    engine = load_engine(tiny_model_dir("llama", "q4f32_1"), device="vulkan")
    try:
        rt = engine.runtime
        assert rt.reads_behind_queued_work
        prompt = [1, 5, 9, 2]
        rt.clear()
        first = GenerationResult()
        for _ in generate(
            rt,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=30),
            kv_ids=[],
            cancel=threading.Event(),
            result=first,
            greedy_ahead=4,
        ):
            pass
        stop_ids = (first.token_ids[9],) if case == "stop_token" else ()

        class CancelAfter(threading.Event):
            checks = 7

            def is_set(self) -> bool:
                self.checks -= 1
                return self.checks < 0

        rt.clear()
        kv_ids: list[int] = []
        result = GenerationResult()
        for _ in generate(
            rt,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=12),
            kv_ids=kv_ids,
            cancel=CancelAfter() if case == "cancel" else threading.Event(),
            stop_token_ids=stop_ids,
            result=result,
            greedy_ahead=4,
        ):
            pass
        assert rt.sequence_length == len(kv_ids) == rt.kv_sequence_length()
        assert result.token_ids == first.token_ids[: len(result.token_ids)]
        cont = rt.decode(3)
        rt.clear()
        np.testing.assert_allclose(cont, rt.prefill([*kv_ids, 3]), rtol=1e-4, atol=1e-4)
    finally:
        engine.close()


@pytest.mark.parametrize(("k", "eps"), [(8, 1e-5), (896, 1e-6), (2048, 1e-6), (4096, 1e-5), (8192, 1e-5)])
def test_workgroup_rms_norm_matches_float64(k, eps, tmp_path):
    """The WGSL RMSNorm (pipelines/wgsl_rms_norm.py) on a real Vulkan driver against float64,
    and the rule takes exactly TVM's rms_norm PrimFunc of that row."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines.cuda_rms_norm import reference_rms_norm
    from app.inference.pipelines.wgsl_rms_norm import WgslRmsNorm

    target = tvm.target.Target({"kind": "webgpu", "host": "llvm"})
    func = reference_rms_norm(k, eps).with_attr("global_symbol", "rms_norm")
    sch = WgslRmsNorm().apply(func, target, False)
    assert sch is not None, "the rule did not take TVM's rms_norm"
    lib = tvm.compile(tvm.IRModule({"rms_norm": sch.mod["main"]}), target=target)
    lib.export_library(str(tmp_path / "rms_norm.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "rms_norm.so"))
    dev = webgpu.device(0)
    rng = np.random.default_rng(k)
    for scale in (1.0, 30.0, 1e-3):
        x = (rng.standard_normal((1, 1, k)) * scale).astype("float16")
        w = rng.uniform(0.5, 1.5, k).astype("float16")
        x64 = x.astype(np.float64)
        want = x64 / np.sqrt((x64**2).mean() + eps) * w.astype(np.float64)
        out = tvm.runtime.empty((1, 1, k), "float16", dev)
        lib["rms_norm"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev), out)
        got = out.numpy().astype(np.float64)
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
        assert err < 2e-3, f"k={k} scale={scale}: relative error {err:.2e}"
