"""An independent numpy float64 forward pass of the Llama / Qwen2 decoders, for checking the engine.

It reads the raw ``mlc-chat-config.json`` and the stored tensors itself and dequantizes MLC's
q4 layout with its own code; nothing here calls the engine's model or quantization modules.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def dequant_q4(q_weight: np.ndarray, q_scale: np.ndarray) -> np.ndarray:
    """MLC q4f*_1: 8 nibbles per uint32 (element 8w+r in bits 4r..4r+3), value (nibble-7)*scale/32."""
    rows, words = q_weight.shape
    out = np.empty((rows, words * 8), np.float64)
    for r in range(8):
        out[:, r::8] = ((q_weight >> np.uint32(4 * r)) & np.uint32(0xF)).astype(np.float64) - 7.0
    scale = np.repeat(q_scale.astype(np.float64), 32, axis=1)[:, : words * 8]
    return out * scale


def dense(params: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    """The float64 matrix stored under ``prefix`` (``.weight`` or ``.q_weight`` + ``.q_scale``)."""
    if prefix + ".weight" in params:
        return params[prefix + ".weight"].astype(np.float64)
    return dequant_q4(params[prefix + ".q_weight"], params[prefix + ".q_scale"])


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.astype(np.float64)


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """RoPE inverse frequencies, with Hugging Face's piecewise 'llama3' scaling."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) != "llama3":
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on ``x [seq, heads, dim]``."""
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def forward(config: dict[str, Any], params: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] of a causal forward over ``ids`` from position 0."""
    mc = config["model_config"]
    qwen = config["model_type"] == "qwen2"
    hq, hkv = mc["num_attention_heads"], mc["num_key_value_heads"]
    d = mc.get("head_dim") or mc["hidden_size"] // hq
    inter = mc["intermediate_size"]
    eps = mc["rms_norm_eps"]
    theta = mc.get("position_embedding_base") or mc.get("rope_theta") or 10000.0
    inv = inv_frequencies(d, theta, mc.get("rope_scaling"))
    s = len(ids)
    pos = np.arange(s)
    table = dense(params, "model.embed_tokens")
    h = table[np.asarray(ids)]
    mask = np.triu(np.full((s, s), -np.inf), 1)
    qkv_name = "c_attn" if qwen else "qkv_proj"
    for i in range(mc["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, params[p + "input_layernorm.weight"], eps)
        qkv = x @ dense(params, p + f"self_attn.{qkv_name}").T
        if p + f"self_attn.{qkv_name}.bias" in params:
            qkv = qkv + params[p + f"self_attn.{qkv_name}.bias"].astype(np.float64)
        qkv = qkv.reshape(s, hq + 2 * hkv, d)
        q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        q, k = rope(q, pos, inv), rope(k, pos, inv)
        group = hq // hkv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        att = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", att, v).reshape(s, hq * d)
        h = h + o @ dense(params, p + "self_attn.o_proj").T
        x = rms_norm(h, params[p + "post_attention_layernorm.weight"], eps)
        gu = x @ dense(params, p + "mlp.gate_up_proj").T
        g, u = gu[:, :inter], gu[:, inter:]
        h = h + (g / (1.0 + np.exp(-g)) * u) @ dense(params, p + "mlp.down_proj").T
    h = rms_norm(h, params["model.norm.weight"], eps)
    head = table if mc.get("tie_word_embeddings") else dense(params, "lm_head")
    return h @ head.T


def check_engine_against_reference(
    model_dir: Any, device: str, tol: float, prompt_len: int = 45, decode_steps: int = 16
) -> None:
    """Load the model at ``model_dir`` on ``device``; its logits for a prompt of ``prompt_len``
    random tokens (several prefill chunks of the tiny models) and ``decode_steps`` greedy decode
    steps must be within ``tol`` (relative to the largest logit) of :func:`forward`'s, with the
    same greedy tokens wherever the reference's top two differ by more than the tolerance."""
    import json
    from pathlib import Path

    from app.inference.engine.tvm_engine import load_engine
    from app.inference.store.weights import load_numpy

    config = json.loads((Path(model_dir) / "mlc-chat-config.json").read_text())
    params = load_numpy(model_dir)
    engine = load_engine(model_dir, device=device)
    try:
        assert engine.info.backend == device.split(":")[0]
        rt = engine.runtime
        prompt = np.random.default_rng(3).integers(0, config["vocab_size"], size=prompt_len).tolist()
        logits = [rt.prefill(prompt)]
        tokens = list(prompt)
        for _ in range(decode_steps):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(rt.decode(tokens[-1]))
        assert rt.kv_sequence_length() == prompt_len + decode_steps
    finally:
        engine.close()
    ref = forward(config, params, tokens)[prompt_len - 1 :]
    got = np.stack(logits)
    scale = np.abs(ref).max()
    rel = np.abs(got - ref).max(axis=1) / scale
    assert rel[0] <= tol, f"prefill logits off by {rel[0]:.2e} (relative)"
    assert rel.max() <= tol, f"decode logits off by {rel.max():.2e} (relative) at step {int(rel.argmax())}"
    for step in range(decode_steps):
        top2 = np.sort(ref[step])[-2:]
        if top2[1] - top2[0] > 2 * tol * scale:
            assert tokens[prompt_len + step] == int(np.argmax(ref[step])), f"greedy token differs at {step}"
