"""One cleanup of the temporaries a killed llmchat leaves behind.

What an interrupted llmchat can leave, and how each is known to be stale:

* ``models/.NAME.importing-PID`` (a GGUF import's staging directory): its process is gone;
* ``cache/libs/*.PID.*.so.tmp`` (a library being written) and ``cache/tmp/build-PID`` (the
  compiler's scratch directory, where TVM's temporary files go): its process is gone;
* ``cache/import/.gguf-*`` (the default model's extracted GGUF), ``cache/wheels/.download-*``,
  ``cache/libs/*.tmp`` without a PID, ``models/.trash-*``: older than ``STALE_AFTER_S`` and, for the
  default-model files, no llmchat is setting that model up (its lock is free).

``clean_stale()`` runs at every start (quietly) and as ``llmchat clean`` (saying what it reclaimed).
Resumable downloads (``models/.staging/<id>``) are kept: ``llmchat remove <id>`` drops them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app import paths
from app.units import format_bytes

#: temporaries without a process id in their name count as stale after this long
STALE_AFTER_S = 3600.0

_PID_IN_NAME = (
    re.compile(r"^\..+\.importing-(\d+)$"),  # models/.NAME.importing-PID
    re.compile(r"^.+\.(\d+)\.[^.]+\.so\.tmp$"),  # libs/STEM.PID.XXXX.so.tmp
    re.compile(r"^build-(\d+)$"),  # tmp/build-PID (the compiler's scratch files)
)


@dataclass
class CleanReport:
    """What ``clean_stale`` removed."""

    removed: list[Path] = field(default_factory=list)
    bytes: int = 0

    def summary(self) -> str:
        if not self.removed:
            return "nothing to clean: no temporaries of interrupted runs were found"
        return (
            f"removed {len(self.removed)} temporar{'y' if len(self.removed) == 1 else 'ies'} of "
            f"interrupted runs, reclaiming {format_bytes(self.bytes)}"
        )


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def tree_size(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            return path.lstat().st_size
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _old(path: Path, now: float) -> bool:
    try:
        return now - path.lstat().st_mtime > STALE_AFTER_S
    except OSError:
        return False


def _setup_idle() -> bool:
    """No llmchat is setting the default model up (its lock can be taken)."""
    try:
        import fcntl
    except ImportError:
        return True
    lock = paths.cache_dir() / "default-model.lock"
    if not lock.exists():
        return True
    try:
        with lock.open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fh, fcntl.LOCK_UN)
            return True
    except OSError:
        return False


def _children(folder: Path) -> Iterator[Path]:
    with contextlib.suppress(OSError):
        yield from folder.iterdir()


def stale_temporaries(now: float | None = None) -> list[Path]:
    """The temporaries of dead or long-gone llmchat processes (see the module docstring)."""
    now = time.time() if now is None else now
    found: list[Path] = []
    models, cache = paths.models_dir(), paths.cache_dir()
    for path in [*_children(models), *_children(cache / "libs"), *_children(cache / "tmp")]:
        for pattern in _PID_IN_NAME:
            m = pattern.match(path.name)
            if m:
                if not pid_alive(int(m.group(1))):
                    found.append(path)
                break
        else:
            temporary = path.name.startswith(".trash-") or (
                path.parent.name == "libs" and path.name.endswith(".tmp")
            )
            if temporary and _old(path, now):
                found.append(path)
    if _setup_idle():
        for folder, prefix in ((cache / "import", ".gguf-"), (cache / "wheels", ".download-")):
            found += [p for p in _children(folder) if p.name.startswith(prefix) and _old(p, now)]
    return sorted(found)


def model_temporaries(model_id: str) -> list[Path]:
    """What interrupted runs left of one model: its import staging (``.ID.importing-PID``) of dead
    processes and its half-removed copies (``.trash-ID-*``)."""
    importing = re.compile(rf"\.{re.escape(model_id)}\.importing-(\d+)")
    trash = re.compile(rf"\.trash-{re.escape(model_id)}-[0-9a-f]+")

    def left_behind(name: str) -> bool:
        m = importing.fullmatch(name)
        return (m is not None and not pid_alive(int(m.group(1)))) or trash.fullmatch(name) is not None

    return sorted(path for path in _children(paths.models_dir()) if left_behind(path.name))


def remove_paths(found: list[Path], report: CleanReport | None = None) -> CleanReport:
    """Remove ``found`` (files or trees), adding what went and its size to ``report``."""
    report = report or CleanReport()
    for path in found:
        size = tree_size(path)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not ours to remove (permissions): left alone, never an error at start
        report.removed.append(path)
        report.bytes += size
    return report


def clean_stale(now: float | None = None) -> CleanReport:
    """Remove the stale temporaries; what was removed and how many bytes that freed."""
    return remove_paths(stale_temporaries(now))
