"""Llama-family decoder (Llama 2, Llama 3.x with RoPE scaling, Mistral, SmolLM2) in ``relax.frontend.nn``.

Parameter names and shapes are MLC-LLM's (``python/mlc_llm/model/llama/llama_model.py``):
``model.embed_tokens.*``, ``model.layers.N.self_attn.qkv_proj.*`` (fused q, k, v),
``model.layers.N.self_attn.o_proj.*``, ``model.layers.N.mlp.gate_up_proj.*`` (fused gate, up),
``model.layers.N.mlp.down_proj.*``, ``model.layers.N.{input,post_attention}_layernorm.weight``,
``model.norm.weight`` and ``lm_head.*`` (absent with tied embeddings); ``*`` is the weight
format's params (``weight``, or ``q_weight`` + ``q_scale``).

Exported functions (what ``app.inference.engine.runtime`` calls): ``embed``, ``prefill``, ``decode`` and
``create_paged_kv_cache`` (TVM's TIR paged KV cache, which applies RoPE).  ``batch_decode`` is
defined (MLC's signature) but not exported: one conversation needs no batching, and every
exported function adds compile time.
"""

from __future__ import annotations

from typing import Any

from tvm import relax, te
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

from app.inference.compile.device_ops import argmax_te, has_device_argmax
from app.inference.quantization import get_format, storage_format
from app.inference.store.config import ModelConfig


def make_linear(cfg: ModelConfig, prefix: str, in_f: int, out_f: int, bias: bool = False) -> nn.Module:
    """A linear layer in the weight format configured for ``prefix``."""
    fmt = storage_format(get_format(cfg.format_name_for(prefix)), cfg.word_storage)
    return fmt.linear(in_f, out_f, bias, cfg.activation_dtype, bias_dtype=cfg.model_dtype)


def make_embedding(cfg: ModelConfig, prefix: str) -> nn.Module:
    """The token embedding table in the weight format configured for ``prefix``."""
    fmt = storage_format(get_format(cfg.format_name_for(prefix)), cfg.word_storage)
    return fmt.embedding(cfg.vocab_size, cfg.hidden_size, cfg.activation_dtype)


