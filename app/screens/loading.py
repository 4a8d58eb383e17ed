"""Getting a model ready: download when not installed, compile and load — in a worker thread, with
progress ("compiling for vulkan:0 …") — then the chat. Errors show as a panel with the fix."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, ProgressBar, Static

from app.errors import LlmchatError
from app.inference.api import Engine, ProgressEvent
from app.units import format_bytes
from app.widgets.chat_log import error_markdown

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp

STAGE_NAMES = {"download": "Downloading", "import": "Importing", "compile": "Compiling", "load": "Loading"}


class ProgressThrottle:
    """Forward progress events at most every ``interval`` seconds (always on a new stage or message)."""

    def __init__(self, forward, interval: float = 0.1) -> None:
        self.forward = forward
        self.interval = interval
        self._last = 0.0
        self._last_key: tuple[str, str] | None = None

    def __call__(self, event: ProgressEvent) -> None:
        now = time.monotonic()
        key = (event.stage, event.message)
        finished = event.total is not None and event.done is not None and event.done >= event.total
        if key != self._last_key or finished or now - self._last >= self.interval:
            self._last, self._last_key = now, key
            self.forward(event)


class LoadingScreen(Screen):
    """Download → compile → load one model, then hand the engine to the app."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel / back"),
        Binding("r", "retry", "Retry", show=False),
        Binding("f2", "app.open_models", "Models"),
        Binding("f3", "app.open_hardware", "Hardware"),
    ]

    class Progress(Message):
        def __init__(self, event: ProgressEvent) -> None:
            super().__init__()
            self.event = event

    class Finished(Message):
        def __init__(self, engine: Engine | None, error: BaseException | None) -> None:
            super().__init__()
            self.engine = engine
            self.error = error

    def __init__(self, model: str, device: str = "auto", resume_id: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.device = device
        self.resume_id = resume_id
        self.cancel_event = threading.Event()
        self.failed = False
        self.stages: list[str] = []  # one line per stage seen: "Compiling: compiling … for cpu:0"
        self._stage_messages: dict[str, str] = {}

    @property
    def llm_app(self) -> LlmchatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-panel"):
            yield Static(f"Preparing **{self.model}**", id="loading-title", markup=False)
            yield Static("starting…", id="loading-status", markup=False)
            yield ProgressBar(id="loading-progress", show_eta=False)
            yield Static("", id="loading-stages", markup=False)
            yield Static("", id="loading-error", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        endpoint = self.llm_app.services.remote_endpoint
        if self.llm_app.services.servers.name_of(self.model) is not None:
            title = f"Connecting to the saved {self.model}"
        elif endpoint is not None:
            title = f"Connecting to {self.model or 'the model'} on {endpoint}"
        else:
            title = f"Preparing {self.model} on {self.device}"
        self.query_one("#loading-title", Static).update(title)
        self._start()

    def _start(self) -> None:
        self.failed = False
        self.cancel_event = threading.Event()
        self.llm_app.cancel_events.add(self.cancel_event)
        self.query_one("#loading-error", Static).update("")
        self.query_one("#loading-error").display = False
        # a daemon thread, not a Textual worker: a compile cannot be interrupted, and quitting must not
        # wait for it (the compiler writes its cache atomically; downloads stop on the cancel event)
        threading.Thread(target=self._prepare, name="llmchat-prepare", daemon=True).start()

    def _prepare(self) -> None:
        """Download (when needed), compile and load, in the background thread; posts Progress/Finished."""
        services = self.llm_app.services
        progress = ProgressThrottle(lambda event: self.post_message(self.Progress(event)))
        saved = services.servers.name_of(self.model)  # also from an --endpoint app: it is a server of its own
        try:
            if saved is not None:  # a server saved in the models screen: nothing to download or compile
                progress(ProgressEvent("load", f"connecting to {self.model}"))
                engine = services.open_server(saved)
                self.post_message(self.Finished(engine, None))
                return
            model: str | Path = self.model
            is_directory = Path(self.model).expanduser().is_dir()
            remote = services.remote_endpoint is not None
            if not remote and not is_directory and services.installed_model_path(self.model) is None:
                progress(ProgressEvent("download", f"downloading {self.model}"))
                model = services.download_model(self.model, progress, self.cancel_event)
                if self.cancel_event.is_set():
                    raise LlmchatError("The download was cancelled.", "press r to start it again")
                installed = services.installed_model_path(self.model)
                model = self.model if installed is not None else model
            progress(ProgressEvent("load", f"loading {self.model}"))
            engine = services.load_engine(model, self.device, progress)
        except BaseException as err:
            self.post_message(self.Finished(None, err))
            return
        self.post_message(self.Finished(engine, None))

    @on(Progress)
    def on_progress(self, message: Progress) -> None:
        event = message.event
        bar = self.query_one("#loading-progress", ProgressBar)
        if event.fraction is not None:
            bar.update(total=100, progress=event.fraction * 100)
        else:
            bar.update(total=None)
        detail = ""
        if event.stage == "download" and event.total:
            detail = f" — {format_bytes(event.done or 0)} / {format_bytes(event.total)}"
        self.query_one("#loading-status", Static).update(f"{event.message}{detail}")
        self._stage_messages.pop(event.stage, None)  # a stage seen again moves to the end
        self._stage_messages[event.stage] = event.message
        self.stages = [f"{STAGE_NAMES.get(k, k)}: {m}" for k, m in self._stage_messages.items()]
        marks = ["✓"] * (len(self.stages) - 1) + ["…"]
        lines = [f"{mark} {line}" for mark, line in zip(marks, self.stages, strict=True)]
        self.query_one("#loading-stages", Static).update("\n".join(lines))

    @on(Finished)
    async def on_finished(self, message: Finished) -> None:
        self.llm_app.cancel_events.discard(self.cancel_event)
        if message.engine is not None:
            await self.llm_app.engine_ready(message.engine, resume_id=self.resume_id)
            return
        self.failed = True
        err = message.error or LlmchatError("The model did not load.")
        panel = self.query_one("#loading-error", Static)
        keys = "r: retry · F2: models · Esc: back · Ctrl+C: quit"
        panel.update(error_markdown(err).replace("**", "") + "\n\n" + keys)
        panel.display = True
        self.query_one("#loading-status", Static).update(f"Could not prepare {self.model}.")
        self.query_one("#loading-progress", ProgressBar).update(total=100, progress=0)

    def interrupt(self) -> bool:
        """Ctrl+C (from the app): cancel a download; anything else (a compile cannot be interrupted,
        or a download already cancelled) is False, and the app quits."""
        if (
            self.failed
            or self.cancel_event.is_set()
            or not self.stages
            or not self.stages[-1].startswith(STAGE_NAMES["download"])
        ):
            return False
        self.action_cancel()
        self.notify("Cancelling the download. Ctrl+C again quits.", timeout=3)
        return True

    def action_cancel(self) -> None:
        if not self.failed and not self.cancel_event.is_set():
            self.cancel_event.set()
            self.query_one("#loading-status", Static).update("cancelling…")
            return
        if len(self.app.screen_stack) > 2:
            self.app.pop_screen()
        else:
            from app.screens.first_run import FirstRunScreen

            self.app.switch_screen(FirstRunScreen())

    def action_retry(self) -> None:
        if self.failed:
            self._start()
