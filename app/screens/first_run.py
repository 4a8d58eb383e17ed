"""First run (no model installed): the hardware summary, the catalog with fit badges and the default
model preselected; Enter downloads, compiles and loads it (the loading screen), then the chat."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Static

from app.errors import LlmchatError
from app.screens.catalog_data import CatalogLoaded, LoadsCatalog, fit_function
from app.screens.hardware import hardware_summary
from app.widgets.catalog_table import CatalogTable
from app.widgets.chat_log import error_markdown

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp

WELCOME = (
    "Welcome to llmchat. No model is installed yet: pick one (the default is small and quick to "
    "download), press Enter, and llmchat downloads it, compiles it for your hardware and opens the chat."
)


class FirstRunScreen(LoadsCatalog, Screen):
    """Guided start: hardware summary → pick a model → loading screen → chat."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "start", "Download and chat", priority=True),
        Binding("f3", "app.open_hardware", "Hardware"),
        Binding("q", "app.quit", "Quit", show=False),
    ]

    @property
    def llm_app(self) -> LlmchatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        with Vertical(id="first-run"):
            yield Static(WELCOME, id="welcome")
            yield Static("Your hardware", classes="section-title")
            yield Static("probing…", id="hardware-summary", markup=False)
            yield Static("Models", classes="section-title")
            yield CatalogTable(id="first-run-catalog")
            yield Static("", id="first-run-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(CatalogTable).focus()
        self.load_catalog()

    @on(CatalogLoaded)
    def on_catalog_loaded(self, message: CatalogLoaded) -> None:
        status = self.query_one("#first-run-status", Static)
        summary = self.query_one("#hardware-summary", Static)
        if message.data is None:
            status.update(error_markdown(message.error or LlmchatError("no catalog")).replace("**", ""))
            return
        data = message.data
        if data.report is not None:
            summary.update(hardware_summary(data.report))
        else:
            summary.update(f"The hardware probe failed: {data.probe_error} — llmchat will use the CPU.")
        default = self.llm_app.services.default_model_id
        self.query_one(CatalogTable).show(
            data.entries,
            data.installed,
            fit_function(self.llm_app, data.report),
            select=default,
            speeds=data.speeds,
        )
        status.update(f"Enter: download and chat with the selected model (default: {default})")

    def action_start(self) -> None:
        model_id = self.query_one(CatalogTable).selected_id
        if model_id is not None:
            self.llm_app.start_model(model_id)
