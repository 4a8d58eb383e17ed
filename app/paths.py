"""Where llmchat keeps its files: platformdirs, overridable by environment variables."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "llmchat"


def _dir(env: str, default: str) -> Path:
    value = os.environ.get(env)
    path = Path(value).expanduser() if value else Path(default)
    return path


def data_dir() -> Path:
    """Installed models, imported GGUF models, chat history (``LLMCHAT_DATA_DIR``)."""
    return _dir("LLMCHAT_DATA_DIR", platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    """Compiled model libraries and downloaded wheels (``LLMCHAT_CACHE_DIR``)."""
    return _dir("LLMCHAT_CACHE_DIR", platformdirs.user_cache_dir(APP_NAME))


def config_dir() -> Path:
    """User settings and the user's own catalog entries (``LLMCHAT_CONFIG_DIR``)."""
    return _dir("LLMCHAT_CONFIG_DIR", platformdirs.user_config_dir(APP_NAME))


def models_dir() -> Path:
    """One sub-directory per installed model."""
    return data_dir() / "models"


def asset(name: str) -> Path:
    """A file of the repository's ``assets/`` folder (the app's stylesheet): inside the package
    (``app/assets``, where the build puts it: setup.py) when installed, ``assets/`` in a checkout
    (an editable install too)."""
    here = Path(__file__).resolve().parent
    packaged = here / "assets" / name
    return packaged if packaged.is_file() else here.parent / "assets" / name
