"""The engine on Vulkan, end to end (tests/gpu/engine_checks.py): the tiny random-weight models of
tests/gpu/test_engine_cuda.py built with llmchat's WGSL pipeline and run through llmchat's WebGPU
device API on wgpu-native (``--device vulkan``: NVIDIA's Vulkan driver on the GPU machine, Mesa's
lavapipe on a machine without a GPU); their logits against the numpy float64 reference, greedy
tokens picked on the device against numpy's argmax, a second turn on the kept KV cache against a
fresh prefill, and a long prompt over several prefill chunks.

From a prebuilt cache (``LLMCHAT_GPU_TEST_CACHE``, ``make test-gpu-prebuilt``) the libraries are
only loaded, never compiled, and a cache built for another adapter profile fails with the command
that rebuilds it (tests/gpu/prebuilt.py ``--wgsl-profile``)."""

from __future__ import annotations

import json

import pytest

from app.inference.engine.tvm_engine import load_engine
from tests.gpu import engine_checks
from tests.gpu.test_engine_cuda import LONG_MODELS, LONG_PROMPT, LONG_STEPS
from tests.gpu.test_engine_cuda import MODELS as CUDA_MODELS

pytestmark = pytest.mark.gpu

#: float16 compute and int8-rounded activations in the q4f16_1 decode GEMVs
#: (pipelines/wgsl_q4_gemv.py): the relative tolerance of the lavapipe tests for q4f16_1
#: (tests/inference/backends/test_webgpu_engine.py), here per row of logits; on the H200 the
#: llama-d128 and llama-long models measured 1.13e-2 and 1.06e-2 with it (session 10)
REFERENCE_TOL = 2e-2

#: CUDA's models, a multi-head one (a KV head a query head) and ones with rows of 2,048 (Qwen2.5-3B's
#: width) and 4,096 (Llama-2-7B's layer: its widths, heads and head_dim): their norms keep no kernel
#: of their own, the o and down projections write the vector for them (``pipelines/wgsl_fusion.py``,
#: ``q8n``), where CUDA's narrower models compute the norm inside each GEMV
MODELS = {
    **CUDA_MODELS,
    # Llama-2-style multi-head attention with head_dim 128 (Llama-2-7B's): decode attention on the
    # key-parallel kernel (pipelines/wgsl_attention_keys.py), chunks and the merge over 1,000 keys
    "llama-mha-d128": (
        "llama",
        {
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "context_window": 1024,
            "prefill_chunk": 256,
        },
    ),
    "llama-w2048": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 2816,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "context_window": 1024,
            "prefill_chunk": 256,
        },
    ),
    "llama-w4096": (
        "llama",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "context_window": 1024,
            "prefill_chunk": 256,
        },
    ),
}


#: models of MODELS built and run with kernel switches (part of the library's key, so the cache
#: holds both libraries): name -> (model, environment). The prompt GEMM's fp16 sums
#: (``LLMCHAT_WGSL_GEMM=f16``, pipelines/wgsl_q4_gemm.py) on Llama-2-7B's layer widths
SWITCHED = {"llama-w4096-f16-gemm": ("llama-w4096", {"LLMCHAT_WGSL_GEMM": "f16"})}


def _load(vulkan, name: str, model_dir):
    vulkan.check_library(name)
    events: list = []
    engine = load_engine(model_dir, device="vulkan", progress=events.append)
    # llmchat's own WGSL pipeline built it (no fall-back to TVM's stock pipeline), with its argmax
    assert not any("stock pipeline" in e.message for e in events), [e.message for e in events]
    assert engine.runtime.has_device_argmax
    return engine


@pytest.mark.parametrize("name", [*MODELS, *SWITCHED])
def test_engine_logits_greedy_tokens_and_kv_reuse(vulkan, tiny_model_dir, monkeypatch, name):
    model, switches = SWITCHED.get(name, (name, {}))
    family, overrides = MODELS[model]
    model_dir = tiny_model_dir(family, "q4f16_1", **overrides)
    vocab = json.loads((model_dir / "mlc-chat-config.json").read_text())["vocab_size"]
    monkeypatch.delenv("LLMCHAT_TVM_PIPELINE", raising=False)
    for switch, value in switches.items():
        monkeypatch.setenv(switch, value)
    engine = _load(vulkan, name, model_dir)
    try:
        print(f"{name} on {vulkan.name} ({vulkan.profile}):")
        run_engine_checks(engine, model_dir, vocab, name)
    finally:
        engine.close()


def run_engine_checks(engine, model_dir, vocab: int, name: str) -> None:
    """Logits against float64, the device's greedy tokens, a second turn on the kept KV cache
    against a fresh prefill, a 1,000-token prompt (also run on lavapipe in CI for the small models:
    tests/inference/backends/test_webgpu_engine.py)."""
    err = engine_checks.check_against_reference(engine, model_dir, REFERENCE_TOL)
    print(f"{name}: max relative error against float64: {err:.2e}")
    engine_checks.check_device_greedy(engine)
    err = engine_checks.check_kv_reuse(engine, vocab, REFERENCE_TOL)
    print(f"{name}: second turn on the kept KV cache against a fresh prefill: {err:.2e}")
    long_err = engine_checks.check_long_context(engine, model_dir, 1000, 8, REFERENCE_TOL)
    print(f"{name}: 1,000-token prompt + 8 steps: {long_err:.2e}")


@pytest.mark.parametrize("name", list(LONG_MODELS))
def test_long_prompt_over_several_chunks(vulkan, tiny_model_dir, monkeypatch, name):
    """A 4,500-token prompt (chunks of 2,048, 2,048 and 404 tokens: the later ones attend to the
    cached pages), then greedy steps over its keys: the logits against the float64 reference and
    the device's greedy batches against numpy's argmax."""
    family, overrides = LONG_MODELS[name]
    model_dir = tiny_model_dir(family, "q4f16_1", **overrides)
    vocab = json.loads((model_dir / "mlc-chat-config.json").read_text())["vocab_size"]
    monkeypatch.delenv("LLMCHAT_TVM_PIPELINE", raising=False)
    engine = _load(vulkan, name, model_dir)
    try:
        err = engine_checks.check_long_context(engine, model_dir, LONG_PROMPT, LONG_STEPS, REFERENCE_TOL)
        print(f"{name}: {LONG_PROMPT:,}-token prompt + {LONG_STEPS} steps against float64: {err:.2e}")
        prompt = engine_checks.long_prompt(vocab, LONG_PROMPT, seed=12)
        tokens = engine_checks.check_device_greedy(engine, steps=12, start=prompt)
        print(f"{name}: greedy after {LONG_PROMPT:,} tokens: {len(set(tokens))} distinct of {len(tokens)}")
    finally:
        engine.close()
