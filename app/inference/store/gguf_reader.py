"""Read a GGUF file (llama.cpp's model format) with the ``gguf`` package: metadata and raw tensors.

``read_gguf(path)`` checks everything llmchat's import needs before any byte is converted: the
file is complete, the architecture is one the engine runs, and every tensor has a type the import
handles losslessly.  Tensor data stays memory-mapped (``GGUFTensor.data`` is a view of the file).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.errors import LlmchatError

#: GGUF tensor types imported losslessly (see app.inference.quantization.ggml)
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
#: general.architecture values whose tensors map onto the engine's Llama / Qwen2 models
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as stored: ``shape`` in numpy order (rows, cols), ``data`` the raw rows."""

    name: str
    type_name: str  # "Q4_1", "F32", ...
    shape: tuple[int, ...]  # numpy order: (out_features, in_features) for a matrix
    data: np.ndarray  # F32/F16: that dtype, shape ``shape``; BF16 and blocks: uint8 [rows, bytes]


@dataclass
class GGUFFile:
    """The parts of a GGUF file the import uses."""

    path: Path
    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value by full key (e.g. ``"llama.block_count"``)."""
        return self.metadata.get(key, default)

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """A metadata value under the architecture's prefix (``"<arch>.<suffix>"``)."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each type the file holds."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts


def _reader_class() -> type:
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map (same bytes, no copy).

    Slicing an ``np.memmap`` goes through its Python-level ``__array_finalize__``; the reader
    slices once per string of the vocabulary, which made reading a 49k-token GGUF 3x slower.
    """
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = np.asarray(value)

    return Reader


def _not_gguf(path: Path, why: str) -> LlmchatError:
    return LlmchatError(
        f"{path} is not a complete GGUF file ({why}).",
        "download the file again (it may be truncated), or check that it is a llama.cpp GGUF model",
    )


def _field_value(field: Any) -> Any:
    value = field.contents()
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8", errors="replace")
    return value


def read_gguf(path: str | Path, vocab_only: bool = False) -> GGUFFile:
    """Open ``path``; LlmchatError for a truncated or foreign file, another architecture or tensor type.

    ``vocab_only``: accept a file without tensors and of any architecture (llama.cpp's vocab files).
    """
    import stat

    import gguf

    from app.errors import os_error

    path = Path(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise LlmchatError(f"{path} is a directory, not a GGUF file.", "give the path of a .gguf file")
        if not stat.S_ISREG(mode):
            raise LlmchatError(
                f"{path} is not a regular file (a FIFO, socket or device).",
                "give the path of a .gguf file on disk",
            )
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(4)
    except FileNotFoundError:
        raise LlmchatError(f"{path} does not exist.", "give the path of a .gguf file") from None
    except OSError as err:
        raise os_error(err, f"Cannot read {path}", "check the file's permissions") from err
    if head != _MAGIC:
        raise LlmchatError(
            f"{path} is not a GGUF file (it does not start with 'GGUF').",
            "give the path of a llama.cpp .gguf model file",
        )
    try:
        reader = _reader_class()(path, "r")
    except Exception as err:  # the gguf package raises ValueError, IndexError, struct errors ...
        raise _not_gguf(path, f"{type(err).__name__}: {err}") from err

    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            metadata[name] = _field_value(field)
        except Exception as err:
            raise _not_gguf(path, f"metadata {name!r} unreadable: {err}") from err

    architecture = str(metadata.get("general.architecture", ""))
    if not vocab_only and architecture not in SUPPORTED_ARCHITECTURES:
        raise LlmchatError(
            f"{path} holds a model of architecture {architecture or 'unknown'!r}, which llmchat cannot run.",
            f"import a GGUF of a supported architecture: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama 2/3, Mistral, SmolLM2, Qwen2/2.5)",
        )

    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        type_name = gguf.GGMLQuantizationType(int(t.tensor_type)).name
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise LlmchatError(
                f"{path}: tensor {t.name!r} has type {type_name}, which llmchat cannot import.",
                f"use a GGUF whose tensors are {', '.join(SUPPORTED_TENSOR_TYPES)} "
                "(e.g. a Q4_K_M, Q4_0, Q8_0 or F16 file rather than Q2_K, Q3_K or I-quants)",
            )
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise _not_gguf(
                path, f"tensor {t.name!r} ends at byte {int(t.data_offset) + int(t.n_bytes)} of {size}"
            )
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        data = np.asarray(t.data)
        if int(data.nbytes) != int(t.n_bytes):
            raise _not_gguf(path, f"tensor {t.name!r} has {data.nbytes} of {int(t.n_bytes)} bytes")
        tensors[t.name] = GGUFTensor(t.name, type_name, shape, data)
    if not tensors and not vocab_only:
        raise _not_gguf(path, "it holds no tensors")
    return GGUFFile(path=path, architecture=architecture, metadata=metadata, tensors=tensors)
