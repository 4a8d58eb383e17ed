"""The one error type the user sees: a problem and the fix, never a traceback."""

from __future__ import annotations


class LlmchatError(Exception):
    """An error with a human-readable problem statement and a concrete fix.

    Every module raises this (or a subclass) for anything a user can cause or repair;
    the CLI and the TUI show ``str(err)`` and ``err.fix`` and never a traceback.
    """

    def __init__(self, problem: str, fix: str | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix

    def __str__(self) -> str:
        return self.problem if not self.fix else f"{self.problem}\n  fix: {self.fix}"


class NotAvailableYet(LlmchatError):
    """A command that a later release fills in."""


def decode_utf8(data: bytes, what: str) -> str:
    """``data`` as text, or an error naming ``what`` and the first byte that is not UTF-8.

    The one check for text from outside (stdin, command-line arguments): the tokenizer accepts
    only real text, and a lone byte must not become a traceback deep inside it."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = data[err.start : err.start + 1].hex()
        raise LlmchatError(
            f"{what} is not valid UTF-8 (byte 0x{bad} at offset {err.start}).",
            "pass the text encoded as UTF-8 (set a UTF-8 locale, e.g. LANG=C.UTF-8, or convert it with "
            "iconv -f LATIN1 -t UTF-8)",
        ) from None


def check_arguments(argv: list[str]) -> None:
    """Command-line arguments are decoded with surrogate escapes: one that held bytes that are not
    UTF-8 is an error naming it."""
    import os

    for index, arg in enumerate(argv, 1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            decode_utf8(os.fsencode(arg), f"argument {index} ({arg.encode('utf-8', 'replace').decode()!r})")


def os_error(err: OSError, what: str, fix: str | None = None) -> LlmchatError:
    """The one place an ``OSError`` becomes a message: ``what`` failed, why in plain words (disk
    full, permission denied, read-only, not a directory …) and a fix fitting the cause.

    ``fix`` is the caller's advice; without it, the cause's own."""
    import errno

    code = err.errno
    where = f" ({err.filename})" if getattr(err, "filename", None) else ""
    reasons = {
        errno.ENOSPC: ("the disk is full", "free some disk space"),
        errno.EDQUOT: ("the disk quota is exhausted", "free some disk space"),
        errno.EACCES: (
            "permission denied",
            "check the permissions, or set LLMCHAT_DATA_DIR / LLMCHAT_CACHE_DIR to a directory you can write",
        ),
        errno.EPERM: ("the operation is not permitted", "check the permissions of that directory"),
        errno.EROFS: (
            "the file system is read-only",
            "set LLMCHAT_DATA_DIR / LLMCHAT_CACHE_DIR to a writable directory",
        ),
        errno.ENOTDIR: ("a part of the path is a file, not a directory", "move that file away"),
        errno.EISDIR: ("it is a directory, not a file", "give the path of a file"),
        errno.ENOENT: ("it does not exist", "check the path"),
        errno.EIO: ("an I/O error (a failing disk?)", "check the disk"),
    }
    reason, own_fix = reasons.get(code, (err.strerror or str(err), None))
    return LlmchatError(f"{what}: {reason}{where}.", fix or own_fix or "check the path and try again")
