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
        errno.EACCES: ("permission denied", "check the permissions, or set LLMCHAT_DATA_DIR / "
                       "LLMCHAT_CACHE_DIR to a directory you can write"),
        errno.EPERM: ("the operation is not permitted", "check the permissions of that directory"),
        errno.EROFS: ("the file system is read-only", "set LLMCHAT_DATA_DIR / LLMCHAT_CACHE_DIR to a "
                      "writable directory"),
        errno.ENOTDIR: ("a part of the path is a file, not a directory", "move that file away"),
        errno.EISDIR: ("it is a directory, not a file", "give the path of a file"),
        errno.ENOENT: ("it does not exist", "check the path"),
        errno.EIO: ("an I/O error (a failing disk?)", "check the disk"),
    }
    reason, own_fix = reasons.get(code, (err.strerror or str(err), None))
    return LlmchatError(f"{what}: {reason}{where}.", fix or own_fix or "check the path and try again")
