"""Weight formats (MLC group quantization, unquantized, GGUF blocks) behind one registry."""

from app.inference.quantization.base import (
    FORMATS,
    WeightFormat,
    get_format,
    known_formats,
    register_format,
    storage_format,
    to_words,
    word_spec,
)

__all__ = [
    "FORMATS",
    "WeightFormat",
    "get_format",
    "known_formats",
    "register_format",
    "storage_format",
    "to_words",
    "word_spec",
]
