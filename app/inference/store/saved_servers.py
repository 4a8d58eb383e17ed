"""Servers saved in the models screen ("add a server"): OpenAI-compatible endpoints chatted with like
local models.

Each saved server has a name, its endpoint (normalized: ``http(s)://host[:port]/v1``) and the model
chosen from its ``/v1/models``. The list lives in ``<config dir>/servers.json``, written atomically
with mode 0600. The API key goes to the operating system's keyring where one is usable (Secret
Service or KWallet on Linux, Keychain on macOS, Credential Locker on Windows, through the ``keyring``
package); where none is (a headless machine), it is kept in ``servers.json`` itself, readable by its
owner only. It is never printed or logged.

The chat refers to a saved server as ``server:NAME`` (``llmchat --model server:NAME``, and the model
name of its saved conversations, so ``--continue`` reconnects to it).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from app import paths
from app.errors import LlmchatError, os_error
from app.inference.api import SERVER_PREFIX, SavedServer

FILE_NAME = "servers.json"
#: the keyring's service name for the keys (the user name is the server's name)
KEYRING_SERVICE = "llmchat-server"
#: keyring backends below this priority are no better than a 0600 file (fail, null, plaintext)
MIN_KEYRING_PRIORITY = 1
MAX_NAME = 64


def servers_file() -> Path:
    return paths.config_dir() / FILE_NAME


def server_name_of(model: str | None) -> str | None:
    """NAME for ``server:NAME``, else None (a local model id or path)."""
    if model and model.startswith(SERVER_PREFIX):
        return model[len(SERVER_PREFIX) :]
    return None


def default_name(endpoint: str) -> str:
    """``host:port`` of an endpoint (what the add-a-server form proposes)."""
    return urlsplit(endpoint).netloc or endpoint


def check_name(name: str) -> str:
    name = name.strip()
    if not name:
        raise LlmchatError("The server needs a name.", "type a name, e.g. the host (gpu-box:8000)")
    if len(name) > MAX_NAME or any(not ch.isprintable() for ch in name):
        raise LlmchatError(
            f"{name[:MAX_NAME]!r}… is not a usable name (at most {MAX_NAME} printable characters).",
            "type a shorter name",
        )
    return name


# -- the file ------------------------------------------------------------------------------------
def _read() -> list[dict[str, Any]]:
    path = servers_file()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    except OSError as err:
        raise os_error(err, f"Cannot read the saved servers ({path})") from None
    try:
        data = json.loads(text)
        rows = data["servers"]
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise TypeError("'servers' is not a list of objects")
        for row in rows:
            for field in ("name", "endpoint", "model"):
                if not isinstance(row.get(field), str) or not row[field]:
                    raise TypeError(f"a server has no {field!r}")
    except (ValueError, KeyError, TypeError) as err:
        raise LlmchatError(
            f"The saved servers file {path} is damaged ({err}).",
            "fix it, or delete it and add the servers again (F2, then a)",
        ) from None
    _tighten(path)
    return rows


def _tighten(path: Path) -> None:
    """A file that may hold keys stays readable by its owner only (an editor may have widened it)."""
    with contextlib.suppress(OSError):
        if stat.S_IMODE(path.stat().st_mode) & 0o077:
            path.chmod(0o600)


def _write(rows: list[dict[str, Any]]) -> None:
    """Replace the file atomically; the new one is created with mode 0600 (never readable by others,
    not even for a moment)."""
    path = servers_file()
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"servers": rows}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise os_error(
            err, f"Cannot save the servers ({path})", "set LLMCHAT_CONFIG_DIR to a writable directory"
        ) from None


def _server(row: dict[str, Any]) -> SavedServer:
    key = row.get("key")
    if key not in ("keyring", "file"):
        key = "none"
    return SavedServer(row["name"], row["endpoint"], row["model"], key)


def load_servers() -> list[SavedServer]:
    """The saved servers, in the order they were added."""
    return [_server(row) for row in _read()]


def get_server(name: str) -> SavedServer:
    servers = load_servers()
    for server in servers:
        if server.name == name:
            return server
    saved = ", ".join(s.name for s in servers) if servers else "none yet"
    raise LlmchatError(
        f"There is no saved server {name!r} (saved: {saved}).",
        "add it in llmchat's models screen (F2, then a: add a server)",
    )


# -- the key -------------------------------------------------------------------------------------
def _keyring() -> Any:
    """The ``keyring`` module when its backend is a real secret store, else None."""
    try:
        import keyring

        backend = keyring.get_keyring()
        priority = float(getattr(backend, "priority", 0))
    except Exception:  # not installed, or a broken backend configuration
        return None
    return keyring if priority >= MIN_KEYRING_PRIORITY else None


def key_store_name() -> str:
    """Where a key saved now would go, in words (the form says it)."""
    ring = _keyring()
    if ring is None:
        return f"{servers_file()} (mode 0600: no system keyring here)"
    return f"the system keyring ({type(ring.get_keyring()).__name__})"


def api_key_of(server: SavedServer) -> str | None:
    """The server's saved API key (None: it has none, or the keyring lost it)."""
    if server.key == "file":
        row = next((r for r in _read() if r["name"] == server.name), {})
        key = row.get("api_key")
        return key if isinstance(key, str) and key else None
    if server.key == "keyring":
        ring = _keyring()
        if ring is None:
            raise LlmchatError(
                f"The API key of {server.name} is in the system keyring, which is not usable now.",
                "unlock the keyring (log in to the desktop session), or add the server again with its key",
            )
        try:
            return ring.get_password(KEYRING_SERVICE, server.name)
        except Exception as err:
            raise LlmchatError(
                f"The system keyring did not give the API key of {server.name}: {type(err).__name__}.",
                "unlock the keyring and try again",
            ) from None
    return None


