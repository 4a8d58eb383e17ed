"""The engine API that the CLI and the TUI program against (types only, no TVM).

A chat front end (through the facade, ``app.inference.services``) does::

    engine = services.load_engine("smollm2-135m-instruct", "auto", print_progress)
    engine.set_system_prompt("You are terse.")         # optional; None = no system prompt
    for event in engine.chat("Hello!", SamplingParams(temperature=0)):
        if isinstance(event, TextDelta):
            show(event.text)                            # whole characters only, never half a UTF-8 char
        elif isinstance(event, ContextTrimmed):
            warn(event)                                 # oldest turns were dropped to fit (before the wait)
        elif isinstance(event, PrefillProgress):
            show_progress(event.format())               # the prompt is being read: per prefill chunk
        elif isinstance(event, ReplyStats):
            show_stats(event.format())                  # always the last event
    engine.cancel()   # from any thread: the running chat() stops within one decode step
    engine.reset()    # forget the conversation and its KV cache

``chat`` runs in the caller's thread (a Textual worker thread in the TUI).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from app.errors import LlmchatError

Role = Literal["system", "user", "assistant"]
FinishReason = Literal["stop", "length", "cancelled", "context"]


@dataclass(frozen=True)
class Message:
    """One turn of a conversation."""

    role: Role
    content: str


@dataclass
class SamplingParams:
    """How to pick tokens; the names and ranges follow OpenAI's and MLC's APIs."""

    temperature: float = 0.7  # 0 = greedy; 0..2
    top_p: float = 0.95  # (0, 1]
    max_tokens: int = 512  # >= 1
    seed: int | None = None
    repetition_penalty: float = 1.0  # > 0; 1 = off (CTRL-style, divides positive logits)
    repeat_last_n: int = 64  # the penalties count the last N generated tokens (Ollama's); 0 = all of them
    presence_penalty: float = 0.0  # -2..2
    frequency_penalty: float = 0.0  # -2..2
    stop: list[str] = field(default_factory=list)  # extra stop strings


@dataclass(frozen=True)
class TextDelta:
    """New reply text, always whole characters."""

    text: str


@dataclass(frozen=True)
class ContextTrimmed:
    """The conversation no longer fitted the context window: the oldest turns were dropped."""

    dropped_messages: int
    context_window: int


@dataclass(frozen=True)
class PrefillProgress:
    """The prompt is being read (prefilled): ``done`` of ``total`` tokens after ``elapsed_s``.

    ``Engine.chat`` yields one before the prefill starts (``done`` 0) and one after each prefill
    chunk but the last (the first token follows it)."""

    done: int
    total: int
    elapsed_s: float

    @property
    def tok_s(self) -> float:
        return self.done / self.elapsed_s if self.done and self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None before the first chunk is done)."""
        rate = self.tok_s
        return (self.total - self.done) / rate if rate > 0 else None

    def format(self, since_s: float = 0.0) -> str:
        """``reading the prompt: 1,024 / 3,200 tokens · 52 tok/s · ~42 s left``; ``since_s``: time
        passed since this event (the estimate counts down)."""
        line = f"reading the prompt: {self.done:,} / {self.total:,} tokens"
        eta = self.eta_s
        if eta is None:
            return f"{line} · {self.elapsed_s + since_s:.1f} s"
        return f"{line} · {self.tok_s:,.0f} tok/s · ~{max(eta - since_s, 0.0):.0f} s left"


@dataclass
class ReplyStats:
    """Measurements of one reply; the last event of ``Engine.chat``."""

    prompt_tokens: int = 0  # tokens prefilled for this reply (new tokens only when the KV was reused)
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: FinishReason = "stop"

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first generated token comes out of prefill; the rest each cost one decode step
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0

    def format(self) -> str:
        """MLC's /stats line."""
        return f"prefill: {self.prefill_tok_s:.1f} tok/s, decode: {self.decode_tok_s:.1f} tok/s"


@dataclass
class SessionStats:
    """Totals over every reply since the engine was loaded (reset() keeps them)."""

    replies: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def add(self, reply: ReplyStats) -> None:
        self.replies += 1
        self.prompt_tokens += reply.prompt_tokens
        self.generated_tokens += reply.generated_tokens
        self.prefill_s += reply.prefill_s
        self.decode_s += reply.decode_s


