"""Import a llama.cpp GGUF file as an llmchat model directory (MLC's format), without re-quantizing.

``import_gguf(path, name)`` reads the file (``gguf_reader``), builds the tokenizer from its metadata
(``gguf_tokenizer``), maps the tensors onto the engine's Llama/Qwen2 parameters and writes
``mlc-chat-config.json`` (with ``tensor_formats``: the weight format of every matrix),
``tensor-cache.json`` + ``params_shard_*.bin``, ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json`` into ``models_dir()/<name>``.

Mapping (GGUF -> MLC): ``token_embd`` -> ``model.embed_tokens``; ``blk.N.attn_{q,k,v}`` ->
``model.layers.N.self_attn.qkv_proj`` (rows concatenated: blocks run along the input dimension, so
this moves whole blocks); ``attn_output`` -> ``o_proj``; ``ffn_{gate,up}`` -> ``mlp.gate_up_proj``;
``ffn_down`` -> ``mlp.down_proj``; ``attn_norm`` / ``ffn_norm`` -> ``input_layernorm`` /
``post_attention_layernorm``; ``output_norm`` -> ``model.norm``; ``output`` -> ``lm_head`` (absent:
tied embeddings).  llama.cpp's converter permutes the rows of Llama's Q and K weights (to its
interleaved RoPE); the import undoes that, Qwen2 is stored unpermuted.

Everything is written into a staging directory next to the target and renamed into place at the
end, so a failure (or Ctrl-C) leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent
from app.inference.store.gguf_reader import GGUFFile, GGUFTensor, read_gguf
from app.inference.store.gguf_tokenizer import build_tokenizer
from app.inference.store.installed import IMPORT_RECORD, check_model_files

#: the model's main quantization: GGUF imports compute in float32 (norms, activations, KV cache)
BASE_QUANTIZATION = "q0f32"
#: GGUF architecture -> MLC model_type
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
#: architectures whose Q/K rows llama.cpp's converter permuted
PERMUTED_QK = {"llama", "mistral"}
DEFAULT_PREFILL_CHUNK = 2048
SHARD_BYTES = 32 << 20

#: MLC's name of the fused QKV projection per model_type
QKV_NAMES = {"llama": "self_attn.qkv_proj", "qwen2": "self_attn.c_attn"}
# per-layer GGUF tensors -> (MLC parameter prefix, GGUF parts fused in that order); "qkv" = QKV_NAMES
_LAYER_MATRICES: list[tuple[str, list[str]]] = [
    ("qkv", ["attn_q", "attn_k", "attn_v"]),
    ("self_attn.o_proj", ["attn_output"]),
    ("mlp.gate_up_proj", ["ffn_gate", "ffn_up"]),
    ("mlp.down_proj", ["ffn_down"]),
]
_LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def default_name(path: str | Path) -> str:
    """Model id from a file name: ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct-q4_1``."""
    stem = Path(path).name
    if stem.lower().endswith(".gguf"):
        stem = stem[:-5]
    name = re.sub(r"[^a-z0-9_.-]+", "-", stem.lower()).replace(".", "-").strip("-._")[:128]
    return name or "imported-model"


#: model ids as the catalog accepts them (app.inference.store.catalog)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise LlmchatError(
            f"{name!r} cannot be a model name.",
            "use up to 128 letters, digits, '-', '_' and '.', starting with a letter or digit",
        )
    return name


# ------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------
def _int(g: GGUFFile, key: str, default: int | None = None) -> int:
    value = g.arch_value(key, default)
    if value is None:
        raise LlmchatError(
            f"{g.path}: metadata {g.architecture}.{key} is missing.",
            "use a GGUF converted by a recent llama.cpp",
        )
    if isinstance(value, (bool, str, bytes, list)) or not float(value).is_integer():
        raise LlmchatError(
            f"{g.path}: metadata {g.architecture}.{key} must be a whole number, not {value!r}.",
            "the file is damaged; convert it again with a recent llama.cpp",
        )
    return int(value)


def _float(g: GGUFFile, key: str, default: float) -> float:
    value = g.arch_value(key, default)
    if isinstance(value, (bool, str, bytes, list)) or value is None:
        raise LlmchatError(
            f"{g.path}: metadata {g.architecture}.{key} must be a number, not {value!r}.",
            "the file is damaged; convert it again with a recent llama.cpp",
        )
    return float(value)


def _llama3_rope_scaling(g: GGUFFile, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Llama 3.1/3.2 store RoPE scaling as a ``rope_freqs`` tensor: find the parameters that made it."""
    t = g.tensors.get("rope_freqs.weight")
    if t is None:
        return None
    factors = np.asarray(t.data, np.float64).reshape(-1)
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    for low, high, original in [(1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)]:
        expect = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < original / high:
                expect.append(1.0)
            elif wavelen > original / low:
                expect.append(factor)
            else:
                smooth = (original / wavelen - low) / (high - low)
                expect.append(1 / ((1 - smooth) / factor + smooth))
        if len(expect) == factors.size and np.allclose(expect, factors, rtol=1e-3):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise LlmchatError(
        f"{g.path}: its RoPE frequency factors (rope_freqs) are of a kind llmchat does not know.",
        "use a GGUF without RoPE scaling or with Llama-3.1-style scaling",
    )


