"""The scrolling chat: user prompts, Markdown replies (code blocks highlighted), a stats line under
each reply and notices (help, stats, errors). The view follows new text unless the user scrolled up."""

from __future__ import annotations

import re

from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Markdown, Static

from app.errors import LlmchatError

#: a prompt longer than this many lines (or characters) is shown folded: its first FOLD_SHOW_LINES lines
FOLD_LINES = 12
FOLD_CHARS = 2000
FOLD_SHOW_LINES = 6


class UserMessage(Markdown):
    """A prompt the user sent; a long one (a paste) is folded to its first lines until clicked."""

    DEFAULT_CLASSES = "message user"

    def __init__(self, text: str, tokens: int | None = None) -> None:
        self.full_text = text
        self.tokens = tokens
        lines = text.splitlines()
        self.foldable = len(lines) > FOLD_LINES or len(text) > FOLD_CHARS
        self.folded = self.foldable
        super().__init__(self.shown_text())

    def shown_text(self) -> str:
        if not self.folded:
            return self.full_text
        lines = self.full_text.splitlines()
        head = "\n".join(lines[:FOLD_SHOW_LINES])
        if len(head) > FOLD_CHARS // 4:
            head = head[: FOLD_CHARS // 4]
        size = f"{len(lines):,} {'line' if len(lines) == 1 else 'lines'}"
        if self.tokens is not None:
            size += f", {self.tokens:,} tokens"
        # the head as plain text (a cut-off paste is rarely valid Markdown), then the fold line
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", head)), default=0))
        return f"{fence}text\n{head}\n{fence}\n\n*… {size} — click to expand*"

    async def on_click(self) -> None:
        if self.foldable:
            self.folded = not self.folded
            self.set_class(self.folded, "folded")
            await self.update(self.shown_text())


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

    async def add_user(self, text: str, tokens: int | None = None) -> UserMessage:
        """A prompt (folded when long: its ``tokens`` are shown on the fold line)."""
        widget = UserMessage(text, tokens)
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

    async def add_notice(self, markdown: str, *, error: bool = False, before: Widget | None = None) -> Notice:
        """A notice at the end (or above ``before``, e.g. a reply that is streaming)."""
        widget = Notice(markdown)
        if error:
            widget.add_class("error")
        await self.mount(widget, before=before)
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
