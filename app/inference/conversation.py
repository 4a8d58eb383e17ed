"""Conversation bookkeeping shared by the engines."""

from __future__ import annotations

from app.inference.api import Message


def split_system(messages: list[Message]) -> tuple[str | None, list[Message]]:
    """``(system prompt or None, the user/assistant turns)`` of a stored conversation."""
    msgs = list(messages)
    system = msgs.pop(0).content or None if msgs and msgs[0].role == "system" else None
    return system, [m for m in msgs if m.role != "system"]


def with_system(system: str | None, turns: list[Message]) -> list[Message]:
    """The messages a chat template renders: the system prompt (when set) first."""
    return ([Message("system", system)] if system else []) + list(turns)