def model_config(g: GGUFFile, tok: Any, tensor_formats: dict[str, str]) -> dict[str, Any]:
    """``mlc-chat-config.json`` for the GGUF's model."""
    hidden = _int(g, "embedding_length")
    heads = _int(g, "attention.head_count")
    kv_heads = _int(g, "attention.head_count_kv", heads)
    # counts are validated (with the field named) by ModelConfig.from_dict; nothing here may divide by 0
    head_dim = _int(g, "attention.key_length", hidden // heads if heads > 0 else 0)
    theta = _float(g, "rope.freq_base", 10000.0)
    scaling_type = str(g.arch_value("rope.scaling.type", "none") or "none")
    if scaling_type not in ("none", ""):
        raise LlmchatError(
            f"{g.path}: RoPE scaling {scaling_type!r} is not supported.",
            "use a GGUF of the model without RoPE scaling",
        )
    ctx = _int(g, "context_length", 4096)
    vocab = g.tensors["token_embd.weight"].shape[0]
    mc: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": _int(g, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": _int(g, "block_count"),
        "rms_norm_eps": _float(g, "attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": vocab,
        "position_embedding_base": theta,
        "rope_theta": theta,
        "context_window_size": ctx,
        "prefill_chunk_size": min(ctx, DEFAULT_PREFILL_CHUNK),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "hidden_act": "silu",
    }
    scaling = _llama3_rope_scaling(g, head_dim, theta) if head_dim > 0 and theta > 0 else None
    if scaling:
        mc["rope_scaling"] = scaling
    return {
        "version": "0.1.0",
        "model_type": MODEL_TYPES[g.architecture],
        "quantization": BASE_QUANTIZATION,
        "model_config": mc,
        "vocab_size": vocab,
        "context_window_size": ctx,
        "prefill_chunk_size": min(ctx, DEFAULT_PREFILL_CHUNK),
        "sliding_window_size": -1,
        "tensor_formats": tensor_formats,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_ids,
        "pad_token_id": g.get("tokenizer.ggml.padding_token_id"),
        "tokenizer_files": ["tokenizer.json", "tokenizer_config.json", "generation_config.json"],
        "conv_template": None if tok.chat_template else fallback_conv_template(g, tok),
        "llmchat_source": {
            "gguf": g.path.name,
            "bytes": g.path.stat().st_size,
            "name": g.get("general.name"),
            "tensor_types": g.tensor_types(),
        },
    }


def fallback_conv_template(g: GGUFFile, tok: Any) -> dict[str, Any] | None:
    """MLC's conversation template for a GGUF without ``tokenizer.chat_template`` (older conversions),
    chosen by the vocabulary's markers, with the stop and prefix token ids of this vocabulary."""
    from app.inference.engine.chat_template import BUILTIN_CONV_TEMPLATES

    index = {t: i for i, t in enumerate(tok.tokens)}
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    if "<|im_start|>" in index and "<|im_end|>" in index:
        conv = dict(BUILTIN_CONV_TEMPLATES["chatml"])
        conv["stop_token_ids"] = sorted({index["<|im_end|>"], *tok.eos_token_ids})
    elif "<|start_header_id|>" in index and "<|eot_id|>" in index:
        conv = dict(BUILTIN_CONV_TEMPLATES["llama-3_1"])
        conv["stop_token_ids"] = sorted({index["<|eot_id|>"], *tok.eos_token_ids})
        conv["system_prefix_token_ids"] = bos
    elif str(g.get("tokenizer.ggml.model")) == "llama":
        name = "mistral_default" if "mistral" in str(g.get("general.name", "")).lower() else "llama-2"
        conv = dict(BUILTIN_CONV_TEMPLATES[name])
        conv["stop_token_ids"] = list(tok.eos_token_ids)
        conv["system_prefix_token_ids"] = bos
    else:
        return None  # a base model: completion only
    return conv


# ------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------
def _unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's ``permute`` (rows grouped per head as (2, d/2) -> (d/2, 2))."""
    out = rows.shape[0]
    return rows.reshape(n_head, out // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


class _Group:
    """One MLC parameter group: a matrix (maybe fused from several GGUF tensors), a norm's weight
    (``kind="vector"``) or a fused bias (``kind="bias"``); vectors are stored as float32."""

    def __init__(self, prefix: str, parts: list[GGUFTensor], kind: str, heads: list[int | None]) -> None:
        self.prefix, self.parts, self.kind, self.heads = prefix, parts, kind, heads
        from app.inference.quantization.ggml import MIXED_BLOCKS_FORMAT, WIDE_TYPES

        types = {p.type_name for p in parts}
        if kind != "matrix":
            self.type_name, self.format = "F32", "q0f32"
        elif len(types) == 1:
            self.type_name = types.pop()
            self.format = _format_names()[self.type_name]
        elif types <= set(WIDE_TYPES):  # different block types: one int8 + scale/offset layout
            self.type_name, self.format = "mixed", MIXED_BLOCKS_FORMAT
        else:  # blocks mixed with F16/BF16/F32: exact fp32 values
            self.type_name, self.format = "F32", "q0f32"

    def suffixes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Parameter name suffix -> (shape, dtype) of what this group writes."""
        if self.kind != "matrix":
            return {"": ((sum(p.shape[0] for p in self.parts),), "float32")}
        from app.inference.quantization import get_format

        fmt = get_format(self.format)
        out_f = sum(p.shape[0] for p in self.parts)
        return {f".{k}": v for k, v in fmt.param_specs(out_f, self.parts[0].shape[1]).items()}

    def arrays(self) -> dict[str, np.ndarray]:
        """Parameter name suffix -> array, converted from the GGUF's tensors."""
        import gguf

        from app.inference.quantization.ggml import GGML_WIDE, params_from_gguf

        if self.kind != "matrix":
            return {"": np.concatenate([_as_f32(p).reshape(-1) for p in self.parts])}
        rows = []
        for part, n_head in zip(self.parts, self.heads, strict=True):
            data = np.asarray(part.data)
            if self.type_name == "F32" and part.type_name != "F32":  # exact fp32 values
                data = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[part.type_name])
            data = data.reshape(part.shape[0], -1)
            if n_head:
                data = _unpermute_rows(data, n_head)
            rows.append(data)
        in_f = self.parts[0].shape[1]
        if self.type_name == "mixed":
            params = GGML_WIDE.from_parts(
                [(p.type_name, r, p.shape[0], in_f) for p, r in zip(self.parts, rows, strict=True)]
            )
        else:
            raw = rows[0] if len(rows) == 1 else np.concatenate(rows, axis=0)
            params = params_from_gguf(self.type_name, raw, raw.shape[0], in_f)
        return {f".{k}": v for k, v in params.items()}


def _format_names() -> dict[str, str]:
    from app.inference.quantization.ggml import GGUF_TYPE_FORMATS

    return GGUF_TYPE_FORMATS


def _as_f32(t: GGUFTensor) -> np.ndarray:
    import gguf

    if t.type_name == "F32":
        return np.asarray(t.data, np.float32)
    values = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType[t.type_name])
    return values.astype(np.float32)


