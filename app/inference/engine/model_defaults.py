"""Sampling defaults for one model: what the model and its catalog entry say, then a repetition guard.

``model_sampling(model_dir, model_id)`` returns the ``SamplingParams`` a chat with this model starts
from, and where each value came from. The sources, first one that sets a value wins:

1. the catalog entry's ``sampling`` table (``app/models_registry.toml`` or the user's registry): chosen
   for that model (e.g. SmolLM2's model card recommends temperature 0.2, top_p 0.9);
2. the model's ``generation_config.json`` (Hugging Face's; a GGUF import writes the GGUF's
   ``general.sampling.*`` values there);
3. the model's ``mlc-chat-config.json`` (MLC's converter copies them from the HF config, and writes
   1.0 where the HF config has nothing, so a repetition penalty of 1.0 there counts as not set);
4. llmchat's defaults (:class:`SamplingParams`).

Where no source sets a repetition penalty above 1, the *repetition guard* applies: penalty 1.1 over
the last 64 generated tokens, as Ollama does by default — small models otherwise loop until
``max_tokens``. The user's ``/set`` (or ``ask``'s flags) override all of this.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from app.inference.api import ModelSampling, SamplingParams

#: Ollama's defaults (repeat_penalty, repeat_last_n), applied where the model sets no penalty
REPETITION_GUARD = {"repetition_penalty": 1.1, "repeat_last_n": 64}

#: the keys read from the model's files (name in the file -> SamplingParams field)
_MODEL_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _usable(name: str, value: Any) -> bool:
    from app.errors import LlmchatError
    from app.inference.engine.sampling import validate_value

    try:
        validate_value(name, value)
    except LlmchatError:
        return False
    return True


def _from_file(data: dict[str, Any], *, mlc: bool) -> dict[str, Any]:
    found = {}
    for key, name in _MODEL_KEYS.items():
        value = data.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if mlc and name == "repetition_penalty" and value == 1.0:
            continue  # MLC's converter writes 1.0 where the model says nothing
        if _usable(name, float(value)):
            found[name] = float(value)
    if not mlc and data.get("do_sample") is False and "temperature" not in found:
        found["temperature"] = 0.0  # Hugging Face: greedy unless do_sample
    return found


def catalog_sampling(model_id: str | None) -> dict[str, Any]:
    """The ``sampling`` table of the catalog entry for ``model_id`` ({} when none or no entry)."""
    if not model_id:
        return {}
    try:
        from app.inference.store.catalog import load_catalog

        catalog = load_catalog()
        if model_id not in catalog:
            return {}
        return dict(catalog.get(model_id).sampling)
    except Exception:  # a broken user registry must not stop a chat
        return {}


def model_sampling(model_dir: str | Path | None, model_id: str | None = None) -> ModelSampling:
    """The sampling defaults for the model in ``model_dir`` (catalog id ``model_id``)."""
    result = ModelSampling()
    layers: list[tuple[str, dict[str, Any]]] = [("catalog entry", catalog_sampling(model_id))]
    if model_dir:
        folder = Path(model_dir)
        layers.append(
            ("generation_config.json", _from_file(_read_json(folder / "generation_config.json"), mlc=False))
        )
        layers.append(
            ("mlc-chat-config.json", _from_file(_read_json(folder / "mlc-chat-config.json"), mlc=True))
        )
    values: dict[str, Any] = {}
    for source, found in layers:
        for name, value in found.items():
            if name in SAMPLING_FIELDS and name not in values:
                values[name] = value
                result.sources[name] = source
    if "repetition_penalty" not in values:
        for name, value in REPETITION_GUARD.items():
            if name not in values:
                values[name] = value
                result.sources[name] = "repetition guard (Ollama's default)"
    result.params = replace(SamplingParams(), **values)
    return result


def effective_params(defaults: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
    """``defaults`` with the user's overrides (validated ``/set`` values) on top."""
    from app.inference.engine.sampling import apply_overrides

    return apply_overrides(defaults, {k: v for k, v in overrides.items() if k in SAMPLING_FIELDS})
