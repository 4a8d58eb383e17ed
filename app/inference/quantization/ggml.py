"""GGUF (llama.cpp) tensor types as engine weight formats: imported losslessly, dequantized in the matmul.

GGUF stores a ``[out, in]`` matrix as rows of blocks of 32 values along ``in``:

* Q4_0 — fp16 ``d`` + 16 bytes of nibbles; byte ``j`` holds element ``j`` (low nibble) and ``j + 16``
  (high nibble); value = ``(q - 8) * d``.
* Q4_1 — fp16 ``d``, fp16 ``m`` + 16 bytes as Q4_0; value = ``q * d + m``.
* Q8_0 — fp16 ``d`` + 32 int8; value = ``q * d``.

The import repacks the blocks without changing a bit of information into arrays TVM handles well:
4-bit values in uint32 words in MLC's order (element ``8w + r`` in bits ``4r..4r+3`` of word ``w``,
``q_weight [out, in/8]``), int8 values as ``q_weight [out, in]``, and the block scales (and minima)
as fp16 ``[out, in/32]``.  F16 weights stay fp16 (``ggml_f16``); BF16 weights keep their 16 bits
as uint16 (``ggml_bf16``, widened exactly to fp32 by a shift); F32 weights use ``q0f32``.  Models
imported from GGUF compute in float32 (activations, norms, KV cache), so nothing is rounded on the
way in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from app.errors import LlmchatError
from app.inference.quantization.base import ParamSpecs, WeightFormat, register_format

BLOCK = 32  # values per GGUF block for every block type here
PER_WORD = 8  # 4-bit values per uint32 word

#: GGUF tensor type -> weight format name (for matrices: linear layers and embeddings)
GGUF_TYPE_FORMATS: dict[str, str] = {
    "F32": "q0f32",
    "F16": "ggml_f16",
    "BF16": "ggml_bf16",
    "Q8_0": "ggml_q8_0",
    "Q4_0": "ggml_q4_0",
    "Q4_1": "ggml_q4_1",
}


def _check_blocks(name: str, out_features: int, in_features: int) -> None:
    if in_features % BLOCK:
        raise LlmchatError(
            f"{name}: an input dimension of {in_features} is not a multiple of the block size {BLOCK}.",
            "this GGUF tensor cannot be stored in blocks; use an F16/F32 GGUF",
        )


def _blocks(raw: np.ndarray, out_features: int, in_features: int, block_bytes: int) -> np.ndarray:
    """GGUF's raw rows (uint8 ``[out, in/32 * block_bytes]``) as ``[out, in/32, block_bytes]``."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return raw.reshape(out_features, in_features // BLOCK, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 stored at byte ``start`` of every block, ``[out, nblocks]``."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 values in GGUF's element order, ``[out, nblocks * 32]``."""
    vals = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    return vals.reshape(qs.shape[0], -1)


def _pack_words(vals: np.ndarray) -> np.ndarray:
    """``[out, in]`` 4-bit values -> ``[out, in/8]`` uint32, element ``8w + r`` at bits ``4r``."""
    v = vals.astype(np.uint32).reshape(vals.shape[0], -1, PER_WORD)
    words = np.zeros(v.shape[:2], np.uint32)
    for r in range(PER_WORD):
        words |= v[..., r] << np.uint32(4 * r)
    return words


def _unpack_words(words: np.ndarray) -> np.ndarray:
    """Inverse of ``_pack_words``."""
    vals = np.stack([(words >> np.uint32(4 * r)) & np.uint32(15) for r in range(PER_WORD)], axis=-1)
    return vals.reshape(words.shape[0], -1)


def _pack_nibble_blocks(vals: np.ndarray) -> np.ndarray:
    """``[out, in]`` 4-bit values -> GGUF's 16 bytes per block, ``[out, in/32, 16]``."""
    v = vals.astype(np.uint8).reshape(vals.shape[0], -1, 2, BLOCK // 2)
    return v[:, :, 0, :] | (v[:, :, 1, :] << np.uint8(4))


class GGMLFormat(WeightFormat):
    """A GGUF tensor type as a weight format (dequantized inside the reduction, fp32 math)."""

    gguf_type: str = ""
    model_dtype = "float32"

    def __init__(self, name: str, gguf_type: str) -> None:
        self.name = name
        self.gguf_type = gguf_type

    def check_shape(self, out_features: int, in_features: int) -> None:
        _check_blocks(self.name, out_features, in_features)

    # -- GGUF <-> params --------------------------------------------------------------------
    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        """This format's params from a GGUF tensor's raw data (lossless)."""
        raise NotImplementedError

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        """The GGUF raw rows (uint8 ``[out, bytes]``) back from this format's params."""
        raise NotImplementedError

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        import gguf

        w = np.asarray(w, dtype=np.float32)
        self.check_shape(*w.shape)
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[self.gguf_type])
        return self.from_gguf(raw, *w.shape)