def plan_groups(g: GGUFFile) -> list[_Group]:
    """Every MLC parameter group of the model, in MLC's order; LlmchatError for a missing tensor."""
    t = g.tensors

    def need(name: str) -> GGUFTensor:
        if name not in t:
            raise LlmchatError(
                f"{g.path}: tensor {name!r} is missing.",
                "the GGUF is incomplete or of another architecture; convert it again",
            )
        return t[name]

    heads = _int(g, "attention.head_count")
    kv_heads = _int(g, "attention.head_count_kv", heads)
    permute = g.architecture in PERMUTED_QK
    qkv_name = QKV_NAMES[MODEL_TYPES[g.architecture]]
    groups = [_Group("model.embed_tokens", [need("token_embd.weight")], "matrix", [None])]
    for i in range(_int(g, "block_count")):
        b = f"blk.{i}"
        for key, parts in _LAYER_MATRICES:
            name = qkv_name if key == "qkv" else key
            tensors = [need(f"{b}.{p}.weight") for p in parts]
            perm: list[int | None] = [None] * len(parts)
            if key == "qkv" and permute:
                perm = [heads, kv_heads, None]
            groups.append(_Group(f"model.layers.{i}.{name}", tensors, "matrix", perm))
            if key == "qkv" and f"{b}.attn_q.bias" in t:
                biases = [need(f"{b}.{p}.bias") for p in parts]
                groups.append(_Group(f"model.layers.{i}.{name}.bias", biases, "bias", [None] * 3))
        for gg, mlc in _LAYER_NORMS.items():
            norm = need(f"{b}.{gg}.weight")
            groups.append(_Group(f"model.layers.{i}.{mlc}.weight", [norm], "vector", [None]))
    groups.append(_Group("model.norm.weight", [need("output_norm.weight")], "vector", [None]))
    if "output.weight" in t:
        groups.append(_Group("lm_head", [t["output.weight"]], "matrix", [None]))
    return groups


