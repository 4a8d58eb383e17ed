"""The scrolling chat: user prompts, Markdown replies (code blocks highlighted), a stats line under
each reply and notices (help, stats, errors). The view follows new text unless the user scrolled up."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.widgets import Markdown, Static

from app.errors import LlmchatError


class UserMessage(Markdown):
    """A prompt the user sent."""

    DEFAULT_CLASSES = "message user"


class AssistantMessage(Markdown):
    """A reply; streamed with ``append`` while the model generates."""

    DEFAULT_CLASSES = "message assistant"


class StatsLine(Static):
    """Tokens, tok/s and time to first token of one reply (live while it streams)."""

    DEFAULT_CLASSES = "stats-line"


class Notice(Markdown):
    """Output of a command (help, stats) or an error with its fix; never sent to the model."""

    DEFAULT_CLASSES = "notice"


class ChatLog(VerticalScroll):
    """The conversation; anchored to the bottom so it follows the stream until the user scrolls up."""

    DEFAULT_CLASSES = "chat-log"

    def on_mount(self) -> None:
        self.anchor()

    async def add_user(self, text: str) -> UserMessage:
        widget = UserMessage(text)
        await self.mount(widget)
        return widget

    async def add_reply(self, text: str = "") -> tuple[AssistantMessage, StatsLine]:
        """A reply to stream into, with its stats line below."""
        reply = AssistantMessage(text)
        stats = StatsLine("")
        await self.mount_all([reply, stats])
        return reply, stats

    async def add_saved_reply(self, text: str) -> AssistantMessage:
        """A reply of a resumed conversation (no stats)."""
        reply = AssistantMessage(text)
        await self.mount(reply)
        return reply

    async def add_notice(self, markdown: str, *, error: bool = False) -> Notice:
        widget = Notice(markdown)
        if error:
            widget.add_class("error")
        await self.mount(widget)
        return widget

    async def add_error(self, err: BaseException) -> Notice:
        return await self.add_notice(error_markdown(err), error=True)

    async def clear(self) -> None:
        await self.remove_children()


def error_markdown(err: BaseException) -> str:
    """An error as Markdown: the problem and the fix (unexpected errors get a generic fix)."""
    if isinstance(err, LlmchatError):
        text = f"**{err.problem}**"
        return f"{text}\n\nfix: {err.fix}" if err.fix else text
    name = type(err).__name__
    return (
        f"**Unexpected error: {name}: {err}**\n\n"
        "fix: try again; if it keeps happening, run `llmchat doctor` and report the error"
    )
