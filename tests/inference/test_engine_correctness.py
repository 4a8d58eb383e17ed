"""Tiny random-weight models of each family and weight format against the numpy float64 reference:
logits of a (chunked) prefill and of 16 greedy decode steps, and the greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from app.inference.store.weights import load_numpy
from tests.inference.reference import check_engine_against_reference

CASES = [
    # family, quantization, compute dtype (None: the engine's choice), relative tolerance
    ("llama", "q4f32_1", None, 1e-4),
    # float16 models compute in float32 on CPUs (weights stay float16): as exact as q4f32_1
    ("llama", "q4f16_1", None, 1e-4),
    # ... and in float16 on GPUs: forced here to cover that path on the CPU
    ("llama", "q4f16_1", "float16", 1e-2),
    ("qwen2", "q4f32_1", None, 1e-4),
    ("qwen2", "q4f16_1", None, 1e-4),
    ("qwen2", "q0f16", "float16", 1e-2),
    ("llama3", "q0f32", None, 1e-4),  # Llama-3.1-style RoPE scaling
]
PROMPT_LEN = 45  # longer than the tiny models' prefill chunk (32): two prefill chunks
DECODE_STEPS = 16


@pytest.mark.parametrize(
    ("family", "quantization", "compute", "tol"),
    CASES,
    ids=[f"{f}-{q}-{c or 'auto'}" for f, q, c, _ in CASES],
)
def test_logits_match_reference(tiny_model_dir, monkeypatch, family, quantization, compute, tol):
    if compute:
        monkeypatch.setenv("LLMCHAT_COMPUTE_DTYPE", compute)
    check_engine_against_reference(tiny_model_dir(family, quantization), "cpu", tol, PROMPT_LEN, DECODE_STEPS)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_long_prompt_and_decode_after_it_match_reference(tiny_model_dir, family):
    """A prompt of 200 tokens: 7 prefill chunks of 32 (each attends to its own keys and to the
    earlier chunks' keys in the cache, then merges the two) over 13 KV pages of 16, with chunk and
    page boundaries not aligned (32 and 16 divide 200 unevenly); then 40 decode steps, to 240
    tokens of context (15 pages). GQA ratios 2 (llama) and 4 (qwen2)."""
    check_engine_against_reference(tiny_model_dir(family, "q4f32_1"), "cpu", 1e-4, 200, 40)


def test_quantized_weights_are_really_quantized(tiny_model_dir):
    """The q4 model stores MLC's layout: uint32 words [out, in/8] and one scale per 32 inputs."""
    params = load_numpy(tiny_model_dir("llama", "q4f16_1"))
    assert params["model.norm.weight"].dtype == np.float16
    qkv = params["model.layers.0.self_attn.qkv_proj.q_weight"]
    scale = params["model.layers.0.self_attn.qkv_proj.q_scale"]
    assert qkv.dtype == np.uint32 and qkv.shape == ((4 + 2 * 2) * 16, 64 // 8)
    assert scale.dtype == np.float16 and scale.shape == (128, 64 // 32)
    assert "lm_head.q_weight" in params and "model.embed_tokens.q_weight" in params
    tied = load_numpy(tiny_model_dir("qwen2", "q4f32_1"))
    assert not any(n.startswith("lm_head") for n in tied)
    assert tied["model.layers.0.self_attn.c_attn.bias"].shape == ((4 + 2) * 16,)
