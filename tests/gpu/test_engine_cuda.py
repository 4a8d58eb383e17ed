"""The engine on the GPU, end to end (tests/gpu/engine_checks.py): small random-weight models built
with llmchat's CUDA pipeline (every kernel of cuda_kernels.cu, the fused RoPE/append and SiLU·mul,
CUDA graphs), their logits against the numpy float64 reference and against TVM's plain pipeline
(``LLMCHAT_TVM_PIPELINE=default``), and greedy tokens picked on the device against numpy's argmax."""

from __future__ import annotations

import json

import pytest

from app.inference.engine.tvm_engine import load_engine
from tests.gpu import engine_checks

pytestmark = pytest.mark.gpu

#: (family, overrides): head dim 128 with grouped kv heads (Llama-style, decode and prompt attention
#: of the big models' head size), and a Qwen2-style model (q/k/v bias, tied embeddings, head dim 64,
#: four query heads per kv head); prompts in chunks of 256, up to 1,024 tokens
MODELS = {
    "llama-d128": (
        "llama",
        {
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "context_window": 1024,
            "prefill_chunk": 256,
        },
    ),
    "qwen2-d64": (
        "qwen2",
        {
            "hidden_size": 256,
            "intermediate_size": 640,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "context_window": 1024,
            "prefill_chunk": 256,
        },
    ),
}
#: a prompt over several chunks of the real models' size (2,048): the chunks after the first attend
#: to the cached pages (llmchat::prefill_paged_attention), the last one to 6,144 keys; head dim 128,
#: four query heads per kv head (Llama-3-8B's group): its decode steps over 6,500 keys take the
#: tensor-core kernel with the fused RoPE/append (cuda_attention.py: from 3,072 keys for fewer than
#: 8 kv heads on sm_90, 32 chunks for its one kv head), qwen2-d64's (at most 1,024 keys) the
#: cluster kernel
LONG_MODELS = {
    "llama-long": (
        "llama",
        {
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "context_window": 8192,
            "prefill_chunk": 2048,
        },
    ),
}
LONG_PROMPT, LONG_STEPS = 6500, 12
#: float16 compute with half-precision partial sums: the tolerance of the CPU's float16 path
#: (tests/inference/test_engine_correctness.py), doubled
REFERENCE_TOL = 2e-2
PLAIN_PIPELINE_TOL = 1e-2


@pytest.mark.parametrize("name", list(MODELS))
def test_engine_logits_and_greedy_tokens(cuda, tiny_model_dir, monkeypatch, name):
    family, overrides = MODELS[name]
    model_dir = tiny_model_dir(family, "q4f16_1", **overrides)
    vocab = json.loads((model_dir / "mlc-chat-config.json").read_text())["vocab_size"]
    monkeypatch.delenv("LLMCHAT_TVM_PIPELINE", raising=False)
    events: list = []
    engine = load_engine(model_dir, device="cuda", progress=events.append)
    try:
        # llmchat's own pipeline built it (no fall-back to TVM's stock pipeline), with its argmax
        assert not any("stock pipeline" in e.message for e in events), [e.message for e in events]
        assert engine.runtime.has_device_argmax
        err = engine_checks.check_against_reference(engine, model_dir, REFERENCE_TOL)
        print(f"{name}: max relative error against float64: {err:.2e}")
        engine_checks.check_device_greedy(engine)
        long_err = engine_checks.check_long_context(engine, model_dir, 1000, 8, REFERENCE_TOL)
        print(f"{name}: 1,000-token prompt + 8 steps: {long_err:.2e}")
        monkeypatch.setenv("LLMCHAT_TVM_PIPELINE", "default")
        plain = load_engine(model_dir, device="cuda")
        try:
            assert not plain.runtime.has_device_argmax  # really TVM's stock pipeline
            err = engine_checks.check_against_engine(engine, plain, vocab, PLAIN_PIPELINE_TOL)
            print(f"{name}: max relative error against TVM's plain pipeline: {err:.2e}")
        finally:
            plain.close()
    finally:
        engine.close()


@pytest.mark.parametrize("name", list(LONG_MODELS))
def test_long_prompt_over_several_chunks(cuda, tiny_model_dir, monkeypatch, name):
    """A 6,500-token prompt (chunks of 2,048, 2,048, 2,048 and 356 tokens: the later ones attend to the
    cached pages), then greedy steps over its keys: the logits against the float64 reference and
    against TVM's plain pipeline, and the device's greedy batches against numpy's argmax (queued
    steps after a prompt of this length crashed before cuda_readback.StepFence)."""
    family, overrides = LONG_MODELS[name]
    model_dir = tiny_model_dir(family, "q4f16_1", **overrides)
    vocab = json.loads((model_dir / "mlc-chat-config.json").read_text())["vocab_size"]
    monkeypatch.delenv("LLMCHAT_TVM_PIPELINE", raising=False)
    monkeypatch.delenv("LLMCHAT_CUDA_PAGED_PREFILL", raising=False)
    events: list = []
    engine = load_engine(model_dir, device="cuda", progress=events.append)
    try:
        assert not any("stock pipeline" in e.message for e in events), [e.message for e in events]
        assert engine.runtime.has_device_argmax
        err = engine_checks.check_long_context(engine, model_dir, LONG_PROMPT, LONG_STEPS, REFERENCE_TOL)
        print(f"{name}: {LONG_PROMPT:,}-token prompt + {LONG_STEPS} steps against float64: {err:.2e}")
        prompt = engine_checks.long_prompt(vocab, LONG_PROMPT, seed=12)
        tokens = engine_checks.check_device_greedy(engine, steps=24, start=prompt)
        print(f"{name}: greedy after {LONG_PROMPT:,} tokens: {len(set(tokens))} distinct of {len(tokens)}")
        monkeypatch.setenv("LLMCHAT_TVM_PIPELINE", "default")
        plain = load_engine(model_dir, device="cuda")
        try:
            assert not plain.runtime.has_device_argmax  # really TVM's stock pipeline
            err = engine_checks.check_long_context_against_engine(
                engine, plain, vocab, LONG_PROMPT, LONG_STEPS, PLAIN_PIPELINE_TOL
            )
            print(f"{name}: against TVM's plain pipeline: {err:.2e}")
        finally:
            plain.close()
    finally:
        engine.close()
