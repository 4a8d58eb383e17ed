""" "Add a server" (from the models screen): an OpenAI-compatible endpoint, its optional API key and
one of the models its ``/v1/models`` lists, saved for the chat
(``services.servers``, ``app.inference.services.SavedServers``).

The URL and key are checked against the server before anything is saved: unreachable, a missing or
refused key, no OpenAI API at that URL, no model loaded — each shown with its fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static

from app.errors import LlmchatError
from app.widgets.chat_log import error_markdown

if TYPE_CHECKING:
    from app.inference.services import SavedServers, Services


class AddServerScreen(ModalScreen):
    """The form; dismissed with the ``SavedServer`` saved, or None."""

    DEFAULT_CSS = """
    AddServerScreen { align: center middle; }
    AddServerScreen > #add-server { width: 90; max-width: 100%; height: auto; border: round $accent;
        padding: 0 1; background: $surface; }
    AddServerScreen Label { margin-top: 1; }
    AddServerScreen #add-server-buttons { height: auto; margin-top: 1; }
    AddServerScreen #add-server-buttons Button { margin-right: 2; }
    AddServerScreen #add-server-status { height: auto; margin-top: 1; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    class Fetched(Message):
        def __init__(
            self,
            query: tuple[str, str],
            models: list[str] | None,
            error: BaseException | None,
            key_store: str = "",
        ) -> None:
            super().__init__()
            self.query = query
            self.models = models
            self.error = error
            self.key_store = key_store  # where a key saved now would go, in words

    class Saved(Message):
        def __init__(self, server, error: BaseException | None) -> None:
            super().__init__()
            self.server = server
            self.error = error

    def __init__(self) -> None:
        super().__init__()
        self.models: list[str] = []
        self.fetched_for: tuple[str, str] | None = None  # (url, key) the model list belongs to
        self.busy = False
        self.status_text = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="add-server"):
            yield Static(
                "Add a server — any OpenAI-compatible API (llmchat serve, vLLM, SGLang, "
                "mlc_llm serve, llama.cpp, Ollama …)",
                id="add-server-title",
                markup=False,
            )
            yield Label("URL")
            yield Input(placeholder="http://127.0.0.1:8000/v1", id="server-url")
            yield Label("API key (optional)")
            yield Input(placeholder="none", password=True, id="server-key")
            yield Label("Model")
            yield Select([], prompt="fetch the server's models first", id="server-model", disabled=True)
            yield Label("Name")
            yield Input(placeholder="host:port", id="server-name")
            with Horizontal(id="add-server-buttons"):
                yield Button("Fetch models", id="fetch", variant="primary")
                yield Button("Save", id="save", variant="success", disabled=True)
                yield Button("Cancel", id="cancel")
            yield Static(
                "Enter in the URL or key field fetches the server's models.",
                id="add-server-status",
                markup=False,
            )

    def on_mount(self) -> None:
        self.query_one("#server-url", Input).focus()

    # -- state ---------------------------------------------------------------------------------
    def _servers(self) -> SavedServers:
        services: Services = self.app.services  # type: ignore[attr-defined]
        return services.servers

    def _query(self) -> tuple[str, str]:
        return (
            self.query_one("#server-url", Input).value.strip(),
            self.query_one("#server-key", Input).value.strip(),
        )

    def _status(self, text: str) -> None:
        self.status_text = text
        self.query_one("#add-server-status", Static).update(text)

    def _error(self, err: BaseException) -> None:
        if not isinstance(err, LlmchatError):
            err = LlmchatError(f"{type(err).__name__}: {err}", "check the URL and the server")
        self._status(error_markdown(err).replace("**", ""))

    @on(Input.Changed, "#server-url, #server-key")
    def on_query_changed(self) -> None:
        """A changed URL or key needs the models fetched again before saving."""
        self.query_one("#save", Button).disabled = self.fetched_for != self._query()

    # -- fetch ---------------------------------------------------------------------------------
    @on(Input.Submitted, "#server-url, #server-key")
    @on(Button.Pressed, "#fetch")
    def action_fetch(self) -> None:
        if self.busy:
            return
        url, key = self._query()
        if not url:
            self._status("Type the server's URL first (e.g. http://127.0.0.1:8000/v1).")
            return
        self.busy = True
        self._status(f"asking {url} for its models…")
        self._fetch((url, key))

    @work(thread=True, exclusive=True, group="add-server", exit_on_error=False)
    def _fetch(self, query: tuple[str, str]) -> None:
        servers = self._servers()
        try:
            endpoint, models = servers.fetch_models(query[0], query[1] or None)
            if not models:
                raise LlmchatError(
                    f"The server at {endpoint} offers no model.",
                    "load a model on the server (e.g. llmchat serve --model ID), then fetch again",
                )
            # asking the keyring which backend it has may talk to D-Bus: not on the UI thread
            key_store = servers.key_store_name() if query[1] else ""
        except BaseException as err:
            self.post_message(self.Fetched(query, None, err))
            return
        self.post_message(self.Fetched(query, models, None, key_store))

    @on(Fetched)
    def on_fetched(self, message: Fetched) -> None:
        self.busy = False
        select = self.query_one("#server-model", Select)
        if message.models is None:
            self.fetched_for = None
            self.models = []
            select.set_options([])
            select.disabled = True
            self.query_one("#save", Button).disabled = True
            self._error(message.error or LlmchatError("no models"))
            return
        self.models = message.models
        self.fetched_for = message.query
        select.set_options([(name, name) for name in self.models])
        select.disabled = False
        select.value = self.models[0]
        name = self.query_one("#server-name", Input)
        if not name.value.strip():
            name.value = self._servers().default_name(message.query[0])
        self.query_one("#save", Button).disabled = self.fetched_for != self._query()
        count = len(self.models)
        where = f" The key will be kept in {message.key_store}." if message.key_store else ""
        self._status(f"{count} model{'s' if count != 1 else ''} on the server: pick one, then Save.{where}")
        select.focus()

    # -- save ----------------------------------------------------------------------------------
    @on(Input.Submitted, "#server-name")
    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        if self.busy:
            return
        query = self._query()
        if self.fetched_for != query:
            self._status("Fetch the server's models first (the URL or key changed).")
            return
        model = self.query_one("#server-model", Select).value
        if not isinstance(model, str) or model not in self.models:
            self._status("Pick one of the server's models.")
            return
        self.busy = True
        self._save(self.query_one("#server-name", Input).value, query, model)

    @work(thread=True, exclusive=True, group="add-server", exit_on_error=False)
    def _save(self, name: str, query: tuple[str, str], model: str) -> None:
        try:
            server = self._servers().save(name, query[0], model, query[1] or None)
        except BaseException as err:
            self.post_message(self.Saved(None, err))
            return
        self.post_message(self.Saved(server, None))

    @on(Saved)
    def on_saved(self, message: Saved) -> None:
        self.busy = False
        if message.server is None:
            self._error(message.error or LlmchatError("not saved"))
            return
        self.dismiss(message.server)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
