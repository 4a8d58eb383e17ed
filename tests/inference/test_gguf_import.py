"""GGUF import: tiny GGUFs of every supported tensor type, written with ``gguf``, imported and run by the
engine against a numpy float64 reference built from ``gguf``'s own dequantization of the same file;
and bad input (truncated file, other architecture, unsupported type) leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from app import paths
from app.errors import LlmchatError
from app.inference.engine.tokenizer import Tokenizer
from app.inference.engine.tvm_engine import load_engine
from app.inference.store.gguf_import import default_name, import_gguf
from app.inference.store.weights import load_numpy
from tests.inference.reference import forward
from tests.inference.tiny_gguf import TINY_K, random_k_blocks, reference_params, tiny_vocab, write_tiny_gguf

PROMPT_LEN = 20
DECODE_STEPS = 16
TOL = 1e-4  # the engine's fp32 tolerance: GGUF imports compute in float32

CASES = {
    # id: write_tiny_gguf arguments
    "F32": {"tensor_type": "F32"},
    "F16": {"tensor_type": "F16"},
    "BF16": {"tensor_type": "BF16"},
    "Q8_0": {"tensor_type": "Q8_0"},
    "Q4_0": {"tensor_type": "Q4_0"},
    "Q4_1": {"tensor_type": "Q4_1"},
    # the default model's mix: Q4_1 layers, a Q8_0 embedding tied to the output
    "Q4_1-tied-Q8_0-embd": {"tensor_type": "Q4_1", "tied": True, "types": {"token_embd.weight": "Q8_0"}},
    "qwen2-Q8_0": {"tensor_type": "Q8_0", "arch": "qwen2", "tied": True},
    # a Q4_K_M-like file: Q4_K, a Q6_K output and attn_v (q, k, v fused as ggml_wide), a Q5_K ffn_down
    "K-quants": {
        "tensor_type": "Q4_K",
        "dims": TINY_K,
        "types": {"output.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q5_K"},
    },
}


def _run(model_dir, prompt):
    engine = load_engine(model_dir, device="cpu")
    try:
        rt = engine.runtime
        logits = [rt.prefill(prompt)]
        tokens = list(prompt)
        for _ in range(DECODE_STEPS):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(rt.decode(tokens[-1]))
    finally:
        engine.close()
    return np.stack(logits), tokens


@pytest.mark.parametrize("case", list(CASES))
def test_imported_logits_match_gguf_dequantized_reference(tmp_path, case):
    gguf_path = write_tiny_gguf(tmp_path / f"tiny-{case}.gguf", **CASES[case])
    model_dir = import_gguf(gguf_path, name=f"tiny-{case.lower()}")
    assert model_dir == paths.models_dir() / f"tiny-{case.lower()}"
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())

    rng = np.random.default_rng(7)
    prompt = rng.integers(0, config["vocab_size"], size=PROMPT_LEN).tolist()
    got, tokens = _run(model_dir, prompt)
    ref = forward(config, reference_params(gguf_path), tokens)[PROMPT_LEN - 1 :]
    scale = np.abs(ref).max()
    rel = np.abs(got - ref).max(axis=1) / scale
    assert rel.max() <= TOL, f"logits off by {rel.max():.2e} (relative) at step {int(rel.argmax())}"
    for step in range(DECODE_STEPS):
        top2 = np.sort(ref[step])[-2:]
        if top2[1] - top2[0] > 2 * TOL * scale:
            assert tokens[PROMPT_LEN + step] == int(np.argmax(ref[step])), f"greedy token differs at {step}"


def test_blocks_are_stored_without_requantizing(tmp_path):
    """Q4_1 stays 4-bit words + a scale and minimum per 32; Q8_0 stays int8 + a scale per 32."""
    import gguf

    path = write_tiny_gguf(tmp_path / "t.gguf", "Q4_1", types={"token_embd.weight": "Q8_0"})
    model_dir = import_gguf(path, name="blocks")
    params = load_numpy(model_dir)
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    down = "model.layers.0.mlp.down_proj"
    assert params[f"{down}.q_weight"].dtype == np.uint32
    assert params[f"{down}.q_weight"].shape == (64, 128 // 8)
    # GGUF's fp16 scales and minima, widened exactly to fp32
    assert params[f"{down}.q_scale"].dtype == np.float32 and params[f"{down}.q_min"].shape == (64, 4)
    assert params["model.embed_tokens.q_weight"].dtype == np.int8
    assert config["tensor_formats"][down] == "ggml_q4_1"
    assert config["tensor_formats"]["model.embed_tokens"] == "ggml_q8_0"
    # bit-exact: the imported blocks re-encode to the very bytes of the GGUF
    from app.inference.quantization.ggml import GGML_Q4_1

    reader = gguf.GGUFReader(str(path))
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight").data
    back = GGML_Q4_1.to_gguf({k.rsplit(".", 1)[1]: v for k, v in params.items() if k.startswith(down)})
    assert np.array_equal(back, np.asarray(raw))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_exact_and_fuse_with_other_blocks(qtype):
    """K-quant rows -> params that dequantize to exactly gguf's values; also inside ggml_wide."""
    import gguf

    from app.inference.quantization.ggml import FORMAT_OF_TYPE, GGML_WIDE

    rng = np.random.default_rng(5)
    raw = random_k_blocks(rng, qtype, 6, 512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    fmt = FORMAT_OF_TYPE[qtype]
    # equal up to gguf's own float32 rounding (the stored integers and scales are exact)
    ulp = 1e-6 * np.abs(expected).max()
    assert np.abs(fmt.dequantize(fmt.from_gguf(raw, 6, 512)) - expected).max() <= ulp
    q41 = gguf.GGMLQuantizationType.Q4_1
    other = gguf.quants.quantize(rng.standard_normal((3, 512)).astype(np.float32), q41)
    wide = GGML_WIDE.from_parts([(qtype, raw, 6, 512), ("Q4_1", other, 3, 512)])
    both = np.concatenate([expected, gguf.quants.dequantize(other, q41)])
    assert np.abs(GGML_WIDE.dequantize(wide) - both).max() <= ulp


def test_mixed_qkv_types_are_fused_as_exact_fp32(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q4_0", types={"blk.0.attn_v.weight": "F16"})
    model_dir = import_gguf(path, name="mixed")
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    params = load_numpy(model_dir)
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert config["tensor_formats"][qkv] == "q0f32"
    assert config["tensor_formats"]["model.layers.1.self_attn.qkv_proj"] == "ggml_q4_0"
    ref = reference_params(path)[f"{qkv}.weight"]
    assert np.array_equal(params[f"{qkv}.weight"].astype(np.float64), ref)


def test_model_dir_has_tokenizer_and_template(tmp_path):
    path = write_tiny_gguf(tmp_path / "Tiny-Model.Q8_0.gguf", "Q8_0")
    model_dir = import_gguf(path)
    assert model_dir.name == default_name(path) == "tiny-model-q8_0"
    for name in ("mlc-chat-config.json", "tensor-cache.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file()
    manifest = json.loads((model_dir / "tensor-cache.json").read_text())
    assert all(len(shard["md5sum"]) == 32 for shard in manifest["records"])
    tok = Tokenizer.from_model_dir(model_dir)
    tokens = tiny_vocab()[0]
    assert tok.eos_ids == {2}
    ids = tok.encode("<|im_start|>hello")
    assert ids[0] == 1 and [tokens[i] for i in ids[1:]] == ["hell", "o"]
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in template
    assert not list(paths.models_dir().glob(".*"))  # no staging directory left


def test_gguf_without_chat_template_gets_a_conv_template(tmp_path):
    from app.inference.api import Message
    from app.inference.engine.chat_template import ChatFormatter

    path = write_tiny_gguf(tmp_path / "t.gguf", "Q8_0", chat_template=None)
    model_dir = import_gguf(path, name="notemplate")
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    assert config["conv_template"]["name"] == "chatml" and config["conv_template"]["stop_token_ids"] == [2]
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())
    formatter = ChatFormatter.from_model_dir(model_dir, config)
    text = formatter.render([Message("user", "hi")], add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


def test_importing_twice_under_one_name_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q4_0")
    import_gguf(path, name="dup")
    with pytest.raises(LlmchatError, match="already installed"):
        import_gguf(path, name="dup")


def _nothing_left(name: str) -> None:
    root = paths.models_dir()
    assert not (root / name).exists()
    assert not root.exists() or not list(root.iterdir())


def test_truncated_gguf_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q4_1")
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 40):
        short = tmp_path / f"short-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(LlmchatError, match="not a complete GGUF"):
            import_gguf(short, name="short")
        _nothing_left("short")


def test_other_architecture_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "F16", arch="gpt2")
    with pytest.raises(LlmchatError, match="architecture 'gpt2'") as err:
        import_gguf(path, name="other")
    assert "llama" in err.value.fix
    _nothing_left("other")


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ4_XS", "Q5_0"])
def test_unsupported_tensor_type_is_refused(tmp_path, qtype):
    import gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor(
        "blk.0.ffn_down.weight",
        gguf.quants.quantize(np.ones((4, 256), np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    w.add_tensor(
        "blk.0.ffn_up.weight",
        np.zeros((4, nbytes * 256 // block), np.uint8),
        raw_dtype=gguf.GGMLQuantizationType[qtype],
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LlmchatError, match=f"type {qtype},") as err:
        import_gguf(path, name="kquant")
    assert "F32, F16, BF16, Q8_0, Q4_0, Q4_1" in err.value.fix
    _nothing_left("kquant")


def test_missing_tensor_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q8_0", omit=("blk.1.ffn_up.weight",))
    with pytest.raises(LlmchatError, match=r"blk\.1\.ffn_up\.weight"):
        import_gguf(path, name="partial")
    _nothing_left("partial")


def test_interrupted_import_leaves_nothing(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "t.gguf", "Q4_0")
    from app.inference.store import weights

    real = weights.write_tensor_cache

    def interrupted(params, out_dir, **kw):
        real(params, out_dir, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(weights, "write_tensor_cache", interrupted)
    with pytest.raises(KeyboardInterrupt):
        import_gguf(path, name="interrupted")
    _nothing_left("interrupted")


def test_disk_full_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    path = write_tiny_gguf(tmp_path / "t.gguf", "Q4_0")
    from app.inference.store import weights

    def full(params, out_dir, **kw):
        (out_dir / "params_shard_0.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(weights, "write_tensor_cache", full)
    with pytest.raises(LlmchatError, match="the disk is full") as err:
        import_gguf(path, name="full")
    assert "disk space" in err.value.fix
    _nothing_left("full")


def test_not_a_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(LlmchatError, match="not a GGUF file"):
        import_gguf(path, name="x")
    _nothing_left("x")


def test_sentencepiece_gguf_imports_with_a_working_tokenizer(tmp_path):
    """A `llama` (SentencePiece) vocabulary: the imported tokenizer gives llama.cpp's ids and adds BOS."""
    import gzip

    import gguf

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "llama_cpp_vocab"
    vocab_file = tmp_path / "spm.gguf"
    vocab_file.write_bytes(gzip.decompress((fixtures / "ggml-vocab-llama-spm.gguf.gz").read_bytes()))
    fields = gguf.GGUFReader(str(vocab_file)).fields
    spm = {
        "tokens": fields["tokenizer.ggml.tokens"].contents(),
        "scores": fields["tokenizer.ggml.scores"].contents(),
        "types": fields["tokenizer.ggml.token_type"].contents(),
    }
    path = write_tiny_gguf(tmp_path / "spm-model.gguf", "Q8_0", spm_vocab=spm, tied=True)
    model_dir = import_gguf(path, name="spm")
    tok = Tokenizer.from_model_dir(model_dir)
    inp = (fixtures / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    inputs = inp.split("\n__ggml_vocab_test__\n")
    outputs = (fixtures / "ggml-vocab-llama-spm.gguf.out").read_text(encoding="utf-8").split("\n")
    for text, expected in list(zip(inputs, outputs, strict=False))[:20]:
        assert tok.encode(text, add_bos=False) == [int(x) for x in expected.split()], text
    assert tok.encode("Hello")[0] == 1  # llama's SentencePiece vocabularies add BOS
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    assert config["vocab_size"] == len(spm["tokens"]) and config["model_config"]["tie_word_embeddings"]


def test_llama31_rope_freqs_become_rope_scaling(tmp_path):
    """Llama 3.1 GGUFs carry RoPE scaling as frequency factors: the import recovers the parameters."""
    import math

    d, theta = 16, 10000.0
    factor, low, high, original = 8.0, 1.0, 4.0, 8192
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, d, 2) / d):
        wavelen = 2 * math.pi / freq
        smooth = (original / wavelen - low) / (high - low)
        factors.append(
            1.0
            if wavelen < original / high
            else factor
            if wavelen > original / low
            else 1 / ((1 - smooth) / factor + smooth)
        )
    path = write_tiny_gguf(tmp_path / "l31.gguf", "F16", rope_freqs=np.array(factors))
    config = json.loads((import_gguf(path, name="l31") / "mlc-chat-config.json").read_text())
    assert config["model_config"]["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    odd = write_tiny_gguf(tmp_path / "odd.gguf", "F16", rope_freqs=np.linspace(1, 3, d // 2))
    with pytest.raises(LlmchatError, match="rope_freqs"):
        import_gguf(odd, name="odd")
