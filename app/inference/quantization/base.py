"""Weight formats: how a linear layer's or an embedding's weight is stored and dequantized.

A ``WeightFormat`` names a storage layout (``q4f16_1``, ``q0f32``, ``ggml_q4_0`` …) and supplies

* ``param_specs(out_features, in_features)``: the stored parameters (suffix -> shape, dtype), e.g.
  ``{"q_weight": ((out, in // 8), "uint32"), "q_scale": ((out, in // 32), "float16")}``;
* ``dequant(params, row, col)``: a TIR expression (float32) for element ``W[row, col]`` from the
  stored ``te.Tensor`` params — the generic modules below put it *inside* the matmul reduction
  for one activation row (decode), and in its own stage of the same kernel for several rows
  (prefill), so that schedules decode each weight once per tile instead of once per row;
* numpy ``quantize(w)`` (tests, random weights) and ``dequantize(params)`` (references).

``linear()`` and ``embedding()`` build ``tvm.relax.frontend.nn`` modules from those; a format can
override them (the unquantized formats use plain ``nn.Linear``).  Formats register themselves in
``FORMATS`` with ``register_format``; ``get_format(name)`` looks one up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from app.errors import LlmchatError

ParamSpecs = dict[str, tuple[tuple[int, ...], str]]


class WeightFormat:
    """A storage layout for 2-D weights ``W[out_features, in_features]``."""

    #: registry name, e.g. "q4f16_1"
    name: str = ""
    #: activation / compute dtype of models whose quantization is this format
    model_dtype: str = "float32"

    # -- what a scheme supplies -------------------------------------------------------------
    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        """Stored parameter suffixes -> (shape, dtype)."""
        raise NotImplementedError

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        """TIR float32 expression of ``W[row, col]`` from the stored ``te.Tensor`` params."""
        raise NotImplementedError

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        """Encode a float matrix ``[out, in]`` into this format's params (numpy)."""
        raise NotImplementedError

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        """Decode this format's params into a float64 matrix ``[out, in]`` (numpy)."""
        raise NotImplementedError

    def check_shape(self, out_features: int, in_features: int) -> None:
        """Raise LlmchatError when a ``[out, in]`` weight cannot be stored in this format."""

    # -- module builders (generic: dequantize inside the reduction) --------------------------
    def linear(
        self, in_features: int, out_features: int, bias: bool, dtype: str, bias_dtype: str | None = None
    ) -> Any:
        """An nn.Module computing ``x @ W.T (+ bias)`` with output dtype ``dtype`` (the activations'),
        the bias stored as ``bias_dtype`` (default: ``dtype``)."""
        return DequantLinear(self, in_features, out_features, bias, dtype, bias_dtype)

    def embedding(self, num_embeddings: int, embedding_dim: int, dtype: str) -> Any:
        """An nn.Module with ``forward(ids)`` (row lookup) and ``lm_head_forward(x)`` (tied head)."""
        return DequantEmbedding(self, num_embeddings, embedding_dim, dtype)


FORMATS: dict[str, WeightFormat] = {}


