"""The model's configuration, read from MLC's ``mlc-chat-config.json``.

``ModelConfig.load(model_dir)`` validates the file and normalises the fields every model family
needs (head_dim, key/value heads, RoPE base and scaling, context window, prefill chunk size).
Unknown ``model_type`` or ``quantization`` raise ``LlmchatError`` listing the supported ones.

Optional extension: ``"tensor_formats": {"<param prefix>": "<weight format>", ...}`` marks the
storage format of individual weights (a GGUF import mixes formats); the longest matching prefix
wins, everything else uses ``quantization``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.errors import LlmchatError

CONFIG_FILE = "mlc-chat-config.json"

#: model_type -> model family implemented in app.inference.models
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    """Architecture and runtime limits of one model."""

    model_type: str
    quantization: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float
    context_window_size: int
    prefill_chunk_size: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    tensor_formats: dict[str, str] = field(default_factory=dict)
    #: dtype of activations / KV cache when it differs from the stored one (CPUs compute f16 models in f32)
    compute_dtype: str | None = None
    #: 8- and 16-bit integer weights stored as uint32 words (same bytes): WGSL has no narrower types
    word_storage: bool = False
    conv_template: Any = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``mlc-chat-config.json`` from ``model_dir``."""
        path = Path(model_dir) / CONFIG_FILE
        if not path.is_file():
            raise LlmchatError(
                f"{path} is missing: {Path(model_dir)} is not an MLC model directory.",
                "download the model again (`llmchat download <id>`) or point --model at a directory "
                f"that contains {CONFIG_FILE}",
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise LlmchatError(f"{path} is not valid JSON ({err}).", "download the model again") from err
        if not isinstance(data, dict):
            raise LlmchatError(f"{path} does not hold a JSON object.", "download the model again")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = CONFIG_FILE) -> ModelConfig:
        """Validate and normalise a parsed ``mlc-chat-config.json``."""
        model_type = str(data.get("model_type", ""))
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LlmchatError(
                f"{source}: model_type {model_type!r} is not supported.",
                f"use a model of a supported family: {', '.join(SUPPORTED_MODEL_TYPES)}",
            )
        quantization = str(data.get("quantization", ""))
        from app.inference.quantization import get_format

        get_format(quantization)  # raises with the list of supported ones
        mc = data.get("model_config")
        if not isinstance(mc, dict):
            raise LlmchatError(f"{source}: the 'model_config' object is missing.", "download the model again")

        def need(key: str, *alts: str) -> Any:
            for k in (key, *alts):
                if k in mc and mc[k] is not None:
                    return mc[k]
            raise LlmchatError(f"{source}: model_config.{key} is missing.", "download the model again")

        def count(name: str, value: Any) -> int:
            return _positive_int(source, name, value)

        hidden = count("model_config.hidden_size", need("hidden_size"))
        heads = count("model_config.num_attention_heads", need("num_attention_heads"))
        kv_heads = count("model_config.num_key_value_heads", _first(mc.get("num_key_value_heads"), heads))
        if mc.get("head_dim") is None and hidden % heads:
            raise LlmchatError(
                f"{source}: model_config.hidden_size {hidden} is not a multiple of "
                f"num_attention_heads {heads} (head_dim = hidden_size / heads).",
                "download the model again",
            )
        head_dim = count("model_config.head_dim", _first(mc.get("head_dim"), hidden // heads))
        if head_dim % 2:
            raise LlmchatError(
                f"{source}: model_config.head_dim {head_dim} is odd (RoPE rotates pairs).",
                "download the model again",
            )
        layers = count("model_config.num_hidden_layers", need("num_hidden_layers"))
        inter = count("model_config.intermediate_size", need("intermediate_size"))
        vocab = count("vocab_size", _first(data.get("vocab_size"), need("vocab_size")))
        eps = _positive_float(
            source,
            "model_config.rms_norm_eps",
            _first(mc.get("rms_norm_eps"), mc.get("layer_norm_epsilon"), 1e-6),
            upper=1.0,
        )
        theta = _positive_float(
            source,
            "model_config.rope_theta",
            _first(mc.get("position_embedding_base"), mc.get("rope_theta"), data.get("rope_theta"), 10000.0),
        )
        ctx_candidates = (
            ("context_window_size", data.get("context_window_size")),
            ("model_config.context_window_size", mc.get("context_window_size")),
            ("model_config.max_position_embeddings", mc.get("max_position_embeddings")),
        )
        ctx_field, ctx_value = next(
            ((name, value) for name, value in ctx_candidates if value is not None and value != -1),
            ("context_window_size", None),
        )
        if ctx_value is None:
            raise LlmchatError(f"{source}: context_window_size is missing.", "download the model again")
        ctx = count(ctx_field, ctx_value)
        chunk = count(
            "prefill_chunk_size",
            _first(data.get("prefill_chunk_size"), mc.get("prefill_chunk_size"), min(ctx, 2048)),
        )
        if heads % kv_heads:
            raise LlmchatError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}.",
                "download the model again",
            )
        rope_scaling = _rope_scaling(mc.get("rope_scaling"), source)
        eos = data.get("eos_token_id")
        eos_ids = [
            _token_id(source, "eos_token_id", e, vocab)
            for e in (eos if isinstance(eos, list) else [] if eos is None else [eos])
        ]
        bos = data.get("bos_token_id")
        bos_id = None if bos is None else _token_id(source, "bos_token_id", bos, vocab)
        conv = data.get("conv_template")
        if isinstance(conv, dict):
            for key in ("stop_token_ids", "system_prefix_token_ids"):
                ids = conv.get(key) or []
                if not isinstance(ids, list):
                    raise LlmchatError(
                        f"{source}: conv_template.{key} must be a list of token ids.",
                        "download the model again",
                    )
                for i in ids:
                    _token_id(source, f"conv_template.{key}", i, vocab)
        tensor_formats = data.get("tensor_formats") or {}
        if not isinstance(tensor_formats, dict):
            raise LlmchatError(f"{source}: 'tensor_formats' must be an object.", "re-import the model")
        for fmt in tensor_formats.values():
            get_format(str(fmt))
        return cls(
            model_type=model_type,
            quantization=quantization,
            hidden_size=hidden,
            intermediate_size=inter,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            num_hidden_layers=layers,
            rms_norm_eps=eps,
            vocab_size=vocab,
            rope_theta=theta,
            context_window_size=ctx,
            prefill_chunk_size=max(1, min(chunk, ctx)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(mc.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(mc.get("attention_bias", False)),
            hidden_act=str(mc.get("hidden_act", "silu")),
            tensor_formats={str(k): str(v) for k, v in tensor_formats.items()},
            conv_template=data.get("conv_template"),
            bos_token_id=bos_id,
            eos_token_id=eos_ids,
            raw=data,
        )

    # ------------------------------------------------------------------------------------
    @property
    def model_dtype(self) -> str:
        """Activation dtype (from the quantization: q4f16_1 -> float16)."""
        from app.inference.quantization import get_format

        return get_format(self.quantization).model_dtype

    @property
    def activation_dtype(self) -> str:
        """Dtype the compiled model computes in (activations, KV cache)."""
        return self.compute_dtype or self.model_dtype

    def format_name_for(self, param_prefix: str) -> str:
        """Weight format of the parameter(s) under ``param_prefix`` (e.g. "model.layers.0.mlp.down_proj")."""
        best, best_len = self.quantization, -1
        for prefix, fmt in self.tensor_formats.items():
            if (param_prefix == prefix or param_prefix.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = fmt, len(prefix)
        return best

    @property
    def quantization_label(self) -> str:
        """What to show users: ``q4f16_1``, or the weight formats of an imported GGUF, most used first."""
        if not self.tensor_formats:
            return self.quantization
        counts: dict[str, int] = {}
        for name in self.tensor_formats.values():
            counts[name] = counts.get(name, 0) + 1
        ranked = sorted(counts, key=lambda n: (-counts[n], n))
        return "+".join(ranked)

    def code_key(self) -> dict[str, Any]:
        """Everything about the model that changes the compiled code (for the library cache key)."""
        return {
            "model_type": self.model_type,
            "quantization": self.quantization,
            **({"word_storage": True} if self.word_storage else {}),
            "tensor_formats": dict(sorted(self.tensor_formats.items())),
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act,
            "activation_dtype": self.activation_dtype,
        }


def _first(*values: Any) -> Any:
    """The first value that is set (not None, not 0 / "" — MLC writes 0 for "not set")."""
    return next((v for v in values if v is not None and v != 0 and v != ""), values[-1])


def _positive_int(source: str, name: str, value: Any) -> int:
    """``value`` as a count: a positive integer (an integral float is accepted), else LlmchatError
    naming the field."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise LlmchatError(
            f"{source}: {name} must be a positive whole number, not {value!r}.",
            "download the model again (or fix that field)",
        )
    if value <= 0 or value >= 1 << 31:
        raise LlmchatError(
            f"{source}: {name} is {value}; it must be a positive count below 2**31.",
            "download the model again (or fix that field)",
        )
    return value


def _positive_float(source: str, name: str, value: Any, upper: float | None = None) -> float:
    """``value`` as a positive finite number (below ``upper``), else LlmchatError naming the field."""
    import math

    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
        or (upper is not None and value >= upper)
    ):
        bound = f" below {upper}" if upper is not None else ""
        raise LlmchatError(
            f"{source}: {name} must be a positive number{bound}, not {value!r}.",
            "download the model again (or fix that field)",
        )
    return float(value)


def _token_id(source: str, name: str, value: Any, vocab: int) -> int:
    """A token id within the vocabulary, else LlmchatError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise LlmchatError(
            f"{source}: {name} {value!r} is not a token id of the {vocab}-token vocabulary.",
            "download the model again (or fix that field)",
        )
    return value


def check_tokenizer_fits(cfg: ModelConfig, tokenizer_size: int, source: str) -> None:
    """The tokenizer's ids all index the embedding table (a larger tokenizer reads past it)."""
    if tokenizer_size > cfg.vocab_size:
        raise LlmchatError(
            f"{source}: the tokenizer has {tokenizer_size} tokens but the model's vocabulary "
            f"(vocab_size) only {cfg.vocab_size}; its extra tokens would read past the embedding table.",
            "use the tokenizer that belongs to this model (download or import it again)",
        )


def _rope_scaling(value: Any, source: str) -> dict[str, Any] | None:
    """Normalise HF/MLC ``rope_scaling``: None, or {"rope_type": "llama3", factor, ...}."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise LlmchatError(f"{source}: rope_scaling must be an object.", "download the model again")
    kind = value.get("rope_type") or value.get("type")
    if kind is None or kind == "default":
        return None
    if kind != "llama3":
        raise LlmchatError(
            f"{source}: RoPE scaling type {kind!r} is not supported.",
            "use a model without rope_scaling or with Llama-3.1-style ('llama3') scaling",
        )
    try:
        return {
            "rope_type": "llama3",
            "factor": float(value["factor"]),
            "low_freq_factor": float(value["low_freq_factor"]),
            "high_freq_factor": float(value["high_freq_factor"]),
            "original_max_position_embeddings": int(value["original_max_position_embeddings"]),
        }
    except (KeyError, TypeError, ValueError) as err:
        raise LlmchatError(
            f"{source}: llama3 rope_scaling is incomplete ({err}).", "download the model again"
        ) from err
