"""The Textual App: owns the engine, the sampling settings, the conversation store and the screens.

The UI reaches the engine, the hardware probe, the catalog and downloads only through ``Services``
(``app.inference.services``: ``LocalServices`` by default; tests pass their own, e.g. one whose
loader returns the tiny engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.command import DiscoveryHit, Hit, Hits, Provider

from app import chat_commands, paths
from app.errors import LlmchatError
from app.history import HistoryDamaged, HistoryStore
from app.inference.api import Engine, Message, ModelSampling, SamplingParams, SavedServer
from app.inference.services import LocalServices, Services

CSS_FILE = paths.asset("llmchat.tcss")


def screenshot_dir() -> Path:
    """Where screenshots go: the user's Downloads directory if it exists, else one of llmchat's own."""
    from platformdirs import user_downloads_path

    from app.paths import data_dir

    downloads = user_downloads_path()
    if downloads.is_dir() and os.access(downloads, os.W_OK):
        return downloads
    own = data_dir() / "screenshots"
    own.mkdir(parents=True, exist_ok=True)
    return own


def engine_ref(engine: Engine) -> str:
    """How the history names the model ``engine`` runs: ``server:NAME`` for a saved server (so that
    resuming reconnects to it), else the model's id."""
    return getattr(engine, "saved_as", None) or engine.info.model_id


class ChatCommandsProvider(Provider):
    """The slash commands, switching to an installed model and to a saved server in the command
    palette."""

    def _commands(self) -> list[tuple[str, str, Callable[[], Any]]]:
        app: LlmchatApp = self.app  # type: ignore[assignment]
        found = []
        for spec in chat_commands.COMMANDS:
            found.append((f"/{spec.name}", spec.help, _bind(app.palette_command, spec)))
        try:
            installed = app.services.list_installed()
        except Exception:
            installed = []
        for model_id in installed:
            title = f"/model {model_id}"
            found.append((title, "switch to this installed model", _bind(app.start_model, model_id)))
        for server in _saved_servers(app.services):
            found.append(
                (
                    f"/model {server.ref}",
                    f"chat with {server.model} on the saved server {server.endpoint}",
                    _bind(app.start_model, server.ref),
                )
            )
        return found

    async def discover(self) -> Hits:
        for title, help_text, callback in self._commands():
            yield DiscoveryHit(title, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, help_text, callback in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, help=help_text)


def _saved_servers(services: Services) -> list[SavedServer]:
    """The servers saved in the models screen ("add a server"); none when the file cannot be read (the
    models screen says why)."""
    try:
        return services.servers.load()
    except LlmchatError:
        return []


def _bind(function: Callable[[Any], Any], arg: Any) -> Callable[[], Any]:
    return lambda: function(arg)