class RMSNorm(nn.Module):
    """RMS norm whose weight is stored in the model's dtype and applied in the activations' dtype."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.weight = nn.Parameter((cfg.hidden_size,), cfg.model_dtype)
        self.eps = cfg.rms_norm_eps
        self.compute_dtype = cfg.activation_dtype

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if weight.dtype != self.compute_dtype:
            weight = weight.astype(self.compute_dtype)
        return op.rms_norm(x, weight, axes=[-1], epsilon=self.eps)


ACTIVATIONS = {"silu": op.silu, "swish": op.silu, "gelu": op.gelu}


class DecoderAttention(nn.Module):
    """Grouped-query attention with a fused QKV projection and the paged KV cache."""

    #: MLC's attribute name of the fused QKV projection in this family
    qkv_name = "qkv_proj"

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        qkv_out = (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim
        setattr(
            self,
            self.qkv_name,
            make_linear(cfg, f"{prefix}.{self.qkv_name}", cfg.hidden_size, qkv_out, bias=cfg.attention_bias),
        )
        self.o_proj = make_linear(cfg, f"{prefix}.o_proj", self.num_q_heads * self.head_dim, cfg.hidden_size)

    def forward(self, x: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        d, hq, hkv = self.head_dim, self.num_q_heads, self.num_kv_heads
        b, s, _ = x.shape
        qkv = op.reshape(getattr(self, self.qkv_name)(x), (b, s, hq + 2 * hkv, d))
        out = kv.attention_with_fused_qkv(layer_id, qkv, hq, sm_scale=d**-0.5)
        return self.o_proj(op.reshape(out, (b, s, hq * d)))


class DecoderMLP(nn.Module):
    """Gated MLP with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        self.gate_up_proj = make_linear(
            cfg, f"{prefix}.gate_up_proj", cfg.hidden_size, 2 * cfg.intermediate_size
        )
        self.down_proj = make_linear(cfg, f"{prefix}.down_proj", cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS.get(cfg.hidden_act, op.silu)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    attention_class: type[DecoderAttention] = DecoderAttention

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        self.self_attn = self.attention_class(cfg, f"{prefix}.self_attn")
        self.mlp = DecoderMLP(cfg, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg)
        self.post_attention_layernorm = RMSNorm(cfg)

    def forward(self, h: Tensor, kv: PagedKVCache, layer_id: int) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), kv, layer_id)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    """Embedding, the layers and the final norm (MLC's ``model.*``)."""

    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig) -> None:
        self.embed_tokens = make_embedding(cfg, "model.embed_tokens")
        self.layers = nn.ModuleList(
            [self.layer_class(cfg, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg)

    def forward(self, h: Tensor, kv: PagedKVCache) -> Tensor:
        for layer_id, layer in enumerate(self.layers):
            h = layer(h, kv, layer_id)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """The exported model: ``model`` + ``lm_head`` and the functions the runtime calls."""

    model_class: type[DecoderModel] = DecoderModel

    def __init__(self, cfg: ModelConfig, target: Any) -> None:
        self.cfg = cfg
        self.target = target
        self.dtype = cfg.activation_dtype
        self.model = self.model_class(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = make_linear(cfg, "lm_head", cfg.hidden_size, cfg.vocab_size)

    def _logits(self, h: Tensor) -> Tensor:
        if self.cfg.tie_word_embeddings:
            logits = self.model.embed_tokens.lm_head_forward(h)
        elif hasattr(self.lm_head, "fmt"):
            logits = self.lm_head(h, out_dtype="float32")
        else:
            logits = self.lm_head(h)
        if logits.dtype != "float32":
            logits = logits.astype("float32")
        return logits

    # -- exported functions ------------------------------------------------------------------
    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def prefill(self, input_embed: Tensor, paged_kv_cache: PagedKVCache) -> tuple[Tensor, PagedKVCache]:
        def last_position(x: te.Tensor) -> te.Tensor:
            b, s, d = x.shape
            return te.compute((b, 1, d), lambda i, _, k: x[i, s - 1, k], name="index")

        h = self.model(input_embed, paged_kv_cache)
        h = op.tensor_expr_op(last_position, name_hint="index", args=[h])
        return self._logits(h), paged_kv_cache

    def decode(self, input_embed: Tensor, paged_kv_cache: PagedKVCache) -> tuple[Tensor, PagedKVCache]:
        return self._logits(self.model(input_embed, paged_kv_cache)), paged_kv_cache

    def batch_decode(self, input_embeds: Tensor, paged_kv_cache: PagedKVCache) -> tuple[Tensor, PagedKVCache]:
        return self._logits(self.model(input_embeds, paged_kv_cache)), paged_kv_cache

    def argmax(self, logits: Tensor) -> Tensor:
        """Index of the largest of ``logits [1, 1, vocab]`` (first one on ties), as int32 ``[1]``:
        greedy decoding on the device, so only the token id crosses to the host."""
        return op.tensor_expr_op(argmax_te, name_hint="argmax", args=[logits])

    def create_paged_kv_cache(
        self,
        max_batch_size: Any,
        max_total_seq_len: Any,
        prefill_chunk_size: Any,
        page_size: Any,
        support_sliding_window: Any,
    ) -> PagedKVCache:
        c = self.cfg
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, c.num_hidden_layers]),
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            qk_head_dim=c.head_dim,
            v_head_dim=c.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=c.rope_theta,
            rope_scaling=dict(c.rope_scaling or {}),
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=c.head_dim,
            enable_disaggregation=False,
            dtype=c.activation_dtype,
            target=self.target,
        )

    def get_default_spec(self) -> dict[str, Any]:
        hidden, dt = self.cfg.hidden_size, self.cfg.activation_dtype
        packed = {"param_mode": "packed", "effect_mode": "none"}
        kv = nn.spec.Object(object_type=PagedKVCache)
        return {
            "embed": {"input_ids": nn.spec.Tensor(["seq_len"], "int32"), "$": packed},
            "prefill": {
                "input_embed": nn.spec.Tensor([1, "seq_len", hidden], dt),
                "paged_kv_cache": kv,
                "$": packed,
            },
            "decode": {"input_embed": nn.spec.Tensor([1, 1, hidden], dt), "paged_kv_cache": kv, "$": packed},
            **(
                {
                    "argmax": {
                        "logits": nn.spec.Tensor([1, 1, self.cfg.vocab_size], "float32"),
                        "$": {"param_mode": "none", "effect_mode": "none"},
                    }
                }
                if has_device_argmax(self.target)
                else {}
            ),
            "create_paged_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "support_sliding_window": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }
