"""Small JSON files llmchat keeps for itself (settings, bench results): written atomically, read
without ever raising — a damaged file is reported and ignored, never a crash."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> tuple[Any, str | None]:
    """(the data, None), or (None, what is wrong with the file); (None, None) when it does not exist."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as err:
        return None, f"{path} cannot be read ({err})"
    try:
        return json.loads(text), None
    except ValueError as err:
        return None, f"{path} is not valid JSON ({err})"