@dataclass
class StartOptions:
    """How the app starts: the CLI's --model, --device and --continue."""

    model: str | None = None
    device: str = "auto"
    continue_last: bool = False
    history_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class LlmchatApp(App):
    """llmchat: chat with a locally compiled model."""

    TITLE = "llmchat"
    CSS_PATH = str(CSS_FILE)
    COMMANDS: ClassVar = App.COMMANDS | {ChatCommandsProvider}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+c", "interrupt", "Stop / quit", priority=True),
        Binding("ctrl+q", "quit", "Quit", show=False, priority=True),
        Binding("q", "quit", "Quit", show=False),
    ]

    def __init__(self, options: StartOptions | None = None, services: Services | None = None) -> None:
        super().__init__()
        self.options = options or StartOptions()
        self.services: Services = services or LocalServices()
        self.engine: Engine | None = None
        self.model_sampling = ModelSampling()  # the loaded model's defaults (set in engine_ready)
        self.sampling_overrides: dict[str, Any] = {}  # the user's /set values: they win over the defaults
        self._params = SamplingParams()
        self.system_prompt: str | None = None
        self.history: HistoryStore = HistoryStore(self.options.history_path)
        self.conversation_id: int | None = None
        #: the messages of the current conversation as saved (re-saved if the history file breaks)
        self.saved_messages: list[tuple[str, str, dict | None]] = []
        self._history_generation = self.history.generation
        self.resumed_messages: list[Message] = []
        self.prompt_history: list[str] = []
        self.hardware_report: Any = None
        self.cancel_events: set[threading.Event] = set()
        self._quitting = False

    # -- sampling ------------------------------------------------------------------------------
    @property
    def params(self) -> SamplingParams:
        """The sampling settings of the next reply: the model's defaults with the user's /set on top."""
        return self._params

    @params.setter
    def params(self, value: SamplingParams) -> None:
        """Set every field (as if each had been /set)."""
        self.sampling_overrides = asdict(value)
        self._params = value

    def set_sampling(self, overrides: dict[str, Any] | None = None, *, reset: bool = False) -> None:
        """Apply validated /set values (``reset``: drop every /set value first)."""
        merged = {} if reset else dict(self.sampling_overrides)
        merged.update(overrides or {})
        # raises on a bad value
        self._params = self.services.sampling.apply(self.model_sampling.params, merged)
        self.sampling_overrides = merged

    def save_sampling(self) -> None:
        """Keep the /set values for the loaded model in the config directory (LlmchatError when that
        fails: they still apply until the app quits)."""
        if self.engine is not None:
            from app import settings

            settings.save_overrides(self.engine.info.model_id, self.sampling_overrides)

    def load_saved_sampling(self, model_id: str, switched: bool) -> None:
        """The /set values saved for ``model_id`` replace the current ones; with none saved, a model
        switched to starts from its defaults (the first model keeps what the app was started with)."""
        from app import settings

        saved, problems = settings.load_overrides(model_id)
        for problem in problems:
            self.notify(problem, severity="warning", timeout=12, markup=False)
        if saved is not None:
            self.sampling_overrides = saved
        elif switched:
            self.sampling_overrides = {}

    # -- start ---------------------------------------------------------------------------------
    def on_mount(self) -> None:
        options = self.options
        resume = None
        self.show_history_notice()
        if options.continue_last:
            try:
                resume = self.history.latest()
            except LlmchatError as err:
                self.show_error(err)
            if resume is None:
                self.notify("There is no saved conversation to continue: starting a new one.")
        model = options.model or (resume.model if resume else None)
        if self.services.remote_endpoint is not None:
            # the server's model: the one asked for, the resumed one, else the first it lists
            self.start_model(model or "", resume_id=resume.id if resume else None)
            return
        if model:
            self.start_model(model, resume_id=resume.id if resume else None)
            return
        try:
            installed = self.services.list_installed()
        except Exception:
            installed = []
        if installed:
            preferred = self.services.default_model_id
            self.start_model(preferred if preferred in installed else installed[0])
        else:
            from app.screens.first_run import FirstRunScreen

            self.push_screen(FirstRunScreen())

    def start_model(self, model: str, resume_id: int | None = None) -> None:
        """Download (when needed), compile and load ``model``, then open the chat."""
        from app.screens.loading import LoadingScreen

        self.push_screen(LoadingScreen(model, self.options.device, resume_id=resume_id))

    async def engine_ready(self, engine: Engine, resume_id: int | None = None) -> None:
        """Called by the loading screen: swap in the new engine and open a chat on it."""
        from app.screens.chat import ChatScreen

        old = self.engine
        self.engine = engine
        if old is not None and old is not engine:
            await self._stop_chat_screens()
            await asyncio.to_thread(old.close)
        self.resumed_messages = []
        self.conversation_id = None
        self.saved_messages = []
        self.model_sampling = self.services.sampling_defaults(engine)
        switched = old is not None and old.info.model_id != engine.info.model_id
        self.load_saved_sampling(engine.info.model_id, switched)
        self.set_sampling()
        if resume_id is not None:
            try:
                conversation = self.history.get(resume_id)
                # a reply cut off by a kill leaves a user turn without an answer: take it back out
                # (alternating-role templates reject two user turns in a row)
                unanswered = self.history.drop_unanswered_tail(resume_id) if conversation else []
                messages = self.history.messages(resume_id) if conversation else []
            except LlmchatError as err:
                self.show_error(err)
                conversation, unanswered, messages = None, [], []
            if unanswered:
                self.notify(
                    "Your last message had no reply (llmchat stopped mid-reply): it was taken out "
                    "of the conversation; press Up to send it again.",
                    severity="warning",
                    timeout=10,
                )
            if conversation is not None:
                self.saved_messages = [(m.role, m.content, None) for m in messages]
                self._history_generation = self.history.generation
                self.system_prompt = conversation.system_prompt
                engine.set_system_prompt(conversation.system_prompt)
                engine.load_history(messages)
                self.resumed_messages = messages
                self.conversation_id = resume_id
                self.prompt_history = [m.content for m in messages + unanswered if m.role == "user"]
        elif self.system_prompt:
            engine.set_system_prompt(self.system_prompt)
        # one chat screen at a time: drop everything above the default screen and open the chat
        while len(self.screen_stack) > 1:
            self.pop_screen()
        await self.push_screen(ChatScreen(engine))

    async def _stop_chat_screens(self) -> None:
        from app.screens.chat import ChatScreen

        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                await screen.wait_reply_stopped()

    # -- conversation store --------------------------------------------------------------------
    def new_conversation(self) -> None:
        """The next message starts a new saved conversation."""
        self.conversation_id = None
        self.saved_messages = []

    def show_history_notice(self) -> None:
        """Tell the user once that a damaged history file was moved aside."""
        notice, self.history.notice = self.history.notice, None
        if notice:
            self.notify(notice, severity="warning", timeout=15, markup=False)

    def _save(self, role: str, content: str, stats: dict | None) -> int:
        replay: list[tuple[str, str, dict | None]] = []
        if self.conversation_id is not None and self._history_generation != self.history.generation:
            # the damaged file was moved aside (ids from it are gone): save the whole conversation
            # on screen into the new history
            self.show_history_notice()
            self.conversation_id, replay = None, list(self.saved_messages)
        if self.conversation_id is None:
            model = engine_ref(self.engine) if self.engine else ""
            self.conversation_id = self.history.new_conversation(model, self.system_prompt)
            self._history_generation = self.history.generation
        for old in replay:
            self.history.add_message(self.conversation_id, *old)
        return self.history.add_message(self.conversation_id, role, content, stats)

    def save_message(self, role: str, content: str, stats: dict | None = None) -> int | None:
        """Commit one complete message (creating the conversation with its first message); its row
        id, or None when it could not be saved (the chat goes on either way)."""
        try:
            try:
                row = self._save(role, content, stats)
            except HistoryDamaged:  # moved aside just now: the second try saves into the new file
                row = self._save(role, content, stats)
        except Exception as err:  # never lose the chat because the disk is full
            self.notify(f"Could not save the message: {err}", severity="error", markup=False)
            return None
        self.saved_messages.append((role, content, stats))
        return row

    def forget_message(self, row: int | None) -> None:
        """Take a saved user turn back out (its reply failed: no orphan row is left behind)."""
        if row is None:
            return
        with contextlib.suppress(Exception):
            self.history.delete_message(row)
        if self.saved_messages and self.saved_messages[-1][0] == "user":
            self.saved_messages.pop()

    def save_system_prompt(self, text: str | None) -> None:
        if self.conversation_id is not None:
            try:
                self.history.set_system_prompt(self.conversation_id, text)
            except LlmchatError as err:
                self.show_error(err)

    async def resume_conversation(self, conversation_id: int) -> None:
        """Open a saved conversation (loading its model when it is another one)."""
        try:
            conversation = self.history.get(conversation_id)
        except LlmchatError as err:
            self.show_error(err)
            return
        if conversation is None:
            return
        if self.engine is not None and conversation.model in ("", engine_ref(self.engine)):
            await self._stop_chat_screens()
            self.engine.reset()
            await self.engine_ready(self.engine, resume_id=conversation_id)
        else:
            self.start_model(conversation.model, resume_id=conversation_id)

    # -- navigation ----------------------------------------------------------------------------
    def action_open_models(self) -> None:
        from app.screens.models import ModelsScreen

        if not isinstance(self.screen, ModelsScreen):
            self.push_screen(ModelsScreen())

    def action_open_hardware(self) -> None:
        from app.screens.hardware import HardwareScreen

        if not isinstance(self.screen, HardwareScreen):
            self.push_screen(HardwareScreen())

    def action_open_history(self) -> None:
        from app.screens.conversations import ConversationsScreen

        if not isinstance(self.screen, ConversationsScreen):
            self.push_screen(ConversationsScreen())

    def palette_command(self, spec: chat_commands.CommandSpec) -> None:
        """A command chosen in the palette: run it, or put it in the prompt when it takes an argument."""
        from app.screens.chat import ChatScreen
        from app.widgets.prompt_input import PromptInput

        chat = next((s for s in reversed(self.screen_stack) if isinstance(s, ChatScreen)), None)
        if spec.name in ("models", "hardware", "history"):
            getattr(self, f"action_open_{spec.name}")()
            return
        if spec.name == "exit":
            self.run_worker(self.action_quit())
            return
        if chat is None:
            self.notify("Load a model first (F2 opens the models).", severity="warning")
            return
        while self.screen is not chat:
            self.pop_screen()
        if spec.name in ("set", "system", "model", "export"):
            prompt = chat.query_one(PromptInput)
            prompt.load_text(f"/{spec.name} ")
            prompt.move_cursor(prompt.document.end)
            prompt.focus()
            return
        chat.run_worker(chat.run_command(chat_commands.Command(spec.name)), group="input")

    def show_error(self, err: BaseException) -> None:
        """A readable notification with the fix (never a traceback)."""
        from app.widgets.chat_log import error_markdown

        self.notify(error_markdown(err).replace("**", ""), severity="error", timeout=12, markup=False)

    def deliver_screenshot(
        self, filename: str | None = None, path: str | None = None, time_format: str | None = None
    ) -> str | None:
        """The palette's "Save screenshot": into the Downloads directory where there is one, else
        ``<data dir>/screenshots`` (Textual's default fails when ~/Downloads does not exist)."""
        if path is None:
            path = str(screenshot_dir())
        return super().deliver_screenshot(filename, path, time_format)

    # -- quit ----------------------------------------------------------------------------------
    async def action_interrupt(self) -> None:
        """Ctrl+C: stop what the screen is doing (a reply, its prefill, a download), as Ollama and
        llama-cli do; with nothing to stop, or pressed again before it has stopped, quit."""
        stop = getattr(self.screen, "interrupt", None)
        if stop is not None and stop():
            return
        await self.action_quit()

    async def action_quit(self) -> None:
        """Quit cleanly, also mid-reply (cancel the engine) and mid-download (cancel event)."""
        if self._quitting:
            return
        self._quitting = True
        if self.engine is not None:
            self.engine.cancel()
        for event in list(self.cancel_events):
            event.set()
        running = [w for w in self.workers if w.is_running and w.group in ("reply", "download")]
        if running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.workers.wait_for_complete(running), timeout=10)
        self.exit(0)

    async def on_unmount(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.close()
        self.history.close()
