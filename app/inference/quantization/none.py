"""Unquantized weights ``q0f16`` / ``q0f32``: a plain ``weight [out, in]`` in the model dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from app.inference.quantization.base import ParamSpecs, WeightFormat, register_format


class Unquantized(WeightFormat):
    """Weights stored as they are; matmuls go through Relax's own ops (best default schedules)."""

    def __init__(self, name: str, model_dtype: str) -> None:
        self.name = name
        self.model_dtype = model_dtype

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        return {"weight": ((out_features, in_features), self.model_dtype)}

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        return params["weight"][row, col].astype("float32")

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        return {"weight": np.asarray(w).astype(self.model_dtype)}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.asarray(params["weight"]).astype(np.float64)

    def linear(
        self, in_features: int, out_features: int, bias: bool, dtype: str, bias_dtype: str | None = None
    ) -> Any:
        if dtype != self.model_dtype or (bias and (bias_dtype or dtype) != dtype):
            # stored and computed dtypes differ: the generic module casts inside the reduction
            return super().linear(in_features, out_features, bias, dtype, bias_dtype)
        from tvm.relax.frontend import nn

        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)

    def embedding(self, num_embeddings: int, embedding_dim: int, dtype: str) -> Any:
        if dtype != self.model_dtype:
            return super().embedding(num_embeddings, embedding_dim, dtype)
        return _embedding_class()(num_embeddings, embedding_dim, dtype=dtype)


_CLASS: list[type] = []


def _embedding_class() -> type:
    """``nn.Embedding`` plus ``lm_head_forward`` (tied lm_head), as MLC's LlamaEmbedding."""
    if _CLASS:
        return _CLASS[0]
    from tvm.relax.frontend import nn

    class TiedEmbedding(nn.Embedding):
        def lm_head_forward(self, x: Any) -> Any:
            return nn.op.matmul(x, nn.op.permute_dims(self.weight), out_dtype="float32")

    _CLASS.append(TiedEmbedding)
    return TiedEmbedding


Q0F16 = register_format(Unquantized("q0f16", "float16"))
Q0F32 = register_format(Unquantized("q0f32", "float32"))
