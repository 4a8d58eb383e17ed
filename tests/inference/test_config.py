"""mlc-chat-config.json parsing: normalised fields and clear errors."""

from __future__ import annotations

import json

import pytest

from app.errors import LlmchatError
from app.inference.store.config import SUPPORTED_MODEL_TYPES, ModelConfig

LLAMA3_8B = {
    "model_type": "llama",
    "quantization": "q4f16_1",
    "context_window_size": 8192,
    "prefill_chunk_size": 2048,
    "vocab_size": 128256,
    "model_config": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "rms_norm_eps": 1e-5,
        "vocab_size": 128256,
        "position_embedding_base": 500000.0,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    },
}


def test_mlc_llama3_config():
    cfg = ModelConfig.from_dict(LLAMA3_8B)
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (4096, 8, 128)
    assert cfg.rope_theta == 500000.0 and cfg.model_dtype == "float16"
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    assert cfg.context_window_size == 8192 and cfg.prefill_chunk_size == 2048
    assert not cfg.tie_word_embeddings and not cfg.attention_bias


def test_defaults_filled_like_mlc():
    data = json.loads(json.dumps(LLAMA3_8B))
    mc = data["model_config"]
    for key in ("num_key_value_heads", "head_dim", "position_embedding_base", "rope_scaling"):
        mc.pop(key)
    mc["rope_theta"] = 1e6
    data.pop("prefill_chunk_size")
    cfg = ModelConfig.from_dict(data)
    assert cfg.num_key_value_heads == 32 and cfg.head_dim == 128 and cfg.rope_theta == 1e6
    assert cfg.rope_scaling is None and cfg.prefill_chunk_size == 2048


def test_mistral_is_a_llama_family_model():
    from app.inference.models import MODEL_CLASSES

    data = dict(LLAMA3_8B, model_type="mistral", sliding_window_size=-1)
    cfg = ModelConfig.from_dict(data)
    assert cfg.model_type == "mistral" and not cfg.attention_bias
    assert MODEL_CLASSES["mistral"] == MODEL_CLASSES["llama"]


def test_qwen2_has_qkv_bias():
    data = json.loads(json.dumps(LLAMA3_8B))
    data["model_type"] = "qwen2"
    assert ModelConfig.from_dict(data).attention_bias


def test_unknown_model_type_lists_supported_ones():
    data = dict(LLAMA3_8B, model_type="gpt-neox")
    with pytest.raises(LlmchatError) as err:
        ModelConfig.from_dict(data)
    assert "gpt-neox" in str(err.value)
    for name in SUPPORTED_MODEL_TYPES:
        assert name in err.value.fix


def test_unsupported_quantization_lists_supported_ones():
    with pytest.raises(LlmchatError) as err:
        ModelConfig.from_dict(dict(LLAMA3_8B, quantization="q3f16_1"))
    assert "q3f16_1" in str(err.value)
    assert "q4f16_1" in err.value.fix and "q0f32" in err.value.fix


def test_unsupported_rope_scaling():
    data = json.loads(json.dumps(LLAMA3_8B))
    data["model_config"]["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(LlmchatError, match=r"yarn"):
        ModelConfig.from_dict(data)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(LlmchatError, match=r"mlc-chat-config\.json is missing"):
        ModelConfig.load(tmp_path)
    (tmp_path / "mlc-chat-config.json").write_text("{not json")
    with pytest.raises(LlmchatError, match=r"not valid JSON"):
        ModelConfig.load(tmp_path)
    data = json.loads(json.dumps(LLAMA3_8B))
    del data["model_config"]["hidden_size"]
    (tmp_path / "mlc-chat-config.json").write_text(json.dumps(data))
    with pytest.raises(LlmchatError, match=r"hidden_size"):
        ModelConfig.load(tmp_path)


def test_tensor_formats_longest_prefix_wins():
    formats = {"model.layers": "q4f16_1", "model.layers.0.mlp.down_proj": "q0f16"}
    data = dict(LLAMA3_8B, tensor_formats=formats)
    cfg = ModelConfig.from_dict(data)
    assert cfg.format_name_for("model.layers.0.mlp.down_proj") == "q0f16"
    assert cfg.format_name_for("model.layers.1.mlp.down_proj") == "q4f16_1"
    assert cfg.format_name_for("lm_head") == "q4f16_1"
    one = ModelConfig.from_dict(
        dict(LLAMA3_8B, quantization="q0f16", tensor_formats={"model.layers.1": "q4f16_1"})
    )
    assert one.format_name_for("model.layers.1.mlp.down_proj") == "q4f16_1"
    assert one.format_name_for("model.layers.10.mlp.down_proj") == "q0f16"  # whole name parts only
    with pytest.raises(LlmchatError, match=r"Unsupported quantization"):
        ModelConfig.from_dict(dict(LLAMA3_8B, tensor_formats={"lm_head": "nope"}))


def test_quantization_label_names_imported_formats():
    assert ModelConfig.from_dict(dict(LLAMA3_8B)).quantization_label == LLAMA3_8B["quantization"]
    formats = {
        "model.embed_tokens": "ggml_q8_0",
        "model.layers.0.mlp.down_proj": "ggml_q4_1",
        "model.layers.0.self_attn.o_proj": "ggml_q4_1",
    }
    cfg = ModelConfig.from_dict(dict(LLAMA3_8B, quantization="q0f32", tensor_formats=formats))
    assert cfg.quantization_label == "ggml_q4_1+ggml_q8_0"


def test_code_key_changes_with_what_changes_code():
    a = ModelConfig.from_dict(LLAMA3_8B)
    b = ModelConfig.from_dict(dict(LLAMA3_8B, quantization="q4f32_1"))
    c = ModelConfig.from_dict(dict(LLAMA3_8B, context_window_size=4096))
    assert a.code_key() != b.code_key()
    assert a.code_key() == c.code_key()  # the KV cache size is a runtime argument
