"""Saved conversations: pick one to resume it (Enter), delete (x)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from app.errors import LlmchatError
from app.units import plural

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp


class ConversationsScreen(ModalScreen):
    """The list of saved conversations, newest first."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("x", "delete", "Delete"),
    ]

    @property
    def llm_app(self) -> LlmchatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Static("Conversations (Enter resumes)", classes="screen-title")
        yield OptionList(id="conversations")
        yield Footer()

    def on_mount(self) -> None:
        self._fill()
        self.query_one(OptionList).focus()

    def _fill(self) -> None:
        options = self.query_one(OptionList)
        options.clear_options()
        try:
            conversations = self.llm_app.history.list(limit=200)
        except LlmchatError as err:  # a damaged history: moved aside, the chat goes on
            self.llm_app.show_error(err)
            conversations = []
        for conversation in conversations:
            when = datetime.fromtimestamp(conversation.updated_at).strftime("%Y-%m-%d %H:%M")
            label = f"{when}  {conversation.title or '(untitled)'}  · {conversation.model} · "
            label += plural(conversation.message_count, "message")
            options.add_option(Option(label, id=str(conversation.id)))
        if options.option_count == 0:
            options.add_option(Option("No saved conversations yet.", id="none", disabled=True))

    async def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id and event.option.id != "none":
            self.app.pop_screen()
            await self.llm_app.resume_conversation(int(event.option.id))

    def action_delete(self) -> None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return
        option = options.get_option_at_index(options.highlighted)
        if option.id and option.id != "none":
            try:
                self.llm_app.history.delete(int(option.id))
            except LlmchatError as err:
                self.llm_app.show_error(err)
            self._fill()
