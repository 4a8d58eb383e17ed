"""The hardware report (what `llmchat doctor` prints): GPUs, chosen backend and why, memory budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from app.units import format_bytes
from app.widgets.chat_log import error_markdown

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp


def hardware_summary(report: Any) -> str:
    """A few lines for the first-run screen: GPU(s), backend and why, memory budget, Steam Deck."""
    lines = []
    devices = list(getattr(report, "devices", []) or [])
    if getattr(report, "steam_deck", False):
        lines.append("Steam Deck detected (AMD Van Gogh APU)")
    if devices:
        for device in devices:
            lines.append(f"GPU: {getattr(device, 'name', device)}")
    else:
        lines.append("GPU: none found — running on the CPU")
    backend = getattr(report, "recommended_backend", None) or getattr(report, "backend", None) or "cpu"
    device = getattr(report, "device", None)
    lines.append(f"Backend: {backend}" + (f" ({device})" if device else ""))
    for reason in list(getattr(report, "reasons", []) or [])[:3]:
        lines.append(f"  why: {reason}")
    budget = getattr(report, "memory_budget_bytes", None)
    if budget:
        lines.append(f"Memory budget for models: {format_bytes(budget)}")
    for fix in list(getattr(report, "fixes", []) or [])[:2]:
        lines.append(f"  fix: {fix}")
    return "\n".join(lines)


def report_text(report: Any) -> str:
    format_text = getattr(report, "format_text", None)
    return format_text() if callable(format_text) else hardware_summary(report)


class HardwareScreen(Screen):
    """The doctor report, probed in a worker thread (cached by the app)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("r", "refresh", "Probe again"),
        Binding("q", "app.quit", "Quit", show=False),
    ]

    class Probed(Message):
        def __init__(self, report: Any, error: BaseException | None) -> None:
            super().__init__()
            self.report = report
            self.error = error

    @property
    def llm_app(self) -> LlmchatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Static("Hardware", id="hardware-title", classes="screen-title")
        with VerticalScroll(id="hardware-body"):
            yield Static("probing…", id="hardware-report", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        if self.llm_app.hardware_report is not None:
            self._show(self.llm_app.hardware_report)
        else:
            self._probe()

    def action_refresh(self) -> None:
        self.query_one("#hardware-report", Static).update("probing…")
        self.llm_app.services.forget_probe()
        self._probe()

    @work(thread=True, exclusive=True, group="probe", exit_on_error=False)
    def _probe(self) -> None:
        try:
            report = self.llm_app.services.probe()
        except BaseException as err:
            self.post_message(self.Probed(None, err))
            return
        self.post_message(self.Probed(report, None))

    @on(Probed)
    def on_probed(self, message: Probed) -> None:
        if message.error is not None:
            self.query_one("#hardware-report", Static).update(error_markdown(message.error).replace("**", ""))
            return
        self.llm_app.hardware_report = message.report
        self._show(message.report)

    def _show(self, report: Any) -> None:
        self.query_one("#hardware-report", Static).update(report_text(report))
