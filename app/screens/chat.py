"""The chat screen: streams replies from a worker thread, runs slash commands, shows live stats."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Static

from app import chat_commands
from app.errors import LlmchatError
from app.inference.api import ContextTrimmed, PrefillProgress, ReplyStats, SamplingParams, TextDelta
from app.units import format_bytes, plural
from app.widgets.chat_log import AssistantMessage, ChatLog, StatsLine, error_markdown
from app.widgets.prompt_input import PromptInput

if TYPE_CHECKING:
    from app.chat_app import LlmchatApp
    from app.inference.api import Engine

#: the UI pulls streamed text from the worker at most every UI_REFRESH_S seconds (20 updates/s) ...
UI_REFRESH_S = 0.05
#: ... and at most every UI_REFRESH_MAX_S seconds, backing off so that drawing the stream uses at most
#: UI_CPU_SHARE of one core: on a CPU backend every cycle the UI takes is a cycle the decoder loses
UI_REFRESH_MAX_S = 0.5
UI_CPU_SHARE = 0.04
#: the context meter warns from this share of the window on
CONTEXT_WARN = 0.8
#: the meter counts the typed text this long after the last key
METER_DELAY_S = 0.2

KEYS_HELP: list[tuple[str, str]] = [
    ("enter", "send"),
    ("shift+enter / ctrl+j / alt+enter", "new line"),
    ("up / down", "previous / next prompt (on the first / last line)"),
    ("esc", "stop the reply, keeping what was generated"),
    ("ctrl+p", "command palette (all the commands above)"),
    ("f2", "models"),
    ("f3", "hardware"),
    ("ctrl+s", "export the conversation to Markdown"),
    ("ctrl+c", "stop the reply; at an idle prompt, or pressed again while it stops: quit"),
    ("ctrl+q", "quit"),
]


@dataclass
class ReplyBuffer:
    """Text streamed by the worker thread, pulled by the UI timer; the worker never touches widgets."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    deltas: int = 0
    text: str = ""
    stats: ReplyStats | None = None
    trimmed: ContextTrimmed | None = None
    trimmed_shown: bool = False
    prefill: PrefillProgress | None = None  # the prompt being read (the latest chunk's progress)
    prefill_at: float = 0.0  # when it arrived
    error: BaseException | None = None
    _pending: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, text: str) -> None:
        now = time.perf_counter()
        with self._lock:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.deltas += 1
            self._pending.append(text)

    def set_prefill(self, progress: PrefillProgress) -> None:
        self.prefill, self.prefill_at = progress, time.perf_counter()

    def take(self) -> str:
        with self._lock:
            text = "".join(self._pending)
            self._pending.clear()
        self.text += text
        return text

    def live_line(self) -> str:
        """Stats while streaming: tokens so far, tok/s, time to first token.

        Counted in text deltas, which are tokens except where the engine holds a token back (half a
        UTF-8 character, a possible stop string): hence "~". The exact numbers replace it at the end.
        """
        if self.first_token_at is None:
            if self.prefill is not None:  # tokens read of the prompt, tok/s, time left
                return self.prefill.format(since_s=time.perf_counter() - self.prefill_at)
            return f"waiting for the first token… {time.perf_counter() - self.started:.1f} s"
        ttft = self.first_token_at - self.started
        span = (self.last_token_at or self.first_token_at) - self.first_token_at
        rate = (self.deltas - 1) / span if span > 0 else 0.0
        return f"▍ ~{plural(self.deltas, 'token')} · ~{rate:.1f} tok/s · TTFT {ttft:.2f} s"


