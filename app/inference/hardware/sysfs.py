"""Reading system files relative to a root directory (``/`` or a fixture tree), tolerantly.

Every read goes through :class:`SysReader`: a missing file yields ``None``; a file that exists but
is empty, unreadable or holds garbage yields ``None`` *and* a line in ``reader.problems`` naming
the file and what was wrong, so the report can say what it could not read. Values are stripped of
whitespace and of the NUL padding some sysfs snapshots carry.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: sysfs attributes are at most a page; anything bigger is not the file we expect
MAX_READ_BYTES = 256 * 1024
#: the largest memory size believed (16 TiB): beyond it, or below 0, a size file is garbage
MAX_MEMORY_BYTES = 1 << 44


class SysReader:
    """Reads files under ``root`` as if it were ``/``; collects what could not be read."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)
        self.problems: list[str] = []
        self._listings: dict[str, list[str]] = {}  # library directories are listed many times

    @property
    def is_real_root(self) -> bool:
        """True when reading the running system itself (not a fixture tree)."""
        try:
            return self.root.resolve() == Path("/")
        except OSError:
            return False

    def path(self, rel: str) -> Path:
        """The real path of the system path ``rel`` (``/sys/...`` or ``sys/...``)."""
        return self.root / rel.lstrip("/")

    def problem(self, rel: str, what: str) -> None:
        line = f"{'/' + rel.lstrip('/')}: {what}"
        if line not in self.problems:
            self.problems.append(line)

    def exists(self, rel: str) -> bool:
        try:
            return self.path(rel).exists()
        except OSError:
            return False

    def is_dir(self, rel: str) -> bool:
        try:
            return self.path(rel).is_dir()
        except OSError:
            return False

    def listdir(self, rel: str) -> list[str]:
        """Sorted entry names of a directory; [] when it is missing or unreadable (cached)."""
        if rel in self._listings:
            return self._listings[rel]
        try:
            names = sorted(os.listdir(self.path(rel)))
        except FileNotFoundError:
            names = []
        except NotADirectoryError:
            names = []
        except OSError as err:
            self.problem(rel, f"cannot list ({err.strerror or err})")
            names = []
        self._listings[rel] = names
        return names

    def read_text(self, rel: str, *, required: bool = False) -> str | None:
        """The file's text, stripped; None when missing, unreadable or empty (recorded as a problem).

        ``required``: also record a missing file as a problem.
        """
        p = self.path(rel)
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(p, flags)  # non-blocking: a FIFO or device in a bad sysroot cannot hang us
        except FileNotFoundError:
            if required:
                self.problem(rel, "missing")
            return None
        except OSError as err:
            self.problem(rel, f"cannot read ({err.strerror or err})")
            return None
        try:
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                self.problem(rel, "is a directory, expected a file")
                return None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self.problem(rel, "not a regular file")
                return None
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read(MAX_READ_BYTES)
        except OSError as err:
            self.problem(rel, f"cannot read ({err.strerror or err})")
            return None
        finally:
            os.close(fd)
        text = data.replace(b"\x00", b"").decode("utf-8", errors="replace").strip()
        if not text:
            self.problem(rel, "empty")
            return None
        return text

    def read_int(self, rel: str, *, required: bool = False) -> int | None:
        """An integer file (decimal or 0x-hex); None when missing or not a number (recorded)."""
        text = self.read_text(rel, required=required)
        if text is None:
            return None
        value = parse_int(text.split()[0] if text.split() else text)
        if value is None:
            self.problem(rel, f"not a number: {_preview(text)}")
        return value

    def read_size(self, rel: str, *, required: bool = False) -> int | None:
        """A memory size in bytes; None (recorded) when it is not a number or impossible."""
        return self.check_size(rel, "", self.read_int(rel, required=required))

    def check_size(self, rel: str, what: str, value: int | None) -> int | None:
        """``value`` when it is a possible memory size (0 … 16 TiB), else None and a problem line."""
        if value is None or 0 <= value <= MAX_MEMORY_BYTES:
            return value
        label = f"{what} " if what else ""
        self.problem(rel, f"{label}is an impossible memory size ({value} bytes); ignored")
        return None

    def read_key_values(self, rel: str, sep: str | None = None) -> dict[str, str]:
        """``KEY=VALUE`` / ``key value`` / ``Key: value`` lines as a dict; {} when missing."""
        text = self.read_text(rel)
        if text is None:
            return {}
        out: dict[str, str] = {}
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if sep is not None:
                key, found, value = line.partition(sep)
                if not found:
                    continue
            else:
                parts = line.split(None, 1)
                if len(parts) != 2:
                    continue
                key, value = parts
            out[key.strip()] = value.strip().strip('"')
        return out

    def open_rw(self, rel: str) -> tuple[bool, str]:
        """Try to open a device file read-write (no blocking, closed at once): (ok, why-not)."""
        p = self.path(rel)
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(p, flags)
        except FileNotFoundError:
            return False, "missing"
        except PermissionError:
            return False, "permission denied"
        except OSError as err:
            return False, err.strerror or str(err)
        os.close(fd)
        return True, ""


def parse_int(text: str) -> int | None:
    """``"123"``, ``"0x1002"`` → int; anything else → None."""
    text = text.strip()
    try:
        if text.lower().startswith("0x"):
            return int(text, 16)
        return int(text, 10)
    except ValueError:
        return None


def _preview(text: str, limit: int = 40) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "…")
