"""Model definitions (``tvm.relax.frontend.nn``) and the model_type -> class registry.

Importing a family imports ``tvm.relax`` (the compiler); the registry imports lazily so that a
runtime-only TVM can still use the rest of the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

from app.errors import LlmchatError

#: model_type -> (module, class)
MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("app.inference.models.llama", "LlamaForCausalLM"),
    "mistral": ("app.inference.models.llama", "LlamaForCausalLM"),
    "qwen2": ("app.inference.models.qwen2", "Qwen2ForCausalLM"),
}


def model_class(model_type: str) -> Any:
    """The ``nn.Module`` class implementing ``model_type``."""
    if model_type not in MODEL_CLASSES:
        raise LlmchatError(
            f"model_type {model_type!r} is not supported.",
            f"use a model of a supported family: {', '.join(sorted(MODEL_CLASSES))}",
        )
    module, name = MODEL_CLASSES[model_type]
    return getattr(importlib.import_module(module), name)