def final_stats_line(stats: ReplyStats, prompt_total: int | None = None, text: str | None = None) -> str:
    """The stats line kept under a finished reply (``prompt_total``: the prompt's tokens, when a
    prefill was stopped; ``text``: the reply's text, to tell an empty reply)."""
    if stats.generated_tokens == 0:
        read = (
            f"{stats.prompt_tokens:,} of {plural(prompt_total, 'token')}"
            if prompt_total
            else plural(stats.prompt_tokens, "token")
        )
        return f"stopped while reading the prompt ({read} read)"
    n = stats.generated_tokens
    ttft = f"TTFT {stats.time_to_first_token_s:.2f} s"
    if n == 1:  # no decode step: a decode speed would say 0.0
        first = "no text: the model ended its reply at once" if not text else "1 token"
        line = f"{first} · prefill: {stats.prefill_tok_s:.1f} tok/s · {ttft}"
    else:
        line = f"{n} tokens · {stats.format()} · {ttft}"
    notes = {"cancelled": "stopped", "length": "max_tokens reached", "context": "context window full"}
    if stats.finish_reason in notes:
        line += f" · {notes[stats.finish_reason]}"
    return line


def _show_value(key: str, value: object) -> str:
    if key == "seed" and value is None:
        return "random"
    if key == "stop":
        return ", ".join(repr(v) for v in value) if value else "none"  # type: ignore[union-attr]
    return f"{value:g}" if isinstance(value, float) else str(value)