class _LazyParams(Mapping[str, np.ndarray]):
    """name -> array, converted group by group as ``write_tensor_cache`` asks for them."""

    def __init__(
        self,
        groups: list[_Group],
        on_group: Callable[[int], None] | None = None,
        source: str = "",
        tokens: list[str] | None = None,
    ) -> None:
        self.groups = groups
        self.source = source
        self.tokens = tokens or []
        self.on_group = on_group
        self.index: dict[str, int] = {}
        self.names: list[str] = []
        for gi, grp in enumerate(groups):
            for suffix in grp.suffixes():
                self.index[grp.prefix + suffix] = gi
                self.names.append(grp.prefix + suffix)
        self._cached: tuple[int, dict[str, np.ndarray]] | None = None

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __getitem__(self, name: str) -> np.ndarray:
        gi = self.index[name]
        if self._cached is None or self._cached[0] != gi:
            grp = self.groups[gi]
            self._cached = (gi, {grp.prefix + s: a for s, a in grp.arrays().items()})
            if self.on_group:
                self.on_group(gi)
        return self._cached[1][name]


def _check_against_engine(config: dict[str, Any], params: _LazyParams) -> None:
    """The parameters the engine's model takes are exactly the ones written (names, shapes, dtypes)."""
    from app.inference.compile.build import parameter_specs
    from app.inference.store.config import ModelConfig, check_tokenizer_fits

    source = f"{params.source}"
    cfg = ModelConfig.from_dict(config, source=source)  # the validation layer: names the field
    check_tokenizer_fits(cfg, len(params.tokens), source)
    q_rows = cfg.num_attention_heads * cfg.head_dim
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    for grp in params.groups:
        if grp.kind == "vector":
            continue
        for part in grp.parts:
            if len(part.shape) != (2 if grp.kind == "matrix" else 1) or min(part.shape) <= 0:
                raise LlmchatError(
                    f"{source}: tensor {part.name!r} has the shape {tuple(part.shape)}.",
                    "the file is damaged; convert it again with a recent llama.cpp",
                )
        if grp.kind == "matrix" and len({p.shape[1] for p in grp.parts}) != 1:
            shapes = ", ".join(f"{p.name} {tuple(p.shape)}" for p in grp.parts)
            raise LlmchatError(
                f"{source}: the tensors fused into {grp.prefix} disagree in width ({shapes}).",
                "the file is damaged; convert it again with a recent llama.cpp",
            )
        if grp.prefix.endswith(QKV_NAMES[cfg.model_type]) or grp.prefix.endswith(".bias"):
            rows = [p.shape[0] for p in grp.parts]
            if len(rows) == 3 and rows != [q_rows, kv_rows, kv_rows]:
                raise LlmchatError(
                    f"{source}: Q/K/V of {grp.prefix} have {rows} rows; the metadata's heads and head_dim "
                    f"make {[q_rows, kv_rows, kv_rows]}.",
                    "the file is damaged; convert it again with a recent llama.cpp",
                )
    expected = {p["name"]: (tuple(p["shape"]), str(p["dtype"])) for p in parameter_specs(cfg)}
    written: dict[str, tuple[tuple[int, ...], str]] = {}
    for grp in params.groups:
        for suffix, (shape, dtype) in grp.suffixes().items():
            written[grp.prefix + suffix] = (tuple(shape), dtype)
    if written != expected:
        missing = sorted(set(expected) - set(written))[:3]
        extra = sorted(set(written) - set(expected))[:3]
        wrong = sorted(k for k in set(written) & set(expected) if written[k] != expected[k])[:3]
        raise LlmchatError(
            f"The GGUF's tensors do not fit llmchat's {config['model_type']} model "
            f"(missing {missing}, unexpected {extra}, wrong shape {wrong}).",
            "this GGUF variant is not supported; report it with the file's name",
        )


