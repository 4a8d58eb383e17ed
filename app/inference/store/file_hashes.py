"""Whether a file holds the bytes its listing names: md5 (MLC's ``tensor-cache.json``), sha256 (the
Hub's LFS files) or a git blob id (the Hub's other files), hashed once and remembered.

A remembered check is reused only while the file's size, mtime, ctime and inode are unchanged:
``touch -r`` or ``os.utime`` can restore a rewritten file's mtime but not its ctime (any write or
utime sets it to now), and a file replaced by another has another inode; so a shard corrupted
with its mtime kept is hashed again. The memory is ``cache_dir()/verified-files.json``; losing it
only costs a re-hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from app import paths

ALGORITHMS = ("md5", "sha256", "git-blob")
_CHUNK = 1 << 22


def new_hasher(algo: str, size: int | None = None):
    """A hashlib object for ``algo``; a git blob id hashes ``blob SIZE\\0`` before the bytes."""
    if algo == "md5":
        return hashlib.md5()
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "git-blob":
        if size is None:
            raise ValueError("a git blob id needs the file's size")
        h = hashlib.sha1()
        h.update(b"blob %d\0" % size)
        return h
    raise ValueError(f"unknown hash {algo!r}")


def file_digest(path: Path, algo: str) -> str:
    """The hex digest of ``path``'s bytes."""
    size = path.stat().st_size if algo == "git-blob" else None
    h = new_hasher(algo, size)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _store() -> Path:
    return paths.cache_dir() / "verified-files.json"


def _identity(st: os.stat_result) -> str:
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_dev}:{st.st_ino}"


class Verifier:
    """Checks files against expected digests, remembering the files that passed (``save()``)."""

    def __init__(self) -> None:
        try:
            self._known: dict[str, str] = dict(json.loads(_store().read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            self._known = {}
        self._changed = False

    def matches(self, path: Path, algo: str, expected: str) -> bool:
        """Whether ``path`` exists and its ``algo`` digest is ``expected`` (case-insensitive)."""
        try:
            st = path.stat()
        except OSError:
            return False
        key = f"{path.resolve()}|{algo}"
        token = f"{expected.lower()}:{_identity(st)}"
        if self._known.get(key) == token:
            return True
        try:
            ok = file_digest(path, algo) == expected.lower()
        except OSError:
            return False
        if ok:
            self._known[key] = token
            self._changed = True
        elif key in self._known:
            del self._known[key]
            self._changed = True
        return ok

    def save(self) -> None:
        """Write what passed (an optimisation only: a read-only cache just means hashing again)."""
        if not self._changed:
            return
        store = _store()
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=store.parent, prefix=".verified-", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self._known, f)
            os.replace(tmp, store)
            self._changed = False
        except OSError as err:
            from app.debug_log import log

            log.debug("could not remember verified files in %s: %s", store, err)