class ChatScreen(Screen):
    """One conversation with the loaded engine."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop reply"),
        Binding("f2", "app.open_models", "Models"),
        Binding("f3", "app.open_hardware", "Hardware"),
        Binding("ctrl+s", "export", "Export"),
        Binding("ctrl+l", "reset", "Reset", show=False),
    ]

    class ReplyDone(Message):
        """The worker finished (normally, stopped or failed)."""

        def __init__(self, buffer: ReplyBuffer) -> None:
            super().__init__()
            self.buffer = buffer

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self._buffer: ReplyBuffer | None = None
        self._reply: tuple[AssistantMessage, StatsLine] | None = None
        self._timer: Timer | None = None
        self._user_row: int | None = None  # history row of the user turn being answered
        self._idle = asyncio.Event()  # set while no reply is streaming
        self._idle.set()
        self._stopping = False  # the running reply was asked to stop
        self._context_used: int | None = None  # tokens of the conversation so far
        self._meter_timer: Timer | None = None

    @property
    def llm_app(self) -> LlmchatApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        info = self.engine.info
        yield Static(f"{info.model_id} · {info.device} ({info.backend})", id="chat-title")
        yield Static("", id="system-line", markup=False)
        yield ChatLog(id="chat-log")
        yield PromptInput(
            id="prompt",
            placeholder="Message (Enter sends, Shift+Enter or Ctrl+J new line, /help for commands)",
            sent=self.llm_app.prompt_history,
        )
        yield Static("", id="context-meter", markup=False)
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one(PromptInput).focus()
        self.show_system_prompt()
        self.refresh_context()
        resumed = self.llm_app.resumed_messages
        if resumed:
            log = self.query_one(ChatLog)
            for message in resumed:
                if message.role == "user":
                    await log.add_user(message.content, self.count_tokens(message.content))
                elif message.role == "assistant":
                    await log.add_saved_reply(message.content)
            n = len(resumed)
            note = f"*Resumed conversation ({n} {'message' if n == 1 else 'messages'}).*"
            if self.llm_app.system_prompt:
                note += f"\n\n*With its system prompt:* {self.llm_app.system_prompt}"
            await log.add_notice(note)

    # -- system prompt and context meter ---------------------------------------------------------
    def show_system_prompt(self) -> None:
        """The line under the title: the system prompt in force (hidden when there is none)."""
        text = self.llm_app.system_prompt
        line = self.query_one("#system-line", Static)
        line.display = bool(text)
        if text:
            line.update("system: " + " ".join(text.split()))

    def refresh_context(self) -> None:
        """Recount the conversation's tokens (after a reply, /reset, /system) and redraw the meter."""
        count = getattr(self.engine, "context_tokens", None)
        try:
            if count is not None and not self.replying:
                self._context_used = int(count())
        except Exception:
            self._context_used = None
        self.update_context_meter()

    def count_tokens(self, text: str) -> int | None:
        count = getattr(self.engine, "count_tokens", None)
        try:
            return int(count(text)) if count is not None else None
        except Exception:
            return None

    def update_context_meter(self) -> None:
        """The line under the prompt: tokens used of the context window, with what is typed; a warning
        from CONTEXT_WARN of the window on."""
        window = self.engine.info.context_window
        meter = self.query_one("#context-meter", Static)
        used = self._context_used
        if used is None:
            meter.update(f"context window {window:,} tokens")
            return
        typed_text = self.query_one(PromptInput).text.strip()
        typed = (self.count_tokens(typed_text) or 0) if typed_text else 0
        total = used + typed
        text = f"context {used:,}" + (f" + {typed:,} typed" if typed else "") + f" / {window:,} tokens"
        text += f" ({total / window:.0%})"
        full = total / window >= CONTEXT_WARN
        if total >= window:
            text += " — does not fit: the oldest messages will be dropped; /reset starts over"
        elif full:
            text += " — nearly full: the oldest messages will be dropped soon; /reset starts over"
        meter.set_class(full, "warning")
        meter.update(text)

    @on(PromptInput.Changed, "#prompt")
    def on_prompt_changed(self) -> None:
        # counted a moment after the typing pauses, not on every key
        if self._meter_timer is not None:
            self._meter_timer.stop()
        self._meter_timer = self.set_timer(METER_DELAY_S, self.update_context_meter)

    @on(PromptInput.Pasted)
    def on_pasted(self, event: PromptInput.Pasted) -> None:
        lines = event.text.count("\n") + 1
        tokens = self.count_tokens(event.text)
        counted = f", {plural(tokens, 'token')}" if tokens is not None else ""
        self.notify(f"Pasted {plural(lines, 'line')}{counted}.", timeout=4)
        self.update_context_meter()

    # -- state ---------------------------------------------------------------------------------
    @property
    def replying(self) -> bool:
        return not self._idle.is_set()

    async def wait_reply_stopped(self) -> None:
        """Stop a running reply and wait until it is finished and saved."""
        if self.replying:
            self.engine.cancel()
            await self._idle.wait()

    # -- input ---------------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    def on_prompt_submitted(self, event: PromptInput.Submitted) -> None:
        # a task of its own, so that a command may wait for the reply to finish (ReplyDone)
        self.run_worker(self.handle_input(event.text), group="input")

    async def handle_input(self, text: str) -> None:
        """A line from the prompt: a slash command or a message for the model."""
        log = self.query_one(ChatLog)
        try:
            command = chat_commands.parse(text)
        except LlmchatError as err:
            await log.add_error(err)
            return
        if command is not None:
            await self.run_command(command)
            return
        await self.send(chat_commands.message_text(text))

    async def send(self, text: str) -> None:
        """Show the prompt, save it and stream the reply from a worker thread."""
        log = self.query_one(ChatLog)
        if self.replying:
            self.notify("A reply is streaming: wait for it or press Esc to stop it.", severity="warning")
            return
        self._idle.clear()
        log.anchor()
        await log.add_user(text, self.count_tokens(text))
        self._user_row = self.llm_app.save_message("user", text)
        reply, stats = await log.add_reply()
        stats.add_class("live")
        buffer = ReplyBuffer()
        self._buffer = buffer
        self._reply = (reply, stats)
        stats.update(buffer.live_line())
        self._ui_cpu_mark = time.thread_time()
        self._timer = self.set_timer(UI_REFRESH_S, self._pull_stream)
        self._stream_reply(text, self.llm_app.params, buffer)

    @work(thread=True, exclusive=True, group="reply", exit_on_error=False)
    def _stream_reply(self, text: str, params: SamplingParams, buffer: ReplyBuffer) -> None:
        """Decode in this worker thread; only the buffer is touched here (no widgets)."""
        try:
            for event in self.engine.chat(text, params):
                if isinstance(event, TextDelta):
                    buffer.add(event.text)
                elif isinstance(event, PrefillProgress):
                    buffer.set_prefill(event)
                elif isinstance(event, ReplyStats):
                    buffer.stats = event
                elif isinstance(event, ContextTrimmed):
                    buffer.trimmed = event
        except BaseException as err:  # shown in the chat, never as a traceback
            buffer.error = err
        finally:
            self.post_message(self.ReplyDone(buffer))

    async def _pull_stream(self) -> None:
        """Timer: move streamed text into the Markdown widget and refresh the live stats line.

        The next pull comes after the UI thread's CPU time since the last one (this pull and the
        drawing it caused) divided by UI_CPU_SHARE, within [UI_REFRESH_S, UI_REFRESH_MAX_S].
        """
        buffer, reply = self._buffer, self._reply
        if buffer is None or reply is None:
            return
        if buffer.trimmed is not None and not buffer.trimmed_shown:  # before the prompt's wait
            await self._show_trimmed(buffer, reply[0])
        text = buffer.take()
        if text:
            await reply[0].append(text)
        if self._buffer is not buffer:  # the reply finished meanwhile
            return
        reply[1].update(buffer.live_line())
        now = time.thread_time()
        spent, self._ui_cpu_mark = now - self._ui_cpu_mark, now
        delay = min(max(spent / UI_CPU_SHARE, UI_REFRESH_S), UI_REFRESH_MAX_S)
        self._timer = self.set_timer(delay, self._pull_stream)

    @on(ReplyDone)
    async def on_reply_done(self, event: ReplyDone) -> None:
        buffer = event.buffer
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        assert self._reply is not None
        reply, stats_line = self._reply
        rest = buffer.take()
        if rest:
            await reply.append(rest)
        stats_line.remove_class("live")
        log = self.query_one(ChatLog)
        if buffer.stats is not None:
            total = buffer.prefill.total if buffer.prefill is not None else None
            stats_line.update(final_stats_line(buffer.stats, total, buffer.text))
        else:
            stats_line.update("no reply" if not buffer.text else "stopped")
        if buffer.text:
            stats_dict = asdict(buffer.stats) if buffer.stats else None
            self.llm_app.save_message("assistant", buffer.text, stats_dict)
        elif buffer.error is not None:
            await reply.remove()
            # no reply: the user turn is not left in the history as an orphan
            self.llm_app.forget_message(self._user_row)
        if buffer.trimmed is not None and not buffer.trimmed_shown:
            await self._show_trimmed(buffer, reply if reply.is_attached else None)
        if buffer.error is not None:
            await log.add_error(buffer.error)
        self._buffer = None
        self._reply = None
        self._stopping = False
        self._idle.set()
        self.refresh_context()

    async def _show_trimmed(self, buffer: ReplyBuffer, reply: AssistantMessage | None) -> None:
        """The notice that the oldest messages were dropped, above the reply (shown as soon as the
        engine says so: before the prompt is read, not after the reply)."""
        trimmed = buffer.trimmed
        assert trimmed is not None
        buffer.trimmed_shown = True
        n = trimmed.dropped_messages
        await self.query_one(ChatLog).add_notice(
            f"*The conversation no longer fitted the {trimmed.context_window:,}-token context: "
            f"the oldest {n} {'message was' if n == 1 else 'messages were'} dropped.*",
            before=reply,
        )

    # -- actions -------------------------------------------------------------------------------
    def action_stop(self) -> None:
        """Esc: stop the reply now, keeping what was generated."""
        if self.replying:
            self.engine.cancel()
            self._stopping = True

    def interrupt(self) -> bool:
        """Ctrl+C (from the app): stop the reply (or its prefill); False when there is none to stop or
        it is already stopping (then the app quits)."""
        if not self.replying or self._stopping:
            return False
        self.engine.cancel()
        self._stopping = True
        self.notify("Stopping the reply. Ctrl+C again quits.", timeout=3)
        return True

    async def action_export(self) -> None:
        await self.run_command(chat_commands.Command("export"))

    async def action_reset(self) -> None:
        await self.run_command(chat_commands.Command("reset"))

    # -- commands ------------------------------------------------------------------------------
    async def run_command_text(self, text: str) -> None:
        """Run a typed line (e.g. "/stats") as if it was entered in the prompt."""
        await self.handle_input(text)

    async def run_command(self, command: chat_commands.Command) -> None:
        """Run a slash command; errors are shown in the chat with their fix."""
        log = self.query_one(ChatLog)
        handler = getattr(self, f"_command_{command.name}")
        try:
            await handler(command.arg)
        except LlmchatError as err:
            await log.add_error(err)
        except Exception as err:  # an unexpected bug still shows as a message
            await log.add_notice(error_markdown(err), error=True)

    async def _command_help(self, arg: str) -> None:
        await self.query_one(ChatLog).add_notice(chat_commands.help_text(KEYS_HELP))

    async def _command_stats(self, arg: str) -> None:
        await self.query_one(ChatLog).add_notice(self.stats_markdown())

    def stats_markdown(self) -> str:
        """The /stats text: last reply, session totals, device, backend, memory."""
        engine = self.engine
        info = engine.info
        last = engine.last_stats
        session = engine.session_stats
        lines = ["**Stats**", ""]
        if last is not None:
            lines.append(f"- last reply: {last.format()}")
            lines.append(
                f"- last reply tokens: {last.prompt_tokens} prompt, {last.generated_tokens} generated, "
                f"TTFT {last.time_to_first_token_s:.2f} s, finish: {last.finish_reason}"
            )
            server_line = getattr(last, "server_line", None)
            server = server_line() if callable(server_line) else None
            if server:  # a remote engine: the figures above are measured here, these by the server
                lines.append(f"- {server}")
        else:
            lines.append("- last reply: none yet")
        decode_steps = max(session.generated_tokens - session.replies, 0)
        session_decode = decode_steps / session.decode_s if session.decode_s > 0 else 0.0
        session_prefill = session.prompt_tokens / session.prefill_s if session.prefill_s > 0 else 0.0
        lines.append(
            f"- session: {plural(session.replies, 'reply')}, "
            f"{session.prompt_tokens} prompt tokens, "
            f"{session.generated_tokens} generated tokens "
            f"(prefill: {session_prefill:.1f} tok/s, decode: {session_decode:.1f} tok/s)"
        )
        context = f"context {info.context_window} tokens" if info.context_window else "context unknown"
        if info.backend == "remote":
            lines.append(f"- model: {info.model_id} on the server {info.model_path} ({context})")
            lines.append("- speeds measured here: time to first token and decode tok/s over the stream")
            return "\n".join(lines)
        lines.append(f"- model: {info.model_id} ({info.quantization}, {context})")
        lines.append(f"- device: {info.device}, backend: {info.backend}")
        lines.append(f"- memory in use: {format_bytes(engine.memory_in_use_bytes())}")
        return "\n".join(lines)

    async def _command_reset(self, arg: str) -> None:
        await self.wait_reply_stopped()
        self.engine.reset()
        self.llm_app.new_conversation()
        log = self.query_one(ChatLog)
        await log.clear()
        kept = []
        if self.llm_app.system_prompt:
            kept.append(f"the system prompt ({self.llm_app.system_prompt}; `/system clear` clears it)")
        if self.llm_app.sampling_overrides:
            overrides = self.llm_app.sampling_overrides
            changed = ", ".join(f"{k}={_show_value(k, v)}" for k, v in overrides.items())
            kept.append(f"your sampling settings ({changed}; `/set reset` drops them)")
        note = "*Conversation cleared (KV cache reset). New conversation started.*"
        if kept:
            note += "\n\nKept: " + "; ".join(kept) + "."
        await log.add_notice(note)
        self.refresh_context()

    async def _command_set(self, arg: str) -> None:
        log = self.query_one(ChatLog)
        app = self.llm_app
        if arg.strip().lower() == "reset":
            app.set_sampling(reset=True)
            back = "*Sampling settings back to this model's defaults.*\n\n"
            await log.add_notice(back + self.sampling_markdown())
            app.save_sampling()
        elif arg.strip():
            overrides = app.services.sampling.parse_set(arg)
            app.set_sampling(overrides)
            changed = ", ".join(f"{key}={_show_value(key, value)}" for key, value in overrides.items())
            try:
                app.save_sampling()
            except LlmchatError:
                await log.add_notice(f"*Set {changed}* (for this session only).")
                raise
            await log.add_notice(
                f"*Set {changed}* (kept for {self.engine.info.model_id}; "
                "`/set reset` goes back to its defaults)."
            )
        else:
            await log.add_notice(self.sampling_markdown())

    def sampling_markdown(self) -> str:
        """The /set text: every setting, with where its value comes from."""
        app = self.llm_app
        lines = ["**Sampling**", ""]
        for key, value in asdict(app.params).items():
            source = "/set" if key in app.sampling_overrides else app.model_sampling.describe(key)
            lines.append(f"- {key} = {_show_value(key, value)} ({source})")
        lines += ["", "`/set key=value` changes one, `/set reset` goes back to the model's defaults."]
        return "\n".join(lines)

    async def _command_system(self, arg: str) -> None:
        log = self.query_one(ChatLog)
        if not arg.strip():
            current = self.llm_app.system_prompt
            await log.add_notice(
                f"**System prompt**\n\n{current}\n\n`/system TEXT` replaces it, `/system clear` clears it."
                if current
                else "*No system prompt is set (the model's chat template applies its own default, if any).* "
                "`/system TEXT` sets one."
            )
            return
        await self.wait_reply_stopped()
        text = None if arg.strip().lower() == "clear" else arg.strip()
        self.engine.set_system_prompt(text)
        self.llm_app.system_prompt = text
        self.llm_app.save_system_prompt(text)
        note = f"*System prompt set:* {text}" if text else "*System prompt cleared.*"
        await log.add_notice(note)
        self.show_system_prompt()
        self.refresh_context()

    async def _command_model(self, arg: str) -> None:
        model_id = arg.strip()
        if not model_id:
            self.llm_app.action_open_models()
            return
        question = self.download_question(model_id)
        if question is not None:
            from app.screens.confirm import ConfirmScreen

            if not await self.app.push_screen_wait(ConfirmScreen(question, yes="Download")):
                await self.query_one(ChatLog).add_notice(f"*Not downloading {model_id}.*")
                return
        await self.wait_reply_stopped()
        self.llm_app.start_model(model_id)

    def download_question(self, model_id: str) -> str | None:
        """What to ask before ``/model ID`` downloads a model that is not installed (its size);
        None when nothing would be downloaded (installed, a server's model, or unknown: the loading
        screen then says what is wrong)."""
        services = self.llm_app.services
        if services.remote_endpoint is not None or services.installed_model_path(model_id) is not None:
            return None
        try:
            entries = {entry.id: entry for entry in services.load_catalog().entries}
        except Exception:
            entries = {}
        entry = entries.get(model_id)
        if entry is not None:
            size = format_bytes(entry.download_bytes)
        elif model_id.upper().startswith("HF://"):
            size = "a size known once the repository is listed"
        else:
            return None
        return (
            f"{model_id} is not installed. Download it ({size}), compile it for this machine and "
            f"switch to it?"
        )

    async def _command_models(self, arg: str) -> None:
        self.llm_app.action_open_models()

    async def _command_hardware(self, arg: str) -> None:
        self.llm_app.action_open_hardware()

    async def _command_history(self, arg: str) -> None:
        self.llm_app.action_open_history()

    async def _command_export(self, arg: str) -> None:
        conversation_id = self.llm_app.conversation_id
        if conversation_id is None:
            raise LlmchatError("There is nothing to export yet.", "send a message first")
        target = Path(arg.strip()).expanduser() if arg.strip() else Path.cwd()
        path = Path(self.llm_app.history.export_markdown(conversation_id, target)).resolve()
        where = (
            "" if arg.strip() else f" — the current directory ({path.parent}); `/export PATH` picks another"
        )
        await self.query_one(ChatLog).add_notice(f"*Exported to `{path}`*{where}.")
        self.notify(f"Exported to {path}", markup=False)

    async def _command_exit(self, arg: str) -> None:
        await self.app.action_quit()
