"""The models screen's servers: the OpenAI-compatible endpoints saved with "add a server", listed
under the local models. Enter chats with the selected one, ``a`` adds one, ``x`` (twice) removes it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Static

from app.errors import LlmchatError
from app.widgets.chat_log import error_markdown

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp
    from app.inference.api import SavedServer

KEY_WORDS = {"keyring": "in the keyring", "file": "in servers.json (0600)", "none": "—"}


class ServerTable(DataTable):
    """One row per saved server, keyed by its name."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("x", "remove_server", "Remove server"),
    ]

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        self.add_columns("Server", "URL", "Model", "API key")

    def show(self, servers: list[SavedServer], select: str | None = None) -> None:
        self.clear()
        for server in servers:
            self.add_row(
                server.name,
                server.endpoint,
                server.model,
                Text(KEY_WORDS[server.key], style="dim" if server.key == "none" else ""),
                key=server.name,
            )
        if select is not None:
            with contextlib.suppress(Exception):
                self.move_cursor(row=self.get_row_index(select))

    @property
    def selected_name(self) -> str | None:
        if self.row_count == 0:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return str(row_key.value)

    def action_remove_server(self) -> None:
        panel = next(a for a in self.ancestors if isinstance(a, ServersPanel))
        panel.remove_selected()


class ServersPanel(Vertical):
    """The saved servers with a heading; hidden rows when there are none, the hint stays."""

    DEFAULT_CSS = """
    ServersPanel { height: auto; max-height: 10; }
    ServersPanel > #servers-heading { height: auto; padding: 0 1; color: $text-muted; }
    ServersPanel > ServerTable { height: auto; max-height: 8; }
    """

    class Loaded(Message):
        def __init__(
            self, servers: list[SavedServer] | None, error: BaseException | None, select: str | None
        ) -> None:
            super().__init__()
            self.servers = servers
            self.error = error
            self.select = select

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.servers: list[SavedServer] = []
        self._remove_armed: str | None = None

    @property
    def llm_app(self) -> LlmchatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Static(
            "Servers — a: add a server (OpenAI-compatible: llmchat serve, vLLM, llama.cpp, Ollama …)",
            id="servers-heading",
            markup=False,
        )
        yield ServerTable(id="servers")

    def on_mount(self) -> None:
        self.query_one(ServerTable).display = False
        self.reload()

    @work(thread=True, exclusive=True, group="servers", exit_on_error=False)
    def reload(self, select: str | None = None) -> None:
        try:
            servers = self.llm_app.services.servers.load()
        except BaseException as err:
            self.post_message(self.Loaded(None, err, select))
            return
        self.post_message(self.Loaded(servers, None, select))

    @on(Loaded)
    def on_loaded(self, message: Loaded) -> None:
        heading = self.query_one("#servers-heading", Static)
        table = self.query_one(ServerTable)
        if message.servers is None:
            heading.update(error_markdown(message.error or LlmchatError("no servers")).replace("**", ""))
            table.display = False
            return
        self.servers = message.servers
        table.show(self.servers, select=message.select)
        table.display = bool(self.servers)
        count = len(self.servers)
        heading.update(
            f"Servers ({count}) — Enter: chat with · a: add a server · x: remove"
            if count
            else "Servers — a: add a server (OpenAI-compatible: llmchat serve, vLLM, llama.cpp, Ollama …)"
        )
        if message.select is not None:
            table.focus()

    @property
    def selected(self) -> SavedServer | None:
        name = self.query_one(ServerTable).selected_name
        return next((s for s in self.servers if s.name == name), None)

    def add_server(self) -> None:
        from app.screens.add_server import AddServerScreen

        def added(server: SavedServer | None) -> None:
            if server is not None:
                self.notify(f"Saved the server {server.name} ({server.model}). Enter: chat with it")
                self.reload(select=server.name)

        self.app.push_screen(AddServerScreen(), added)

    def connect_selected(self) -> None:
        """Chat with the selected server's model (the app's engine becomes a remote one)."""
        server = self.selected
        if server is None:
            return
        engine = self.llm_app.engine
        if engine is not None and getattr(engine, "saved_as", None) == server.ref:
            self.app.pop_screen()
            return
        self.llm_app.start_model(server.ref)

    def remove_selected(self) -> None:
        server = self.selected
        if server is None:
            return
        engine = self.llm_app.engine
        if engine is not None and getattr(engine, "saved_as", None) == server.ref:
            self.notify(f"{server.name} is in use: switch to another model first.", severity="warning")
            return
        if self._remove_armed != server.name:
            self._remove_armed = server.name
            self.notify(f"Press x again to remove the server {server.name}.", severity="warning")
            return
        self._remove_armed = None
        try:
            self.llm_app.services.servers.remove(server.name)
        except LlmchatError as err:
            self.llm_app.show_error(err)
            return
        self.notify(f"Removed the server {server.name}.")
        self.reload()

    @on(DataTable.RowHighlighted)
    def on_row_highlighted(self) -> None:
        self._remove_armed = None
