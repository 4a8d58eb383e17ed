"""The chat's ``/set`` values, kept per model in the config directory (``<config dir>/sampling.json``)
so that they survive a restart. Validated on load: a damaged file or a bad value is reported and
ignored (the model's defaults apply), never a crash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.errors import LlmchatError
from app.jsonfile import read_json, write_json_atomic
from app.paths import config_dir

FILE_NAME = "sampling.json"


def path() -> Path:
    return config_dir() / FILE_NAME


def _models() -> tuple[dict[str, Any], str | None]:
    """The file's {model id: {key: value}}, and what was wrong with it (then it is ignored)."""
    data, problem = read_json(path())
    if problem is not None:
        return {}, problem
    if data is None:
        return {}, None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict):
        return {}, f'{path()} has no "models" table'
    return models, None


def load_overrides(model_id: str) -> tuple[dict[str, Any] | None, list[str]]:
    """(the saved /set values of ``model_id``, or None when none are saved; the problems found —
    each bad value is left out, a damaged file is ignored as a whole)."""
    from app.inference.services import SamplingRules

    validate_value = SamplingRules().validate
    models, problem = _models()
    if problem is not None:
        return None, [f"{problem}: your saved /set values are ignored (the next /set rewrites it)"]
    saved = models.get(model_id)
    if saved is None:
        return None, []
    if not isinstance(saved, dict):
        return None, [f"{path()}: the settings of {model_id} are not a table: ignored"]
    values, problems = {}, []
    for key, value in saved.items():
        try:
            values[key] = validate_value(key, value)
        except LlmchatError as err:
            problems.append(f"{path()}: {model_id}: {err.problem} Ignored.")
    return values, problems


def save_overrides(model_id: str, overrides: dict[str, Any]) -> None:
    """Keep ``overrides`` (the validated /set values) for ``model_id``; empty: forget them. A damaged
    file is replaced. Raises LlmchatError when the config directory cannot be written."""
    models, _problem = _models()
    models = {k: v for k, v in models.items() if isinstance(k, str)}
    if overrides:
        models[model_id] = dict(overrides)
    else:
        models.pop(model_id, None)
    try:
        write_json_atomic(path(), {"version": 1, "models": models})
    except OSError as err:
        raise LlmchatError(
            f"Could not save your /set values to {path()}: {err.strerror or err}.",
            f"make {path().parent} writable (or set LLMCHAT_CONFIG_DIR to a writable "
            "directory); the values apply until you quit",
        ) from err