def register_format(fmt: WeightFormat) -> WeightFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` (later registrations replace earlier ones)."""
    FORMATS[fmt.name] = fmt
    return fmt


def _load_builtin_formats() -> None:
    # imported for their registration side effect
    from app.inference.quantization import group, none  # noqa: F401

    with contextlib.suppress(ImportError):  # GGUF block formats (optional module)
        from app.inference.quantization import ggml  # noqa: F401


def get_format(name: str) -> WeightFormat:
    """The registered format ``name``; LlmchatError listing the known ones otherwise."""
    if not FORMATS or name not in FORMATS:
        _load_builtin_formats()
    if name not in FORMATS:
        raise LlmchatError(
            f"Unsupported quantization {name!r}.",
            f"use a model quantized as one of: {', '.join(sorted(FORMATS))}",
        )
    return FORMATS[name]


#: integer dtypes narrower than a 32-bit word, and their widths
NARROW_INTS = {"int8": 8, "uint8": 8, "int16": 16, "uint16": 16}


def word_spec(shape: tuple[int, ...], dtype: str) -> tuple[tuple[int, ...], str] | None:
    """``(shape, dtype)`` of a narrow integer param stored as uint32 words (same bytes, little
    endian), or None when it is not narrow or its last dimension does not fill whole words."""
    bits = NARROW_INTS.get(dtype)
    if bits is None or not shape or (shape[-1] * bits) % 32:
        return None
    return (*shape[:-1], shape[-1] * bits // 32), "uint32"


class _NarrowView:
    """A uint32 ``te.Tensor`` of words read as the narrow integer tensor it holds: ``v[i, j]`` is
    element ``j`` of row ``i``, as an int32 expression (sign-extended for signed types)."""

    def __init__(self, words: Any, dtype: str) -> None:
        self.words, self.dtype, self.bits = words, dtype, NARROW_INTS[dtype]

    def __getitem__(self, idx: Any) -> Any:
        from tvm import tirx

        idx = idx if isinstance(idx, tuple) else (idx,)
        *lead, col = idx
        per = 32 // self.bits
        word = self.words[(*lead, col // per)]
        shift = (col % per).astype("uint32") * tirx.const(self.bits, "uint32")
        value = ((word >> shift) & tirx.const((1 << self.bits) - 1, "uint32")).astype("int32")
        if self.dtype.startswith("int"):  # sign-extend
            sign = tirx.const(1 << (self.bits - 1), "int32")
            value = (value ^ sign) - sign
        return value

    def __call__(self, *idx: Any) -> Any:
        return self[idx]


class WordStorage(WeightFormat):
    """``inner`` with its 8- and 16-bit integer params stored as uint32 words holding the same
    bytes (WGSL, the WebGPU/Vulkan path, has no narrower storage types). The dequantization reads
    each value out of its word; the weights are the same bytes, viewed as uint32 at load."""

    def __init__(self, inner: WeightFormat) -> None:
        self.inner = inner
        self.name = inner.name
        self.model_dtype = inner.model_dtype

    def _narrow(self, out_features: int, in_features: int) -> dict[str, str]:
        return {
            n: dt
            for n, (shape, dt) in self.inner.param_specs(out_features, in_features).items()
            if word_spec(shape, dt) is not None
        }

    def param_specs(self, out_features: int, in_features: int) -> ParamSpecs:
        specs = {}
        for n, (shape, dt) in self.inner.param_specs(out_features, in_features).items():
            specs[n] = word_spec(shape, dt) or (shape, dt)
        return specs

    def check_shape(self, out_features: int, in_features: int) -> None:
        self.inner.check_shape(out_features, in_features)
        for n, (shape, dt) in self.inner.param_specs(out_features, in_features).items():
            if dt in NARROW_INTS and word_spec(shape, dt) is None:
                raise LlmchatError(
                    f"The {self.name} weight {n} {list(shape)} cannot be stored in 32-bit words for WGSL.",
                    "use --device cpu (or cuda) for this model",
                )

    def dequant(self, params: Mapping[str, Any], row: Any, col: Any) -> Any:
        views = dict(params)
        # dtypes do not depend on the shape: any shape every format accepts names them
        for n, (_shape, dt) in self.inner.param_specs(256, 256).items():
            if dt in NARROW_INTS and n in views:
                views[n] = _NarrowView(params[n], dt)
        return self.inner.dequant(views, row, col)

    def quantize(self, w: np.ndarray) -> dict[str, np.ndarray]:
        return {n: to_words(a) for n, a in self.inner.quantize(w).items()}

    def dequantize(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError("dequantize the inner format's params")

    def linear(
        self, in_features: int, out_features: int, bias: bool, dtype: str, bias_dtype: str | None = None
    ) -> Any:
        if not self._narrow(out_features, in_features):
            return self.inner.linear(in_features, out_features, bias, dtype, bias_dtype)
        return DequantLinear(self, in_features, out_features, bias, dtype, bias_dtype)

    def embedding(self, num_embeddings: int, embedding_dim: int, dtype: str) -> Any:
        if not self._narrow(num_embeddings, embedding_dim):
            return self.inner.embedding(num_embeddings, embedding_dim, dtype)
        return DequantEmbedding(self, num_embeddings, embedding_dim, dtype)


def to_words(arr: np.ndarray) -> np.ndarray:
    """A narrow integer array as the uint32 words of :class:`WordStorage` (the same bytes)."""
    spec = word_spec(tuple(arr.shape), str(arr.dtype))
    if spec is None:
        return arr
    return np.ascontiguousarray(arr).view("<u4").reshape(spec[0])


def storage_format(fmt: WeightFormat, word_storage: bool) -> WeightFormat:
    """``fmt``, or its :class:`WordStorage` form for targets without narrow storage types."""
    return WordStorage(fmt) if word_storage and not isinstance(fmt, WordStorage) else fmt


def known_formats() -> list[str]:
    """Names of every registered format."""
    _load_builtin_formats()
    return sorted(FORMATS)


# ------------------------------------------------------------------------------------------
# Generic TVM modules (imported lazily: runtime-only installs never build models)
# ------------------------------------------------------------------------------------------
def _nn():
    from tvm.relax.frontend import nn

    return nn


#: block annotation naming the weight format of a single-row quantized matmul
FORMAT_ANNOTATION = "llmchat_format"

#: name of the TE stage that materialises the dequantized weight (several activation rows)
DEQUANTIZE_STAGE = "dequantize"


def is_single_row(lead_dims: list[Any]) -> bool:
    """Whether every leading (batch, sequence) dim is a static 1: a GEMV, as in decode."""
    from tvm import tirx

    return all(
        (isinstance(d, int) and d == 1) or (isinstance(d, tirx.IntImm) and int(d.value) == 1)
        for d in lead_dims
    )


def dequant_matmul_te(
    fmt: WeightFormat, names: list[str], in_features: int, out_features: int, out_dtype: str
) -> Callable[..., Any]:
    """TE function ``(x, *params[, bias]) -> x @ dequant(W).T`` accumulating in float32.

    For one activation row (decode: every leading dim a static 1) the dequantization sits inside
    the reduction, so each weight byte is read once and nothing is materialised. For several rows
    (prefill) the dequantized weight is its own ``dequantize`` stage of the same PrimFunc, read as
    ``w[n, k]`` by the reduction: schedules can then decode it once per call (the CPU pipeline
    decodes 8-row tiles) instead of once per activation row.
    """
    from tvm import te

    def compute(x, *tensors):
        params = dict(zip(names, tensors[: len(names)], strict=True))
        bias = tensors[len(names)] if len(tensors) > len(names) else None
        k = te.reduce_axis((0, in_features), name="k")
        lead = list(x.shape[:-1])
        if is_single_row(lead):

            def body(*idx):
                return te.sum(x(*idx[:-1], k).astype("float32") * fmt.dequant(params, idx[-1], k), axis=k)
        else:
            w = te.compute(
                (out_features, in_features),
                lambda n, kk: fmt.dequant(params, n, kk),
                name=DEQUANTIZE_STAGE,
                attrs={FORMAT_ANNOTATION: fmt.name},
            )

            def body(*idx):
                # the float32 weight is the first operand: TVM 0.27's dlight Matmul takes the first
                # read's dtype as the input dtype, and an fp16 one sends it to its tensor-core path,
                # which segfaults on these shapes (see pipelines/gpu.py)
                return te.sum(w[idx[-1], k] * x(*idx[:-1], k).astype("float32"), axis=k)

        # the format's name travels with the reduction block: target rules match on it
        acc = te.compute(
            [*lead, out_features],
            body,
            name="dequant_matmul",
            attrs={FORMAT_ANNOTATION: fmt.name} if is_single_row(lead) else None,
        )
        if bias is None and out_dtype == "float32":
            return acc

        def finish(*idx):
            val = acc(*idx)
            if bias is not None:
                val = val + bias[idx[-1]].astype("float32")
            return val.astype(out_dtype) if out_dtype != "float32" else val

        return te.compute(acc.shape, finish, name="dequant_matmul_out")

    return compute


class _Lazy:
    """Namespace for classes that subclass ``nn.Module`` (built on first use)."""

    classes: ClassVar[dict[str, type]] = {}


def _module_classes() -> dict[str, type]:
    if _Lazy.classes:
        return _Lazy.classes
    nn = _nn()
    from tvm import te
    from tvm.relax.frontend.nn import op

    class _DequantLinear(nn.Module):
        """``y = x @ dequant(W).T (+ bias)``, one kernel (see :func:`dequant_matmul_te`)."""

        def __init__(
            self,
            fmt: WeightFormat,
            in_features: int,
            out_features: int,
            bias: bool,
            dtype: str,
            bias_dtype: str | None = None,
        ):
            super().__init__()
            fmt.check_shape(out_features, in_features)
            self.fmt, self.in_features, self.out_features, self.dtype = fmt, in_features, out_features, dtype
            self.param_names = list(fmt.param_specs(out_features, in_features))
            for pname, (shape, pdtype) in fmt.param_specs(out_features, in_features).items():
                setattr(self, pname, nn.Parameter(shape, pdtype))
            self.bias = nn.Parameter((out_features,), bias_dtype or dtype) if bias else None

        def _params(self) -> list[Any]:
            return [getattr(self, n) for n in self.param_names]

        def forward(self, x: Any, out_dtype: str | None = None) -> Any:
            args = [x, *self._params()]
            if self.bias is not None:
                args.append(self.bias)
            fn = dequant_matmul_te(
                self.fmt, self.param_names, self.in_features, self.out_features, out_dtype or self.dtype
            )
            return op.tensor_expr_op(fn, "dequant_matmul", args)

    class _DequantEmbedding(nn.Module):
        """Row lookup of a stored ``[vocab, dim]`` table; also the tied lm_head."""

        def __init__(self, fmt: WeightFormat, num_embeddings: int, embedding_dim: int, dtype: str):
            super().__init__()
            fmt.check_shape(num_embeddings, embedding_dim)
            self.fmt, self.num, self.dim, self.dtype = fmt, num_embeddings, embedding_dim, dtype
            self.param_names = list(fmt.param_specs(num_embeddings, embedding_dim))
            for pname, (shape, pdtype) in fmt.param_specs(num_embeddings, embedding_dim).items():
                setattr(self, pname, nn.Parameter(shape, pdtype))

        def forward(self, ids: Any) -> Any:
            fmt, names, dim, dtype = self.fmt, self.param_names, self.dim, self.dtype

            def lookup(ids_t, *tensors):
                params = dict(zip(names, tensors, strict=True))
                return te.compute(
                    (ids_t.shape[0], dim),
                    lambda i, j: fmt.dequant(params, ids_t[i], j).astype(dtype),
                    name="dequant_take",
                )

            return op.tensor_expr_op(lookup, "dequant_take", [ids, *[getattr(self, n) for n in names]])

        def lm_head_forward(self, x: Any) -> Any:
            fn = dequant_matmul_te(self.fmt, self.param_names, self.dim, self.num, "float32")
            params = [getattr(self, n) for n in self.param_names]
            return op.tensor_expr_op(fn, "dequant_lm_head", [x, *params])

    _Lazy.classes = {"linear": _DequantLinear, "embedding": _DequantEmbedding}
    return _Lazy.classes


def DequantLinear(
    fmt: WeightFormat,
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: str,
    bias_dtype: str | None = None,
) -> Any:
    """Build the generic dequantizing linear module."""
    return _module_classes()["linear"](fmt, in_features, out_features, bias, dtype, bias_dtype)


def DequantEmbedding(fmt: WeightFormat, num_embeddings: int, embedding_dim: int, dtype: str) -> Any:
    """Build the generic dequantizing embedding module."""
    return _module_classes()["embedding"](fmt, num_embeddings, embedding_dim, dtype)