# ------------------------------------------------------------------------------------------
# Import
# ------------------------------------------------------------------------------------------
def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")


@contextlib.contextmanager
def _as_message(path: Path) -> Iterator[None]:
    """Whatever a malformed file makes numpy, gguf or the model code raise becomes an LlmchatError."""
    try:
        yield
    except (LlmchatError, OSError, KeyboardInterrupt):
        raise
    except Exception as err:
        raise LlmchatError(
            f"{path} cannot be imported: {type(err).__name__}: {str(err)[:300]}",
            "the file is damaged or of a variant llmchat does not know; convert it again "
            "with a recent llama.cpp",
        ) from err


def import_gguf(path: str | Path, name: str | None = None, progress: ProgressCallback | None = None) -> Path:
    """Import the GGUF at ``path`` as model ``name`` (default: from the file name); its directory."""
    path = Path(path).expanduser()
    name = _check_name(name or default_name(path))
    target = paths.models_dir() / name
    if target.exists():
        raise LlmchatError(
            f"A model named {name!r} is already installed ({target}).",
            f"choose another name with --name, or remove it first: llmchat remove {name}",
        )

    def report(message: str, done: float | None = None, total: float | None = None) -> None:
        if progress:
            progress(ProgressEvent("import", message, done, total))

    report(f"reading {path.name}")
    with _as_message(path):  # a damaged or odd file ends in a message, never a traceback
        g = read_gguf(path)
        tok = build_tokenizer(g.metadata)
        groups = plan_groups(g)
        tensor_formats = {grp.prefix: grp.format for grp in groups if grp.kind == "matrix"}
        config = model_config(g, tok, tensor_formats)
        total = len(groups)
        params = _LazyParams(
            groups,
            lambda gi: report(f"converting {groups[gi].prefix}", gi + 1, total),
            source=str(path),
            tokens=list(tok.tokens),
        )
        _check_against_engine(config, params)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{name}.importing-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        staging.mkdir(parents=True)
        from app.inference.store.weights import write_tensor_cache

        with _as_message(path):
            write_tensor_cache(params, staging, shard_bytes=SHARD_BYTES)
        tok.tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tok.tokenizer_config(config["context_window_size"]))
        _write_json(
            staging / "generation_config.json",
            {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids},
        )
        _write_json(staging / "mlc-chat-config.json", config)
        _write_json(staging / IMPORT_RECORD, {"source": str(path.resolve())})
        # everything parses as a load parses it (the chat template too): nothing is installed that
        # cannot load
        try:
            check_model_files(staging)
        except LlmchatError as err:
            raise LlmchatError(
                f"{path}: {err.problem.replace(str(staging), name)}",
                "the GGUF's metadata is broken: convert the model again with a recent "
                "llama.cpp, or use another GGUF of it",
            ) from None
        try:
            if target.exists():
                raise FileExistsError(target)
            os.replace(staging, target)
        except OSError as err:
            if target.exists():
                raise LlmchatError(
                    f"A model named {name!r} appeared while importing ({target}).",
                    f"choose another name with --name, or remove it: llmchat remove {name}",
                ) from err
            raise
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        from app.errors import os_error

        raise os_error(
            err,
            f"Writing the model to {target.parent} failed",
            "free some disk space or check the permissions of the data directory",
        ) from err
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report(f"imported {name}", total, total)
    return target
