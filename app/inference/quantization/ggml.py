"""GGUF (llama.cpp) tensor types as engine weight formats: imported losslessly, dequantized in the matmul.

GGUF stores a ``[out, in]`` matrix as rows of blocks of 32 values along ``in``:

* Q4_0 — fp16 ``d`` + 16 bytes of nibbles; byte ``j`` holds element ``j`` (low nibble) and ``j + 16``
  (high nibble); value = ``(q - 8) * d``.
* Q4_1 — fp16 ``d``, fp16 ``m`` + 16 bytes as Q4_0; value = ``q * d + m``.
* Q8_0 — fp16 ``d`` + 32 int8; value = ``q * d``.
* K-quants (super-blocks of 256): Q4_K / Q5_K — fp16 ``d``, ``dmin``, 8 six-bit scales and minima,
  4- or 5-bit values; value = ``(d * sc) * q - dmin * m`` per sub-block of 32.  Q6_K — 6-bit values,
  16 int8 scales, fp16 ``d``; value = ``(d * sc) * (q - 32)`` per sub-block of 16.

The import repacks the blocks without changing a bit of information into arrays TVM handles well:
4-bit values in uint32 words in MLC's order (element ``8w + r`` in bits ``4r..4r+3`` of word ``w``,
``q_weight [out, in/8]``), int8 values as ``q_weight [out, in]``, and the block scales (and minima)
widened exactly from fp16 to fp32 ``[out, in/32]`` (fp16 scales cost a conversion per weight in the
CPU kernels: ~30 % slower decode).  K-quants keep their integer values (4-bit words, or int8) and store the
sub-block products ``d * sc`` / ``dmin * m`` as fp32 — exact, as fp16 times a 6/8-bit integer fits
fp32's mantissa — so every weight dequantizes to the value llama.cpp computes.  A fused matrix
(q, k, v or gate, up) whose parts differ in block type uses ``ggml_wide``: int8 values with an fp32
scale and offset per 16.  F16 weights stay fp16 (``ggml_f16``); BF16 weights keep their 16 bits
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

BLOCK = 32  # values per block of Q4_0, Q4_1, Q8_0
PER_WORD = 8  # 4-bit values per uint32 word

#: GGUF tensor type -> weight format name (for matrices: linear layers and embeddings)
GGUF_TYPE_FORMATS: dict[str, str] = {
    "F32": "q0f32",
    "F16": "ggml_f16",
    "BF16": "ggml_bf16",
    "Q8_0": "ggml_q8_0",
    "Q4_0": "ggml_q4_0",
    "Q4_1": "ggml_q4_1",
    "Q4_K": "ggml_q4_k",
    "Q5_K": "ggml_q5_k",
    "Q6_K": "ggml_q6_k",
}
#: format of a fused matrix whose parts have different block types (see ``WideBlocks``)
MIXED_BLOCKS_FORMAT = "ggml_wide"
QK_K = 256  # values per K-quant super-block


def _check_blocks(name: str, out_features: int, in_features: int) -> None:
    if in_features % BLOCK:
        raise LlmchatError(
            f"{name}: an input dimension of {in_features} is not a multiple of the block size {BLOCK}.",
            "this GGUF tensor cannot be stored in blocks; use an F16/F32 GGUF",
        )


def _blocks(
    raw: np.ndarray, out_features: int, in_features: int, block_bytes: int, values: int = BLOCK
) -> np.ndarray:
    """GGUF's raw rows (uint8 ``[out, in/values * block_bytes]``) as ``[out, in/values, block_bytes]``."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return raw.reshape(out_features, in_features // values, block_bytes)


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
    """A GGUF tensor type as a weight format (dequantized inside the reduction, fp32 math).

    Block formats also ``decompose`` raw GGUF rows into integer values ``q [out, in]`` and fp32
    ``scale``/``offset`` per 16 or 32 values with ``value = q * scale + offset`` (``ggml_wide``).
    """

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
    """``q_weight [out, in/8]`` uint32, ``q_scale [out, in/32]`` fp32 (GGUF's fp16 d); value = (q - 8) * d."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features // PER_WORD), "uint32"),
            "q_scale": ((out_features, in_features // BLOCK), "float32"),
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
        q = _pack_words(_unpack_nibbles(b[..., 2:]))
        return {"q_weight": q, "q_scale": _f16(b, 0).astype(np.float32)}

    def decompose(self, raw: np.ndarray, out_f: int, in_f: int):
        b = _blocks(raw, out_f, in_f, 18)
        q = _unpack_nibbles(b[..., 2:]).astype(np.int8) - np.int8(8)
        d = _f16(b, 0).astype(np.float32)
        return q, d, np.zeros_like(d)

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        d = np.ascontiguousarray(params["q_scale"]).astype(np.float16)[..., None].view(np.uint8)
        qs = _pack_nibble_blocks(_unpack_words(params["q_weight"]))
        return np.concatenate([d, qs], axis=-1).reshape(d.shape[0], -1)

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = _unpack_words(params["q_weight"]).astype(np.float64) - 8.0
        return q * np.repeat(params["q_scale"].astype(np.float64), BLOCK, axis=1)


class Q4_1(GGMLFormat):
    """Q4_0's layout plus ``q_min [out, in/32]`` fp32 (GGUF's fp16 m); value = q * d + m."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features // PER_WORD), "uint32"),
            "q_scale": ((out_features, in_features // BLOCK), "float32"),
            "q_min": ((out_features, in_features // BLOCK), "float32"),
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
            "q_scale": _f16(b, 0).astype(np.float32),
            "q_min": _f16(b, 2).astype(np.float32),
        }

    def decompose(self, raw: np.ndarray, out_f: int, in_f: int):
        b = _blocks(raw, out_f, in_f, 20)
        return (
            _unpack_nibbles(b[..., 4:]).astype(np.int8),
            _f16(b, 0).astype(np.float32),
            _f16(b, 2).astype(np.float32),
        )

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        d = np.ascontiguousarray(params["q_scale"]).astype(np.float16)[..., None].view(np.uint8)
        m = np.ascontiguousarray(params["q_min"]).astype(np.float16)[..., None].view(np.uint8)
        qs = _pack_nibble_blocks(_unpack_words(params["q_weight"]))
        return np.concatenate([d, m, qs], axis=-1).reshape(d.shape[0], -1)

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = _unpack_words(params["q_weight"]).astype(np.float64)
        d = np.repeat(params["q_scale"].astype(np.float64), BLOCK, axis=1)
        m = np.repeat(params["q_min"].astype(np.float64), BLOCK, axis=1)
        return q * d + m


class Q8_0(GGMLFormat):
    """``q_weight [out, in]`` int8, ``q_scale [out, in/32]`` fp32 (GGUF's fp16 d); value = q * d."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features), "int8"),
            "q_scale": ((out_features, in_features // BLOCK), "float32"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        q = params["q_weight"][row, col].astype("float32")
        return q * params["q_scale"][row, col // BLOCK].astype("float32")

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        self.check_shape(out_features, in_features)
        b = _blocks(raw, out_features, in_features, 34)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(out_features, in_features)
        return {"q_weight": q, "q_scale": _f16(b, 0).astype(np.float32)}

    def decompose(self, raw: np.ndarray, out_f: int, in_f: int):
        p = self.from_gguf(raw, out_f, in_f)
        d = p["q_scale"].astype(np.float32)
        return p["q_weight"], d, np.zeros_like(d)

    def to_gguf(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        d = np.ascontiguousarray(params["q_scale"]).astype(np.float16)[..., None].view(np.uint8)
        q = np.ascontiguousarray(params["q_weight"], np.int8).reshape(d.shape[0], d.shape[1], BLOCK)
        return np.concatenate([d, q.view(np.uint8)], axis=-1).reshape(d.shape[0], -1)

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = params["q_weight"].astype(np.float64)
        return q * np.repeat(params["q_scale"].astype(np.float64), BLOCK, axis=1)


# ------------------------------------------------------------------------------------------
# K-quants (super-blocks of 256)
# ------------------------------------------------------------------------------------------
def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minima packed in 12 bytes (Q4_K, Q5_K), as uint8 ``[..., 8]``."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 4-bit values of a Q4_K/Q5_K super-block, ``[..., 8, 32]`` in element order."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & np.uint8(0x0F)).reshape(*qs.shape[:-1], 8, 32)


class _KQuant(GGMLFormat):
    """Shared parts of the K-quant formats (rows must hold whole super-blocks of 256)."""

    def check_shape(self, out_features: int, in_features: int) -> None:
        if in_features % QK_K:
            raise LlmchatError(
                f"{self.name}: an input dimension of {in_features} is not a multiple of {QK_K}.",
                "this GGUF tensor is malformed; convert the model again",
            )

    def _scale_min(self, raw: np.ndarray, out_f: int, in_f: int, nbytes: int):
        b = _blocks(raw, out_f, in_f, nbytes, QK_K).reshape(-1, nbytes)  # one row per super-block
        d = _f16(b, 0).astype(np.float32)[:, None]
        dmin = _f16(b, 2).astype(np.float32)[:, None]
        sc, mn = _k_scale_min(b[:, 4:16])
        scale = (d * sc.astype(np.float32)).reshape(out_f, in_f // 32)  # exact in fp32
        minimum = (dmin * mn.astype(np.float32)).reshape(out_f, in_f // 32)
        return b, scale, minimum

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"{self.name} weights come only from GGUF files")


class Q4_K(_KQuant):
    """``q_weight [out, in/8]`` uint32 nibbles, ``q_scale``/``q_min [out, in/32]`` fp32; q * scale - min."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features // PER_WORD), "uint32"),
            "q_scale": ((out_features, in_features // 32), "float32"),
            "q_min": ((out_features, in_features // 32), "float32"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        from tvm import tirx

        word = params["q_weight"][row, col // PER_WORD]
        shift = (col % PER_WORD).astype("uint32") * tirx.const(4, "uint32")
        q = ((word >> shift) & tirx.const(15, "uint32")).astype("float32")
        return q * params["q_scale"][row, col // 32] - params["q_min"][row, col // 32]

    def decompose(self, raw: np.ndarray, out_f: int, in_f: int):
        b, scale, minimum = self._scale_min(raw, out_f, in_f, 144)
        q = _k_low_nibbles(b[:, 16:144]).reshape(out_f, in_f)
        return q, scale, -minimum

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        self.check_shape(out_features, in_features)
        q, scale, offset = self.decompose(raw, out_features, in_features)
        return {"q_weight": _pack_words(q), "q_scale": scale, "q_min": -offset}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = _unpack_words(params["q_weight"]).astype(np.float64)
        scale = np.repeat(params["q_scale"].astype(np.float64), 32, axis=1)
        return q * scale - np.repeat(params["q_min"].astype(np.float64), 32, axis=1)


class Q5_K(_KQuant):
    """``q_weight [out, in]`` uint8 (5-bit values), ``q_scale``/``q_min [out, in/32]`` fp32."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features), "uint8"),
            "q_scale": ((out_features, in_features // 32), "float32"),
            "q_min": ((out_features, in_features // 32), "float32"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        q = params["q_weight"][row, col].astype("float32")
        return q * params["q_scale"][row, col // 32] - params["q_min"][row, col // 32]

    def decompose(self, raw: np.ndarray, out_f: int, in_f: int):
        b, scale, minimum = self._scale_min(raw, out_f, in_f, 176)
        low = _k_low_nibbles(b[:, 48:176])
        high = (b[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & np.uint8(1)
        q = (low | (high << np.uint8(4))).reshape(out_f, in_f)
        return q, scale, -minimum

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        self.check_shape(out_features, in_features)
        q, scale, offset = self.decompose(raw, out_features, in_features)
        return {"q_weight": q.astype(np.uint8), "q_scale": scale, "q_min": -offset}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = params["q_weight"].astype(np.float64)
        scale = np.repeat(params["q_scale"].astype(np.float64), 32, axis=1)
        return q * scale - np.repeat(params["q_min"].astype(np.float64), 32, axis=1)


class Q6_K(_KQuant):
    """``q_weight [out, in]`` int8 (q - 32), ``q_scale [out, in/16]`` fp32 (= d * sc, exact)."""

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features), "int8"),
            "q_scale": ((out_features, in_features // 16), "float32"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        return params["q_scale"][row, col // 16] * params["q_weight"][row, col].astype("float32")

    def _parts(self, raw: np.ndarray, out_f: int, in_f: int):
        b = _blocks(raw, out_f, in_f, 210, QK_K).reshape(-1, 210)
        ql = b[:, 0:128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        ql = (ql & np.uint8(0x0F)).reshape(-1, 8, 32)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        qh = (qh & np.uint8(0x03)).reshape(-1, 8, 32)
        q = ((ql | (qh << np.uint8(4))).astype(np.int16) - 32).astype(np.int8).reshape(out_f, in_f)
        sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).reshape(out_f, in_f // 16)
        d = _f16(b, 208).reshape(out_f, in_f // QK_K)
        return q, sc, d

    def decompose(self, raw: np.ndarray, out_f: int, in_f: int):
        q, sc, d = self._parts(raw, out_f, in_f)
        scale = np.repeat(d.astype(np.float32), QK_K // 16, axis=1) * sc.astype(np.float32)
        return q, scale, np.zeros_like(scale)

    def from_gguf(self, raw: np.ndarray, out_features: int, in_features: int) -> dict[str, np.ndarray]:
        self.check_shape(out_features, in_features)
        q, scale, _ = self.decompose(raw, out_features, in_features)
        return {"q_weight": q, "q_scale": scale}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        scale = np.repeat(params["q_scale"].astype(np.float64), 16, axis=1)
        return scale * params["q_weight"].astype(np.float64)


class WideBlocks(GGMLFormat):
    """Any mix of block types: int8 values, fp32 scale and offset per 16; value = q * scale + offset.

    Every block type above is ``q * scale (+ offset)`` with integer ``q`` of at most 8 bits and a
    scale/offset constant over 16 or 32 values, so this holds each of them exactly.
    """

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features), "int8"),
            "q_scale": ((out_features, in_features // 16), "float32"),
            "q_min": ((out_features, in_features // 16), "float32"),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        q = params["q_weight"][row, col].astype("float32")
        return q * params["q_scale"][row, col // 16] + params["q_min"][row, col // 16]

    def from_parts(self, parts: list[tuple[str, np.ndarray, int, int]]) -> dict[str, np.ndarray]:
        """Rows of several GGUF tensors ``(type, raw, out, in)`` stacked into one matrix."""
        qs, scales, offsets = [], [], []
        for type_name, raw, out_f, in_f in parts:
            q, scale, offset = FORMAT_OF_TYPE[type_name].decompose(raw, out_f, in_f)
            group = in_f // scale.shape[1]
            if group == 32:
                scale, offset = np.repeat(scale, 2, axis=1), np.repeat(offset, 2, axis=1)
            qs.append(q.astype(np.int8))
            scales.append(scale.astype(np.float32))
            offsets.append(offset.astype(np.float32))
        return {
            "q_weight": np.concatenate(qs),
            "q_scale": np.concatenate(scales),
            "q_min": np.concatenate(offsets),
        }

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        q = params["q_weight"].astype(np.float64)
        scale = np.repeat(params["q_scale"].astype(np.float64), 16, axis=1)
        return q * scale + np.repeat(params["q_min"].astype(np.float64), 16, axis=1)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError("ggml_wide weights come only from GGUF files")


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
GGML_Q4_K = register_format(Q4_K("ggml_q4_k", "Q4_K"))
GGML_Q5_K = register_format(Q5_K("ggml_q5_k", "Q5_K"))
GGML_Q6_K = register_format(Q6_K("ggml_q6_k", "Q6_K"))
GGML_WIDE = register_format(WideBlocks(MIXED_BLOCKS_FORMAT, ""))
#: block types a mixed fused matrix can hold exactly (``ggml_wide``)
WIDE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def params_from_gguf(
    type_name: str, raw: np.ndarray, out_features: int, in_features: int
) -> dict[str, np.ndarray]:
    """Params (suffix -> array) of a GGUF matrix in the format ``GGUF_TYPE_FORMATS[type_name]``."""
    if type_name == "F32":
        return {"weight": np.ascontiguousarray(raw, np.float32).reshape(out_features, in_features)}
    fmt = FORMAT_OF_TYPE[type_name]
    return fmt.from_gguf(raw, out_features, in_features)


FORMAT_OF_TYPE: dict[str, GGMLFormat] = {
    f.gguf_type: f
    for f in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_F16, GGML_BF16, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K)
}