class Q4_0(GGMLFormat):
    """``q_weight [out, in/8]`` uint32, ``q_scale [out, in/32]`` fp16; value = (q - 8) * d."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features // PER_WORD), "uint32"),
            "q_scale": ((out_features, in_features // BLOCK), "float16"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        from tvm import tirx

        word = params["q_weight"][row, col // PER_WORD]
        shift = (col % PER_WORD).astype("uint32") * tirx.const(4, "uint32")
        q = ((word >> shift) & tirx.const(15, "uint32")).astype("float32")
        d = params["q_scale"][row, col // BLOCK].astype("float32")
        return (q - tirx.const(8.0, "float32")) * d

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        self.check_shape(out_features, in_features)
        b = _blocks(raw, out_features, in_features, 18)
        return {"q_weight": _pack_words(_unpack_nibbles(b[..., 2:])), "q_scale": _f16(b, 0).copy()}

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        d = np.ascontiguousarray(params["q_scale"], np.float16)[..., None].view(np.uint8)
        qs = _pack_nibble_blocks(_unpack_words(params["q_weight"]))
        return np.concatenate([d, qs], axis=-1).reshape(d.shape[0], -1)

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = _unpack_words(params["q_weight"]).astype(np.float64) - 8.0
        return q * np.repeat(params["q_scale"].astype(np.float64), BLOCK, axis=1)


class Q4_1(GGMLFormat):
    """Q4_0's layout plus ``q_min [out, in/32]`` fp16; value = q * d + m."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features // PER_WORD), "uint32"),
            "q_scale": ((out_features, in_features // BLOCK), "float16"),
            "q_min": ((out_features, in_features // BLOCK), "float16"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        from tvm import tirx

        word = params["q_weight"][row, col // PER_WORD]
        shift = (col % PER_WORD).astype("uint32") * tirx.const(4, "uint32")
        q = ((word >> shift) & tirx.const(15, "uint32")).astype("float32")
        d = params["q_scale"][row, col // BLOCK].astype("float32")
        m = params["q_min"][row, col // BLOCK].astype("float32")
        return q * d + m

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        self.check_shape(out_features, in_features)
        b = _blocks(raw, out_features, in_features, 20)
        return {
            "q_weight": _pack_words(_unpack_nibbles(b[..., 4:])),
            "q_scale": _f16(b, 0).copy(),
            "q_min": _f16(b, 2).copy(),
        }

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        d = np.ascontiguousarray(params["q_scale"], np.float16)[..., None].view(np.uint8)
        m = np.ascontiguousarray(params["q_min"], np.float16)[..., None].view(np.uint8)
        qs = _pack_nibble_blocks(_unpack_words(params["q_weight"]))
        return np.concatenate([d, m, qs], axis=-1).reshape(d.shape[0], -1)

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = _unpack_words(params["q_weight"]).astype(np.float64)
        d = np.repeat(params["q_scale"].astype(np.float64), BLOCK, axis=1)
        m = np.repeat(params["q_min"].astype(np.float64), BLOCK, axis=1)
        return q * d + m


class Q8_0(GGMLFormat):
    """``q_weight [out, in]`` int8, ``q_scale [out, in/32]`` fp16; value = q * d."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features), "int8"),
            "q_scale": ((out_features, in_features // BLOCK), "float16"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        q = params["q_weight"][row, col].astype("float32")
        return q * params["q_scale"][row, col // BLOCK].astype("float32")

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        self.check_shape(out_features, in_features)
        b = _blocks(raw, out_features, in_features, 34)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(out_features, in_features)
        return {"q_weight": q, "q_scale": _f16(b, 0).copy()}

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        d = np.ascontiguousarray(params["q_scale"], np.float16)[..., None].view(np.uint8)
        q = np.ascontiguousarray(params["q_weight"], np.int8).reshape(d.shape[0], d.shape[1], BLOCK)
        return np.concatenate([d, q.view(np.uint8)], axis=-1).reshape(d.shape[0], -1)

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = params["q_weight"].astype(np.float64)
        return q * np.repeat(params["q_scale"].astype(np.float64), BLOCK, axis=1)


class F16(GGMLFormat):
    """``weight [out, in]`` fp16, widened to fp32 inside the matmul."""

    def check_shape(self, out_features: int, in_features: int) -> None:
        """Any shape."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {"weight": ((out_features, in_features), "float16")}

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        return params["weight"][row, col].astype("float32")

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        data = np.ascontiguousarray(raw)
        if data.dtype != np.float16:
            data = data.view(np.float16)
        return {"weight": data.reshape(out_features, in_features)}

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.asarray(params["weight"], np.float16)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        return {"weight": np.asarray(w, np.float16)}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.asarray(params["weight"]).astype(np.float64)


class BF16(GGMLFormat):
    """``weight [out, in]`` bfloat16 bits in uint16; fp32 = bits << 16 (exact)."""

    def check_shape(self, out_features: int, in_features: int) -> None:
        """Any shape."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {"weight": ((out_features, in_features), "uint16")}

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        from tvm import tirx

        bits = params["weight"][row, col].astype("uint32") << tirx.const(16, "uint32")
        return tirx.reinterpret("float32", bits)

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        bits = np.ascontiguousarray(raw).view(np.uint16)
        return {"weight": bits.reshape(out_features, in_features)}

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(params["weight"], np.uint16).view(np.uint8)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        bits = np.asarray(w, np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return {"weight": rounded.astype(np.uint16)}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        bits = params["weight"].astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).astype(np.float64)


GGML_Q4_0 = register_format(Q4_0("ggml_q4_0", "Q4_0"))
GGML_Q4_1 = register_format(Q4_1("ggml_q4_1", "Q4_1"))
GGML_Q8_0 = register_format(Q8_0("ggml_q8_0", "Q8_0"))
GGML_F16 = register_format(F16("ggml_f16", "F16"))
GGML_BF16 = register_format(BF16("ggml_bf16", "BF16"))


def params_from_gguf(
    type_name: str, raw: np.ndarray, out_features: int, in_features: int
) -> dict[str, np.ndarray]:
    """Params (suffix -> array) of a GGUF matrix in the format ``GGUF_TYPE_FORMATS[type_name]``."""
    if type_name == "F32":
        return {"weight": np.ascontiguousarray(raw, np.float32).reshape(out_features, in_features)}
    fmt = FORMAT_OF_TYPE[type_name]
    return fmt.from_gguf(raw, out_features, in_features)


FORMAT_OF_TYPE: dict[str, GGMLFormat] = {
    f.gguf_type: f for f in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_F16, GGML_BF16)
}
