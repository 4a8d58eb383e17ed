"""The models screen: the catalog with fit badges; download (progress, cancel), remove, chat with."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, ProgressBar, Static

from app.errors import LlmchatError
from app.inference.api import ProgressEvent
from app.screens.catalog_data import CatalogLoaded, LoadsCatalog, fit_function
from app.screens.loading import ProgressThrottle
from app.units import format_bytes
from app.widgets.catalog_table import CatalogTable
from app.widgets.chat_log import error_markdown
from app.widgets.servers_panel import ServersPanel

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp


class ModelsScreen(LoadsCatalog, Screen):
    """Browse, download, remove and pick models."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "use", "Chat with", priority=True),
        Binding("d", "download", "Download"),
        Binding("x", "remove", "Remove"),
        Binding("c", "cancel_download", "Cancel download"),
        Binding("a", "add_server", "Add a server"),
        Binding("escape", "back", "Back"),
        Binding("q", "app.quit", "Quit", show=False),
    ]

    class DownloadProgress(Message):
        def __init__(self, event: ProgressEvent) -> None:
            super().__init__()
            self.event = event

    class DownloadDone(Message):
        def __init__(self, model_id: str, error: BaseException | None, library: str | None = None) -> None:
            super().__init__()
            self.model_id = model_id
            self.error = error
            self.library = library  # the prebuilt library installed, or why it compiles on first use

    def __init__(self) -> None:
        super().__init__()
        self.downloading: str | None = None
        self.cancel_event: threading.Event | None = None
        self._remove_armed: str | None = None
        self.last_result = ""  # the outcome of the last download or removal, kept above the hints

    @property
    def llm_app(self) -> LlmchatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Static("Models", id="models-title", classes="screen-title")
        yield CatalogTable(id="catalog")
        yield Static("loading the catalog…", id="models-status", markup=False)
        yield ProgressBar(id="download-progress", show_eta=False)
        yield ServersPanel(id="servers-panel")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#download-progress").display = False
        self.query_one(CatalogTable).focus()
        self.load_catalog()

    @on(CatalogLoaded)
    def on_catalog_loaded(self, message: CatalogLoaded) -> None:
        status = self.query_one("#models-status", Static)
        if message.data is None:
            status.update(error_markdown(message.error or LlmchatError("no catalog")).replace("**", ""))
            return
        data = message.data
        table = self.query_one(CatalogTable)
        current = table.selected_id
        engine = self.llm_app.engine
        select = current or (engine.info.model_id if engine else self.llm_app.services.default_model_id)
        table.show(
            data.entries,
            data.installed,
            fit_function(self.llm_app, data.report),
            select=select,
            speeds=data.speeds,
            broken=data.broken,
        )
        note = f"{len(data.installed)} installed · Enter: chat with · d: download · x: remove"
        for model_id, problem in data.broken.items():
            note += f"\n{model_id} is broken: {problem} · d on it fetches what is missing or damaged"
        if data.probe_error is not None:
            note += f" · fit unknown: {data.probe_error}"
        status.update(f"{self.last_result}\n{note}" if self.last_result else note)

    # -- actions -------------------------------------------------------------------------------
    def _selected(self) -> str | None:
        return self.query_one(CatalogTable).selected_id

    def action_use(self) -> None:
        servers = self.query_one(ServersPanel)
        if servers.has_focus_within:
            servers.connect_selected()
            return
        model_id = self._selected()
        if model_id is None:
            return
        engine = self.llm_app.engine
        if engine is not None and engine.info.model_id == model_id:
            self.app.pop_screen()
            return
        self.llm_app.start_model(model_id)

    def action_add_server(self) -> None:
        self.query_one(ServersPanel).add_server()

    def action_back(self) -> None:
        if len(self.app.screen_stack) > 2:
            self.app.pop_screen()

    def action_download(self) -> None:
        model_id = self._selected()
        if model_id is None:
            return
        if self.downloading:
            self.notify(f"Already downloading {self.downloading} (c cancels it).", severity="warning")
            return
        if self.llm_app.services.installed_model_path(
            model_id
        ) is not None and not self.llm_app.services.install_problem(model_id):
            self.notify(f"{model_id} is already installed.")
            return
        self.downloading = model_id
        self.cancel_event = threading.Event()
        self.llm_app.cancel_events.add(self.cancel_event)
        bar = self.query_one("#download-progress", ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.query_one("#models-status", Static).update(f"downloading {model_id}… (c cancels)")
        self._download(model_id, self.cancel_event)

    @work(thread=True, group="download", exit_on_error=False)
    def _download(self, model_id: str, cancel: threading.Event) -> None:
        progress = ProgressThrottle(lambda event: self.post_message(self.DownloadProgress(event)))
        try:
            path = self.llm_app.services.download_model(model_id, progress, cancel)
            if cancel.is_set():
                raise LlmchatError(f"The download of {model_id} was cancelled.", "press d to start it again")
        except BaseException as err:
            self.post_message(self.DownloadDone(model_id, err))
            return
        library = None
        try:  # the weights are installed; the library step only adds to them
            library = self.llm_app.services.prepare_library(
                model_id, path, self.llm_app.options.device, progress, cancel
            )
        except Exception as err:
            library = f"the model library compiles on first use ({getattr(err, 'problem', None) or err})"
        self.post_message(self.DownloadDone(model_id, None, library))

    @on(DownloadProgress)
    def on_download_progress(self, message: DownloadProgress) -> None:
        event = message.event
        bar = self.query_one("#download-progress", ProgressBar)
        if event.fraction is not None:
            bar.update(total=100, progress=event.fraction * 100)
        detail = f" — {format_bytes(event.done or 0)} / {format_bytes(event.total)}" if event.total else ""
        self.query_one("#models-status", Static).update(f"{event.message}{detail} (c cancels)")

    @on(DownloadDone)
    def on_download_done(self, message: DownloadDone) -> None:
        if self.cancel_event is not None:
            self.llm_app.cancel_events.discard(self.cancel_event)
        self.downloading = None
        self.cancel_event = None
        self.query_one("#download-progress").display = False
        status = self.query_one("#models-status", Static)
        if message.error is not None:
            self.last_result = error_markdown(message.error).replace("**", "")
            self.llm_app.show_error(message.error)
        else:
            self.last_result = f"{message.model_id} installed. Enter: chat with it"
            if message.library:
                self.last_result += f"\n{message.library}"
            self.notify(f"{message.model_id} installed")
        status.update(self.last_result)
        self.load_catalog()

    def interrupt(self) -> bool:
        """Ctrl+C (from the app): cancel the running download; False when there is none (the app quits)."""
        if self.cancel_event is None or self.cancel_event.is_set():
            return False
        self.action_cancel_download()
        self.notify("Cancelling the download. Ctrl+C again quits.", timeout=3)
        return True

    def action_cancel_download(self) -> None:
        if self.cancel_event is not None:
            self.cancel_event.set()
            self.query_one("#models-status", Static).update(f"cancelling the download of {self.downloading}…")

    def action_remove(self) -> None:
        model_id = self._selected()
        if model_id is None:
            return
        engine = self.llm_app.engine
        if engine is not None and engine.info.model_id == model_id:
            self.notify(f"{model_id} is in use: switch to another model first.", severity="warning")
            return
        if self.llm_app.services.installed_model_path(model_id) is None:
            self.notify(f"{model_id} is not installed.")
            return
        if self._remove_armed != model_id:
            self._remove_armed = model_id
            self.notify(f"Press x again to remove {model_id}.", severity="warning")
            return
        self._remove_armed = None
        try:
            self.llm_app.services.remove_model(model_id)
        except Exception as err:
            self.llm_app.show_error(err)
            return
        self.last_result = f"{model_id} removed"
        self.notify(self.last_result)
        self.load_catalog()

    @on(DataTable.RowHighlighted)
    def on_row_highlighted(self) -> None:
        self._remove_armed = None