def save_server(name: str, endpoint: str, model: str, api_key: str | None) -> SavedServer:
    """Save (or replace) a server; the key in the keyring where one is usable, else in the 0600 file."""
    from app.inference.engine.remote import normalize_endpoint

    name = check_name(name)
    endpoint = normalize_endpoint(endpoint)
    if not model:
        raise LlmchatError("No model was chosen.", "fetch the server's models and pick one")
    rows = [row for row in _read() if row["name"] != name]
    row: dict[str, Any] = {"name": name, "endpoint": endpoint, "model": model, "key": "none"}
    _forget_key(name)
    if api_key:
        ring = _keyring()
        stored = False
        if ring is not None:
            try:
                ring.set_password(KEYRING_SERVICE, name, api_key)
                stored = True
            except Exception:  # locked or refused: the private file still keeps it
                stored = False
        if stored:
            row["key"] = "keyring"
        else:
            row["key"], row["api_key"] = "file", api_key
    _write([*rows, row])
    return _server(row)


def _forget_key(name: str) -> None:
    ring = _keyring()
    if ring is not None:
        with contextlib.suppress(Exception):  # there was none
            ring.delete_password(KEYRING_SERVICE, name)


def remove_server(name: str) -> None:
    """Forget a saved server and its key."""
    rows = _read()
    kept = [row for row in rows if row["name"] != name]
    if len(kept) == len(rows):
        raise LlmchatError(f"There is no saved server {name!r}.", "see the servers in the models screen")
    _forget_key(name)
    _write(kept)


# -- connecting ----------------------------------------------------------------------------------
#: the fixes a saved server's errors name (the models screen, not the command line)
def screen_hints() -> Any:
    from app.inference.engine.remote import ErrorHints

    return ErrorHints(
        key="enter the server's API key (F2, then a: add the server again with it)",
        url="check the URL and that the server is running",
        path="check the URL (usually ending in /v1)",
        model="add the server again and pick one of its models (F2, then a)",
    )


def form_hints() -> Any:
    """The fixes the add-a-server form names (its own fields)."""
    from app.inference.engine.remote import ErrorHints

    return ErrorHints(
        key="enter the server's API key in the API key field",
        url="check the URL and that the server is running",
        path="check the URL (usually ending in /v1)",
        model="pick one of the server's models",
    )


def open_server(name: str) -> Any:
    """A ``RemoteEngine`` on the saved server ``name`` and its chosen model."""
    from app.inference.engine.remote import RemoteEngine

    server = get_server(name)
    return RemoteEngine(
        server.endpoint,
        api_key=api_key_of(server),
        model=server.model,
        hints=screen_hints(),
        saved_as=server.ref,
    )