@dataclass(frozen=True)
class EngineInfo:
    """What is loaded where."""

    model_id: str
    model_path: str
    backend: str  # "cpu", "cuda", "rocm", "vulkan", "metal", or "mlc-llm:<device>"
    device: str  # e.g. "cuda:0", "vulkan:0", "cpu:0"
    quantization: str
    context_window: int  # tokens the KV cache was created for
    weight_bytes: int


@dataclass(frozen=True)
class ProgressEvent:
    """Progress of anything slow (download, import, compile, load)."""

    stage: Literal["download", "import", "compile", "load"]
    message: str  # e.g. "compiling for vulkan:0"
    done: float | None = None  # units done (bytes, steps); None when unknown
    total: float | None = None

    @property
    def fraction(self) -> float | None:
        if self.done is None or not self.total:
            return None
        return min(1.0, self.done / self.total)


ProgressCallback = Callable[[ProgressEvent], None]


class ContextLengthExceeded(LlmchatError):
    """A prompt that does not fit the context window (the server's 400 ``context_length_exceeded``)."""

    def __init__(self, prompt_tokens: int, context_window: int, fix: str) -> None:
        super().__init__(
            f"The prompt is {prompt_tokens} tokens long; the context window holds {context_window}.", fix
        )
        self.prompt_tokens = prompt_tokens
        self.context_window = context_window


class DownloadCancelled(LlmchatError):
    """The user cancelled; the partial download is kept for a resume."""


@dataclass
class ModelSampling:
    """The defaults of one model and, per field set, where the value came from."""

    params: SamplingParams = field(default_factory=SamplingParams)
    sources: dict[str, str] = field(default_factory=dict)  # field -> "catalog", "generation_config.json", …

    def describe(self, name: str) -> str:
        return self.sources.get(name, "llmchat default")


#: how the chat names a saved server in place of a model id
SERVER_PREFIX = "server:"
KeyPlace = Literal["none", "keyring", "file"]


@dataclass(frozen=True)
class SavedServer:
    """One saved endpoint; ``key`` says where its API key is kept (never the key itself)."""

    name: str
    endpoint: str
    model: str
    key: KeyPlace = "none"

    @property
    def ref(self) -> str:
        """``server:NAME``: what the chat and its history call this server."""
        return SERVER_PREFIX + self.name


ChatEvent = TextDelta | ContextTrimmed | PrefillProgress | ReplyStats


class Engine(Protocol):
    """A loaded model with one conversation."""

    info: EngineInfo
    last_stats: ReplyStats | None
    session_stats: SessionStats

    @property
    def history(self) -> list[Message]: ...

    def set_system_prompt(self, text: str | None) -> None:
        """Set (or clear) the system prompt; the conversation is kept, its KV state rebuilt."""

    def load_history(self, messages: list[Message]) -> None:
        """Replace the conversation (e.g. a resumed chat); prefilled lazily on the next chat()."""

    def chat(self, user_message: str, params: SamplingParams | None = None) -> Iterator[ChatEvent]:
        """Add a user turn and stream the assistant's reply; the reply joins the history."""

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        ignore_eos: bool = False,
        detokenize: bool = True,
    ) -> Iterator[ChatEvent]:
        """Raw completion of token ids (bench); does not touch the conversation.

        ``ignore_eos`` decodes exactly ``max_tokens`` tokens; ``detokenize=False`` yields no text.
        """

    def cancel(self) -> None:
        """Stop the running chat()/generate() within one decode step (thread-safe)."""

    # optional (the TVM engine has them; the UI checks with getattr):
    # count_tokens(text) -> int: tokens of one message's text
    # context_tokens() -> int: tokens of the conversation so far (system prompt and history)

    def reset(self) -> None:
        """Forget the conversation (keeps the system prompt) and clear the KV cache."""

    def memory_in_use_bytes(self) -> int | None:
        """Device memory held by this engine (weights + KV cache + workspace), if known."""

    def close(self) -> None:
        """Free device memory."""
