"""Write tiny GGUF models with the ``gguf`` package, as llama.cpp's converter would (test helper).

``write_tiny_gguf(path, tensor_type=...)`` makes random Hugging Face-layout weights, permutes the
Q/K rows for the ``llama`` architecture (``convert_hf_to_gguf.py``'s ``permute``), quantizes every
matrix with ``gguf.quants.quantize`` and writes metadata plus a small byte-level BPE tokenizer
with a ChatML template.  ``reference_params(path)`` reads the file back with ``gguf`` alone and
returns float64 matrices under the engine's parameter names, for ``tests.inference.reference``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]

TINY = {"hidden": 64, "ffn": 128, "heads": 4, "kv_heads": 2, "layers": 2, "ctx": 128}
#: K-quants need rows of whole super-blocks (256 values)
TINY_K = {"hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "layers": 2, "ctx": 128}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def random_k_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """Random but well-formed K-quant rows (gguf cannot quantize to K-quants): sane fp16 scales."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)

    def f16(n: int) -> np.ndarray:
        return rng.uniform(2e-4, 1e-3, (rows, cols // block, n)).astype(np.float16).view(np.uint8)

    if kind == "Q6_K":
        raw[..., 208:210] = f16(1)
    else:  # d, dmin
        raw[..., 0:4] = f16(2)
    return raw.reshape(rows, -1)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a small byte-level BPE vocabulary."""
    from tokenizers import pre_tokenizers

    tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += ["".join(m) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, [" ".join(m) for m in MERGES]


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (rotate-half rows -> interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    tensor_type: str = "F32",
    arch: str = "llama",
    seed: int = 0,
    types: dict[str, str] | None = None,
    tied: bool = False,
    omit: tuple[str, ...] = (),
    spm_vocab: dict[str, Any] | None = None,
    rope_freqs: np.ndarray | None = None,
    dims: dict[str, int] | None = None,
    chat_template: str | None = CHATML,
) -> Path:
    """A complete tiny GGUF model; ``types`` overrides the type of single tensors by GGUF name.

    ``spm_vocab``: a SentencePiece vocabulary (``tokens``, ``scores``, ``types``) instead of the BPE one;
    ``rope_freqs``: Llama-3.1-style RoPE frequency factors stored as the ``rope_freqs.weight`` tensor.
    """
    import gguf

    rng = np.random.default_rng(seed)
    c = dims or TINY
    d = c["hidden"] // c["heads"]
    tokens, token_types, merges = tiny_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d)
    if spm_vocab:
        tokens = spm_vocab["tokens"]
        vocab = len(tokens)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(spm_vocab["scores"])
        w.add_token_types(spm_vocab["types"])
        w.add_unk_token_id(0)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
        w.add_add_bos_token(False)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if chat_template:
        w.add_chat_template(chat_template)

    def mat(rows: int, cols: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def add(name: str, value: np.ndarray) -> None:
        if name in omit:
            return
        kind = (types or {}).get(name, tensor_type if value.ndim == 2 else "F32")
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in K_QUANTS:
            w.add_tensor(name, random_k_blocks(rng, kind, *value.shape), raw_dtype=qtype)
        elif kind == "F32":
            w.add_tensor(name, value.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)

    add("token_embd.weight", mat(vocab, c["hidden"], 1.0))
    for i in range(c["layers"]):
        b = f"blk.{i}"
        q, k = mat(c["heads"] * d, c["hidden"]), mat(c["kv_heads"] * d, c["hidden"])
        if arch == "llama":
            q, k = hf_to_gguf_permute(q, c["heads"]), hf_to_gguf_permute(k, c["kv_heads"])
        add(f"{b}.attn_q.weight", q)
        add(f"{b}.attn_k.weight", k)
        add(f"{b}.attn_v.weight", mat(c["kv_heads"] * d, c["hidden"]))
        if arch == "qwen2":
            add(f"{b}.attn_q.bias", rng.standard_normal(c["heads"] * d).astype(np.float32) * 0.1)
            add(f"{b}.attn_k.bias", rng.standard_normal(c["kv_heads"] * d).astype(np.float32) * 0.1)
            add(f"{b}.attn_v.bias", rng.standard_normal(c["kv_heads"] * d).astype(np.float32) * 0.1)
        add(f"{b}.attn_output.weight", mat(c["hidden"], c["heads"] * d))
        add(f"{b}.ffn_gate.weight", mat(c["ffn"], c["hidden"]))
        add(f"{b}.ffn_up.weight", mat(c["ffn"], c["hidden"]))
        add(f"{b}.ffn_down.weight", mat(c["hidden"], c["ffn"]))
        add(f"{b}.attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(c["hidden"]).astype(np.float32))
        add(f"{b}.ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(c["hidden"]).astype(np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    add("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(c["hidden"]).astype(np.float32))
    if not tied:
        add("output.weight", mat(vocab, c["hidden"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF row h*d + 2i + j holds Hugging Face row h*d + j*d/2 + i (written index by index)."""
    rows = w.shape[0]
    d = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            for j in range(2):
                out[h * d + j * (d // 2) + i] = w[h * d + 2 * i + j]
    return out


def reference_params(path: Path) -> dict[str, Any]:
    """Float64 weights under the engine's names, dequantized by ``gguf`` itself."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    t = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float64)
        t[tensor.name] = values.reshape([int(x) for x in reversed(tensor.shape.tolist())])
    heads = int(reader.fields[f"{arch}.attention.head_count"].contents())
    kv_heads = int(reader.fields[f"{arch}.attention.head_count_kv"].contents())
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    qkv = "c_attn" if arch == "qwen2" else "qkv_proj"
    p: dict[str, Any] = {
        "model.embed_tokens.weight": t["token_embd.weight"],
        "model.norm.weight": t["output_norm.weight"],
    }
    if "output.weight" in t:
        p["lm_head.weight"] = t["output.weight"]
    for i in range(layers):
        b, m = f"blk.{i}", f"model.layers.{i}"
        q, k = t[f"{b}.attn_q.weight"], t[f"{b}.attn_k.weight"]
        if arch == "llama":
            q, k = _unpermute(q, heads), _unpermute(k, kv_heads)
        p[f"{m}.self_attn.{qkv}.weight"] = np.concatenate([q, k, t[f"{b}.attn_v.weight"]])
        if f"{b}.attn_q.bias" in t:
            p[f"{m}.self_attn.{qkv}.bias"] = np.concatenate(
                [t[f"{b}.attn_q.bias"], t[f"{b}.attn_k.bias"], t[f"{b}.attn_v.bias"]]
            )
        p[f"{m}.self_attn.o_proj.weight"] = t[f"{b}.attn_output.weight"]
        gate_up = [t[f"{b}.ffn_gate.weight"], t[f"{b}.ffn_up.weight"]]
        p[f"{m}.mlp.gate_up_proj.weight"] = np.concatenate(gate_up)
        p[f"{m}.mlp.down_proj.weight"] = t[f"{b}.ffn_down.weight"]
        p[f"{m}.input_layernorm.weight"] = t[f"{b}.attn_norm.weight"]
        p[f"{m}.post_attention_layernorm.weight"] = t[f"{b}.ffn_norm.weight"]
    return p
