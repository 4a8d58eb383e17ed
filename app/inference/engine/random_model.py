"""Models with random weights of real architectures' shapes, for benchmarks without downloads.

``load_random_engine("llama2-7b", "q4f16_1", device="cuda")`` builds an engine whose weights are
drawn on the host (fast: slices of one random pool per dtype) and uploaded; it has no tokenizer,
so only ``generate(..., detokenize=False)`` works.  ``random_params`` is also what the tests use
to make tiny models (``exact=True``: quantize proper Gaussian weights).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from app.errors import LlmchatError
from app.inference.api import EngineInfo, ProgressCallback, ProgressEvent
from app.inference.store.config import ModelConfig

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "position_embedding_base": 10000.0,
        "context_window_size": 2048,
    },
    "llama2-7b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "position_embedding_base": 10000.0,
        "context_window_size": 4096,
    },
    "llama3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "position_embedding_base": 500000.0,
        "context_window_size": 8192,
    },
    "llama3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 16,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-5,
        "position_embedding_base": 500000.0,
        "tie_word_embeddings": True,
        "context_window_size": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen2.5-3b": {
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_hidden_layers": 36,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "context_window_size": 32768,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "num_hidden_layers": 24,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "context_window_size": 32768,
    },
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "position_embedding_base": 100000.0,
        "tie_word_embeddings": True,
        "context_window_size": 8192,
    },
}


def preset_config(
    name: str, quantization: str, context_window: int | None = None, prefill_chunk: int = 2048
) -> ModelConfig:
    """The ``ModelConfig`` of preset ``name`` stored as ``quantization``."""
    if name not in PRESETS:
        raise LlmchatError(f"Unknown architecture preset {name!r}.", f"use one of: {', '.join(PRESETS)}")
    mc = dict(PRESETS[name])
    model_type = mc.pop("model_type")
    ctx = context_window or min(mc["context_window_size"], 4096)
    mc["context_window_size"] = ctx
    return ModelConfig.from_dict(
        {
            "model_type": model_type,
            "quantization": quantization,
            "model_config": mc,
            "vocab_size": mc["vocab_size"],
            "context_window_size": ctx,
            "prefill_chunk_size": min(prefill_chunk, ctx),
        },
        source=f"preset {name}",
    )


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _in_features(cfg: ModelConfig, prefix: str) -> int:
    """Input dimension of the weight under ``prefix`` (embedding: its row length)."""
    if prefix.endswith("down_proj"):
        return cfg.intermediate_size
    if prefix.endswith("o_proj"):
        return cfg.num_attention_heads * cfg.head_dim
    return cfg.hidden_size


def random_params(
    cfg: ModelConfig, specs: list[dict[str, Any]], seed: int = 0, exact: bool = True
) -> dict[str, np.ndarray]:
    """Random weights for ``specs`` (name -> array, in order).

    ``exact``: Gaussian float weights (std 1/sqrt(fan_in)) encoded with each weight's format,
    so the numpy reference sees sensible values; otherwise quick slices of random pools."""
    from app.inference.quantization import get_format

    rng = np.random.default_rng(seed)
    by_prefix: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        prefix, _, _suffix = spec["name"].rpartition(".")
        by_prefix.setdefault(prefix, []).append(spec)
    out: dict[str, np.ndarray] = {}
    pools: dict[str, np.ndarray] = {}
    for prefix, group in by_prefix.items():
        names = {s["name"].rpartition(".")[2]: s for s in group}
        if exact and not _is_norm(group[0]["name"]):
            fmt = get_format(cfg.format_name_for(prefix))
            main = names.get("q_weight") or names.get("weight") or group[0]
            in_f = _in_features(cfg, prefix)
            std = 1.0 if "embed_tokens" in prefix else 1.0 / math.sqrt(in_f)
            encoded = fmt.quantize(rng.standard_normal((main["shape"][0], in_f)) * std)
            for suffix, spec in names.items():
                if suffix == "bias":
                    out[spec["name"]] = (0.1 * rng.standard_normal(spec["shape"])).astype(spec["dtype"])
                else:
                    out[spec["name"]] = np.ascontiguousarray(encoded[suffix]).astype(spec["dtype"])
            continue
        for suffix, spec in names.items():
            shape, dtype = tuple(spec["shape"]), spec["dtype"]
            if _is_norm(spec["name"]):
                arr = (1.0 + 0.1 * rng.standard_normal(shape)) if exact else np.ones(shape)
                out[spec["name"]] = arr.astype(dtype)
                continue
            n = int(np.prod(shape))
            if dtype not in pools:
                pools[dtype] = (
                    rng.integers(0, 2**32, size=1 << 22, dtype=np.uint32)
                    if dtype == "uint32"
                    else (rng.standard_normal(1 << 22) * 0.02).astype(dtype)
                )
            pool = pools[dtype]
            arr = np.tile(pool, math.ceil(n / pool.size))[:n] if n > pool.size else pool[:n]
            if suffix == "q_scale":
                arr = (np.abs(arr.astype(np.float32)) * 0.05 + 1e-3).astype(dtype)
            out[spec["name"]] = arr.reshape(shape)
    return {s["name"]: out[s["name"]] for s in specs}


def load_random_engine(
    preset: str,
    quantization: str,
    device: str = "auto",
    context_window: int | None = None,
    progress: ProgressCallback | None = None,
    seed: int = 0,
    arch: str | None = None,
) -> Any:
    """An engine (no tokenizer) for preset ``preset`` with random weights on ``device``."""
    import tvm

    from app.inference.compile.compiler import get_library
    from app.inference.engine.runtime import ModelRuntime
    from app.inference.engine.tvm_engine import TVMEngine
    from app.inference.hardware.device_spec import resolve_device, tvm_device

    cfg = preset_config(preset, quantization, context_window)
    spec = resolve_device(device)
    compiled = get_library(cfg, spec, arch=arch, progress=progress)
    dev = tvm_device(spec)
    if progress:
        progress(ProgressEvent("load", f"drawing random weights for {preset}"))
    arrays = random_params(cfg, compiled.params, seed=seed, exact=False)
    params, weight_bytes = [], 0
    for p in compiled.params:
        arr = np.ascontiguousarray(arrays.pop(p["name"]))
        params.append(tvm.runtime.tensor(arr, device=dev))
        weight_bytes += arr.nbytes
    itemsize = compiled.kv_itemsize
    runtime = ModelRuntime(
        str(compiled.lib_path),
        dev,
        params,
        hidden_size=cfg.hidden_size,
        model_dtype=compiled.compute_dtype,
        context_window=cfg.context_window_size,
        prefill_chunk=cfg.prefill_chunk_size,
        kv_bytes_per_token=2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize,
        weight_bytes=weight_bytes,
    )
    info = EngineInfo(
        model_id=f"random:{preset}",
        model_path="",
        backend=spec.backend,
        device=str(spec),
        quantization=quantization,
        context_window=cfg.context_window_size,
        weight_bytes=weight_bytes,
    )
    return TVMEngine(info, cfg, runtime, tokenizer=None, formatter=None)
