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
