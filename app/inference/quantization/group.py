"""MLC-LLM's group quantization ``q4f16_1`` / ``q4f32_1``.

Layout (MLC's "NK"): ``q_weight [out, ceil(in / 8)]`` uint32 holding eight 4-bit values, element
``8 * w + r`` in bits ``4r .. 4r + 3`` of word ``w``; ``q_scale [out, ceil(in / 32)]`` in the model
dtype; value = ``(nibble - 7) * scale`` of its group of 32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from app.errors import LlmchatError
from app.inference.quantization.base import ParamSpecs, WeightFormat, register_format

BITS = 4
PER_WORD = 32 // BITS  # 8 values per uint32
GROUP_SIZE = 32
MAX_INT = (1 << (BITS - 1)) - 1  # 7


class GroupQuant4(WeightFormat):
    """4-bit values in uint32 words, one scale per group of 32 along the input dimension."""

    def __init__(self, name: str, model_dtype: str) -> None:
        self.name = name
        self.model_dtype = model_dtype

    def check_shape(self, out_features: int, in_features: int) -> None:
        if in_features % PER_WORD:
            raise LlmchatError(
                f"{self.name}: an input dimension of {in_features} is not a multiple of {PER_WORD}.",
                "use an unquantized (q0f16) model for this architecture",
            )

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {
            "q_weight": ((out_features, in_features // PER_WORD), "uint32"),
            "q_scale": ((out_features, -(-in_features // GROUP_SIZE)), self.model_dtype),
        }

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        from tvm import tirx

        word = params["q_weight"][row, col // PER_WORD]
        shift = (col % PER_WORD).astype("uint32") * tirx.const(BITS, "uint32")
        nibble = (word >> shift) & tirx.const((1 << BITS) - 1, "uint32")
        scale = params["q_scale"][row, col // GROUP_SIZE].astype("float32")
        return (nibble.astype("float32") - tirx.const(float(MAX_INT), "float32")) * scale

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        out_f, in_f = w.shape
        self.check_shape(out_f, in_f)
        groups = -(-in_f // GROUP_SIZE)
        padded = np.zeros((out_f, groups * GROUP_SIZE), np.float64)
        padded[:, :in_f] = w
        g = padded.reshape(out_f, groups, GROUP_SIZE)
        scale = (np.abs(g).max(axis=-1) / MAX_INT).astype(self.model_dtype)
        scale = np.where(scale == 0, np.ones_like(scale), scale)
        q = np.clip(np.round(g / scale.astype(np.float64)[..., None]) + MAX_INT, 0, 2 * MAX_INT)
        q = q.reshape(out_f, groups * GROUP_SIZE)[:, :in_f].astype(np.uint32)
        q = q.reshape(out_f, in_f // PER_WORD, PER_WORD)
        packed = np.zeros((out_f, in_f // PER_WORD), np.uint32)
        for r in range(PER_WORD):
            packed |= q[:, :, r] << np.uint32(BITS * r)
        return {"q_weight": packed, "q_scale": scale}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        packed, scale = params["q_weight"], params["q_scale"]
        out_f, words = packed.shape
        nib = np.stack([(packed >> np.uint32(BITS * r)) & np.uint32(15) for r in range(PER_WORD)], -1)
        vals = nib.reshape(out_f, words * PER_WORD).astype(np.float64) - MAX_INT
        scales = np.repeat(scale.astype(np.float64), GROUP_SIZE, axis=1)[:, : words * PER_WORD]
        return vals * scales


Q4F16_1 = register_format(GroupQuant4("q4f16_1", "float16"))
Q4F32_1 = register_format(GroupQuant4("q4f32_1", "float32"))
