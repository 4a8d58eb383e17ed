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


class ConversationState:
    """The system prompt and turns an engine keeps; engines add what the KV cache needs."""

    _system: str | None = None
    _history: list[Message]

    @property
    def history(self) -> list[Message]:
        """The conversation (without the system prompt)."""
        return list(self._history)

    @property
    def system_prompt(self) -> str | None:
        return self._system

    def set_system_prompt(self, text: str | None) -> None:
        """Set (or clear) the system prompt; the conversation is kept."""
        self._system = text or None

    def load_history(self, messages: list[Message]) -> None:
        """Replace the conversation with stored messages (a leading system message sets the prompt)."""
        system, self._history = split_system(messages)
        if system is not None:
            self._system = system
