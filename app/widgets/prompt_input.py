"""The multi-line prompt: Enter sends, Shift+Enter / Ctrl+J / Alt+Enter insert a newline,
Up on the first line and Down on the last line walk the input history."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptInput(TextArea):
    """A TextArea that submits on Enter and remembers what was sent."""

    @dataclass
    class Submitted(Message):
        """The user pressed Enter on a non-empty prompt."""

        prompt_input: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    @dataclass
    class Pasted(Message):
        """Text was pasted into the prompt (counted before it is sent)."""

        prompt_input: PromptInput
        text: str

        @property
        def control(self) -> PromptInput:
            return self.prompt_input

    def __init__(self, *, placeholder: str = "", id: str | None = None, sent: list[str] | None = None):
        super().__init__(
            "",
            id=id,
            placeholder=placeholder,
            soft_wrap=True,
            show_line_numbers=False,
            highlight_cursor_line=False,
            compact=True,
            tab_behavior="focus",
        )
        self.sent: list[str] = list(sent or [])
        self._history_index: int | None = None  # None: editing a new prompt
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.submit()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def on_paste(self, event: events.Paste) -> None:
        # TextArea._on_paste inserts the text (Textual calls it too); this only reports it
        if event.text and not self.read_only:
            self.post_message(self.Pasted(self, event.text))

    def submit(self) -> None:
        """Send the text (if any), remember it and clear the input."""
        text = self.text.strip()
        if not text:
            return
        if not self.sent or self.sent[-1] != text:
            self.sent.append(text)
        self._history_index = None
        self._draft = ""
        self.clear()
        self.post_message(self.Submitted(self, text))

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.cursor_location[0] == 0 and self.sent:
            self._recall(-1)
            return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if not select and self.cursor_location[0] == last_row and self._history_index is not None:
            self._recall(+1)
            return
        super().action_cursor_down(select)

    def _recall(self, step: int) -> None:
        if self._history_index is None:
            if step > 0:
                return
            self._draft = self.text
            index = len(self.sent) - 1
        else:
            index = self._history_index + step
        if index < 0:
            return
        if index >= len(self.sent):
            self._history_index = None
            self._set_text(self._draft)
            return
        self._history_index = index
        self._set_text(self.sent[index])

    def _set_text(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)
