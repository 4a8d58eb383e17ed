"""Qwen2 / Qwen2.5 decoder: the Llama block with a biased fused QKV projection named ``c_attn``.

Names follow MLC-LLM's ``python/mlc_llm/model/qwen2/qwen2_model.py``:
``model.layers.N.self_attn.c_attn.{q_weight,q_scale,bias}``; tied embeddings are common (then
there is no ``lm_head``).  ``ModelConfig`` sets ``attention_bias`` for ``model_type == "qwen2"``.
"""

from __future__ import annotations

from app.inference.models.llama import DecoderAttention, DecoderLayer, DecoderModel, LlamaForCausalLM


class Qwen2Attention(DecoderAttention):
    qkv_name = "c_attn"


class Qwen2Layer(DecoderLayer):
    attention_class = Qwen2Attention


class Qwen2Model(DecoderModel):
    layer_class = Qwen2Layer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_class = Qwen2Model
