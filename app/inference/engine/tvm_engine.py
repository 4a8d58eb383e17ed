"""The TVM engine: ``load_engine(model, device)`` and the ``Engine`` the CLI and the TUI drive.

A conversation lives in one KV-cache sequence.  Each ``chat()`` renders the whole conversation
with the model's chat template, keeps the longest prefix of tokens already in the KV cache, rolls
the rest back (``popn``) and prefills only the new tokens.  When the conversation no longer fits
the context window the oldest turns are dropped (the system prompt stays) and the caller gets a
``ContextTrimmed`` event.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from app import paths
from app.errors import LlmchatError
from app.inference.api import (
    ChatEvent,
    ContextLengthExceeded,
    ContextTrimmed,
    EngineInfo,
    Message,
    ProgressCallback,
    ProgressEvent,
    ReplyStats,
    SamplingParams,
    SessionStats,
)
from app.inference.engine.conversation import ConversationState, with_system
from app.inference.engine.generation import GenerationResult, generate
from app.inference.engine.runtime import ModelRuntime
from app.inference.store.config import ModelConfig

#: default KV-cache size when the caller does not ask for one (the model's window, capped)
DEFAULT_CONTEXT_CAP = 8192


def resolve_model_dir(model: str | Path) -> tuple[str, Path]:
    """(model id, directory) for a model directory path or an installed model id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.name, path
    installed = paths.models_dir() / str(model)
    if installed.is_dir():
        return str(model), installed
    if path.exists() or "/" in str(model) or str(model).startswith("."):
        raise LlmchatError(
            f"{model} is not a model directory.", "pass a directory containing mlc-chat-config.json"
        )
    raise LlmchatError(f"Model {model!r} is not installed.", f"llmchat download {model}")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def _too_long_fix(tokens: int, ctx: int, model_max: int) -> str:
    """What a user can do about a prompt that does not fit the context window."""
    fix = f"shorten the message (by {tokens - ctx + 1} tokens or more) or the system prompt (/system clear)"
    if model_max > ctx:
        larger = min(model_max, 1 << (tokens - 1).bit_length())
        fix += (
            f"; or start llmchat again with a larger window: `--context-window {larger}` "
            f"(the model takes up to {model_max:,} tokens; `llmchat ask` has the same option)"
        )
    return fix


class TVMEngine(ConversationState):
    """A compiled model, its weights and one conversation (implements ``app.inference.api.Engine``)."""

    def __init__(
        self,
        info: EngineInfo,
        config: ModelConfig,
        runtime: ModelRuntime,
        tokenizer: object,
        formatter: object,
    ) -> None:
        self.info = info
        self.config = config
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.formatter = formatter
        self.last_stats: ReplyStats | None = None
        self.session_stats = SessionStats()
        self._system: str | None = None
        self._history: list[Message] = []
        self._kv_ids: list[int] = []
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        stop_ids = set(getattr(tokenizer, "eos_ids", set()) or set())
        stop_ids.update(getattr(formatter, "stop_token_ids", []) or [])
        self.stop_token_ids = frozenset(stop_ids)
        self.stop_strings = list(getattr(formatter, "stop_strings", []) or [])

    # -- conversation state -------------------------------------------------------------------
    def set_system_prompt(self, text: str | None) -> None:
        """Set or clear the system prompt; the conversation stays, its KV state is rebuilt."""
        super().set_system_prompt(text)
        self._clear_kv()

    def reset(self) -> None:
        self._history = []
        self._clear_kv()

    def _clear_kv(self) -> None:
        self._kv_ids = []
        if self.runtime is not None:
            self.runtime.clear()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def kv_sequence_length(self) -> int:
        """Tokens of the conversation held in the KV cache."""
        return self.runtime.sequence_length

    # -- token counts (the UI's context meter) ------------------------------------------------
    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as a message would add them (the text alone, without the template)."""
        if self.tokenizer is None or not text:
            return 0
        return len(self.tokenizer.encode(text, add_bos=False))

    def context_tokens(self) -> int:
        """Tokens of the conversation so far (system prompt and history, rendered with the template):
        what the next message comes on top of, in a window of ``info.context_window`` tokens."""
        if self.tokenizer is None or self.formatter is None:
            return 0
        messages = self._messages(self._history)
        if not messages:
            return 0
        return len(self.formatter.encode_prompt(self.tokenizer, messages, add_generation_prompt=False))

    # -- prompt building ----------------------------------------------------------------------
    def _messages(self, history: list[Message]) -> list[Message]:
        return with_system(self._system, history)

    def _encode(self, messages: list[Message]) -> list[int]:
        return self.formatter.encode_prompt(self.tokenizer, messages, add_generation_prompt=True)

    def _fit(self, history: list[Message], reserve: int) -> tuple[list[int], list[Message], int]:
        """Prompt ids for ``history``, dropping the oldest turns until it leaves ``reserve`` tokens."""
        ctx = self.runtime.context_window
        dropped = 0
        ids = self._encode(self._messages(history))
        while len(ids) + reserve > ctx and len(history) > 1:
            # drop the oldest turn: a user message and the assistant reply after it
            cut = 2 if len(history) > 2 and history[1].role == "assistant" else 1
            history = history[cut:]
            dropped += cut
            ids = self._encode(self._messages(history))
        if len(ids) >= ctx:
            raise ContextLengthExceeded(
                len(ids),
                ctx,
                _too_long_fix(len(ids), ctx, self.config.context_window_size),
            )
        return ids, history, dropped

    def _prepare_kv(self, ids: list[int]) -> list[int]:
        """Keep the cached prefix of ``ids``, roll the rest back; the ids still to prefill."""
        keep = _common_prefix(self._kv_ids, ids)
        if keep == len(ids):
            keep -= 1  # prefill at least one token to get logits
        if keep < len(self._kv_ids):
            self.runtime.popn(len(self._kv_ids) - keep)
            del self._kv_ids[keep:]
        return ids[keep:]

    # -- generation ---------------------------------------------------------------------------
    def chat(self, user_message: str, params: SamplingParams | None = None) -> Iterator[ChatEvent]:
        params = params or SamplingParams()
        if self.tokenizer is None or self.formatter is None:
            raise LlmchatError(
                "This engine has no tokenizer or chat template (random weights).",
                "use generate() with token ids, or load a real model",
            )
        if not self._lock.acquire(blocking=False):
            raise LlmchatError("The engine is already generating a reply.", "wait for it, or cancel it first")
        try:
            self._cancel.clear()
            history = [*self._history, Message("user", user_message)]
            reserve = max(1, min(int(params.max_tokens), self.runtime.context_window // 4))
            ids, history, dropped = self._fit(history, reserve)
            if dropped:
                self._history = history[:-1]
                yield ContextTrimmed(dropped, self.runtime.context_window)
            new_ids = self._prepare_kv(ids)
            result = GenerationResult()
            try:
                yield from generate(
                    self.runtime,
                    new_ids,
                    params,
                    kv_ids=self._kv_ids,
                    cancel=self._cancel,
                    tokenizer=self.tokenizer,
                    stop_token_ids=self.stop_token_ids,
                    stop_strings=self.stop_strings,
                    result=result,
                )
            except Exception:
                self._clear_kv()  # the KV state may be partly written: rebuild it next time
                raise
            finally:
                # the turn joins the history even when the consumer stopped early or it was cancelled
                self._history = [*history, Message("assistant", result.text)]
                if result.stats.generated_tokens:
                    self.last_stats = result.stats
                    self.session_stats.add(result.stats)
        finally:
            self._lock.release()

    def count_prompt_tokens(self, messages: list[Message]) -> int:
        """Tokens of ``messages`` rendered with the chat template (with the assistant's cue)."""
        if self.tokenizer is None or self.formatter is None:
            raise LlmchatError(
                "This engine has no tokenizer or chat template (random weights).", "load a real model"
            )
        return len(self._encode(list(messages)))

    def complete(
        self, messages: list[Message], params: SamplingParams, *, cancel: threading.Event | None = None
    ) -> Iterator[ChatEvent]:
        """One reply to a whole conversation given by the caller (``llmchat serve``).

        Nothing is dropped to make it fit: a prompt beyond the context window raises
        ``ContextLengthExceeded``. The engine's own conversation (``history``) is not touched; the
        KV cache keeps the longest prefix it shares with the previous prompt, so a client that
        resends its growing conversation only prefills the new turns. ``cancel`` (default: the
        one ``cancel()`` sets) stops it within one decode step."""
        if self.tokenizer is None or self.formatter is None:
            raise LlmchatError(
                "This engine has no tokenizer or chat template (random weights).", "load a real model"
            )
        if not self._lock.acquire(blocking=False):
            raise LlmchatError("The engine is already generating a reply.", "wait for it, or cancel it first")
        try:
            if cancel is None:
                self._cancel.clear()
                cancel = self._cancel
            ids = self._encode(list(messages))
            ctx = self.runtime.context_window
            if len(ids) >= ctx:
                raise ContextLengthExceeded(len(ids), ctx, "shorten the conversation")
            new_ids = self._prepare_kv(ids)
            result = GenerationResult()
            try:
                yield from generate(
                    self.runtime,
                    new_ids,
                    params,
                    kv_ids=self._kv_ids,
                    cancel=cancel,
                    tokenizer=self.tokenizer,
                    stop_token_ids=self.stop_token_ids,
                    stop_strings=self.stop_strings,
                    result=result,
                )
            except Exception:
                self._clear_kv()  # the KV state may be partly written: rebuild it next time
                raise
            finally:
                if result.stats.generated_tokens:
                    self.last_stats = result.stats
                    self.session_stats.add(result.stats)
        finally:
            self._lock.release()

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        ignore_eos: bool = False,
        detokenize: bool = True,
    ) -> Iterator[ChatEvent]:
        """Raw completion of ``prompt_ids`` from an empty KV cache; the conversation is kept (its KV
        state is rebuilt on the next ``chat``). ``ignore_eos``: run to ``max_tokens`` (benchmarks)."""
        if not prompt_ids:
            raise LlmchatError("generate() needs at least one prompt token.", "pass a non-empty prompt")
        if len(prompt_ids) >= self.runtime.context_window:
            raise LlmchatError(
                f"The prompt is {len(prompt_ids)} tokens long; the context window holds "
                f"{self.runtime.context_window}.",
                "use a shorter prompt",
            )
        if not self._lock.acquire(blocking=False):
            raise LlmchatError("The engine is already generating a reply.", "wait for it, or cancel it first")
        try:
            self._cancel.clear()
            self._clear_kv()
            result = GenerationResult()
            yield from generate(
                self.runtime,
                list(prompt_ids),
                params,
                kv_ids=self._kv_ids,
                cancel=self._cancel,
                tokenizer=self.tokenizer if detokenize else None,
                stop_token_ids=() if ignore_eos else self.stop_token_ids,
                stop_strings=() if ignore_eos else self.stop_strings,
                result=result,
            )
            self.last_stats = result.stats
            self.session_stats.add(result.stats)
        finally:
            self._clear_kv()  # the conversation is re-prefilled on its next chat()
            self._lock.release()

    # -- resources ----------------------------------------------------------------------------
    def memory_in_use_bytes(self) -> int | None:
        return self.runtime.memory_in_use_bytes() if self.runtime is not None else None

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None


def fit_context_window(
    ctx: int, device: object, weight_bytes: int, kv_bytes_per_token: int, memory_budget: int | None = None
) -> int:
    """Shrink a default context window so that weights + KV cache fit the GPU's memory.

    Uses 85 % of the device's memory (MLC's gpu_memory_utilization) less a 512 MiB workspace —
    or ``memory_budget`` where the probe computed one (Vulkan, which does not report the device's
    memory: on a Steam Deck or an APU the unified-memory budget, carve-out + GTT bounded by free
    RAM); CPUs are left alone.  Never below 512 tokens (a load that cannot fit then fails loudly)."""
    try:
        if int(device.dlpack_device_type()) == 1:
            return ctx
        total = int(memory_budget / 0.85) if memory_budget else int(device.total_global_memory)
    except Exception as err:
        from app.debug_log import log

        log.info(
            "the GPU's memory size is unknown (context window not fitted to it): %s: %s",
            type(err).__name__,
            err,
        )
        return ctx
    if total <= 0:
        return ctx
    budget = int(total * 0.85) - weight_bytes - (512 << 20)
    fits = budget // max(1, kv_bytes_per_token)
    return max(min(ctx, 512), min(ctx, int(fits) // 16 * 16))


def _vulkan_memory_budget() -> int | None:
    """The probe's memory budget for the GPU (the unified-memory path on a Steam Deck or an APU);
    None when the probe finds no GPU (a CPU Vulkan device such as lavapipe: system RAM)."""
    try:
        from app.inference.hardware import shared_probe

        report = shared_probe()
    except Exception:  # the probe is best effort
        from app.debug_log import log

        log.info("the hardware probe failed (no Vulkan memory budget)", exc_info=True)
        return None
    if report.gpu is None:
        return None
    return int(report.memory_budget_bytes) or None


def load_engine(
    model: str | Path,
    device: str = "auto",
    progress: ProgressCallback | None = None,
    context_window: int | None = None,
    *,
    arch: str | None = None,
    prebuilt: bool | None = None,
) -> TVMEngine:
    """Load ``model`` (a model directory or an installed id) on ``device``: its library from the
    cache, else a verified prebuilt one (``prebuilt`` False: never; None: as the settings say),
    else compiled here."""
    from app.inference.compile import prebuilt as prebuilt_libs
    from app.inference.compile.cache import CompiledModel, drop_library
    from app.inference.compile.compiler import get_library, library_slot
    from app.inference.engine.chat_template import ChatFormatter
    from app.inference.engine.tokenizer import Tokenizer
    from app.inference.hardware.device_spec import resolve_device, tvm_device
    from app.inference.store.config import check_tokenizer_fits
    from app.inference.store.weights import load_weights

    model_id, model_dir = resolve_model_dir(model)
    cfg = ModelConfig.load(model_dir)
    tokenizer = Tokenizer.from_model_dir(model_dir)
    check_tokenizer_fits(cfg, tokenizer.vocab_size, str(model_dir))
    formatter = ChatFormatter.from_model_dir(model_dir, cfg.raw)
    spec = resolve_device(device)
    compiled = get_library(
        cfg,
        spec,
        arch=arch,
        progress=progress,
        fetch=prebuilt_libs.fetcher(model_id, model_dir, prebuilt, progress),
    )

    if context_window is not None and not int(context_window) >= 2:
        raise LlmchatError(
            f"A context window of {context_window} tokens is too small.",
            "use at least 64 (or leave it out for the model's default)",
        )
    ctx = int(context_window) if context_window else min(cfg.context_window_size, DEFAULT_CONTEXT_CAP)
    if ctx < 2:
        raise LlmchatError(f"A context window of {ctx} tokens is too small.", "use at least 64")
    ctx = min(ctx, cfg.context_window_size)
    dev = tvm_device(spec)
    if spec.backend == "vulkan":  # before any weight is uploaded: the adapter's buffer limits
        from app.inference.backends import webgpu

        layer_kv = 2 * cfg.num_key_value_heads * cfg.head_dim * compiled.kv_itemsize
        ctx = webgpu.check_fits(spec.index, compiled.params, layer_kv, ctx, explicit=bool(context_window))

    def on_load(done: int, total: int) -> None:
        if progress:
            progress(ProgressEvent("load", f"loading weights to {spec}", done, total))

    params, weight_bytes = load_weights(
        model_dir, compiled.params, dev, progress=on_load if progress else None
    )
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * compiled.kv_itemsize
    if not context_window:
        ctx = fit_context_window(
            ctx,
            dev,
            weight_bytes,
            kv_per_token,
            _vulkan_memory_budget() if spec.backend == "vulkan" else None,
        )

    def start(lib: CompiledModel) -> ModelRuntime:
        return ModelRuntime(
            str(lib.lib_path),
            dev,
            params,
            hidden_size=cfg.hidden_size,
            model_dtype=lib.compute_dtype,
            context_window=ctx,
            prefill_chunk=cfg.prefill_chunk_size,
            kv_bytes_per_token=kv_per_token,
            weight_bytes=weight_bytes,
        )

    try:
        runtime = start(compiled)
    except Exception as err:
        if compiled.origin != "prebuilt":
            raise
        # a prebuilt library that passed every check and still does not load is never used again
        drop_library(library_slot(cfg, spec, arch))
        if progress:
            progress(
                ProgressEvent(
                    "compile",
                    f"the prebuilt library failed to load ({type(err).__name__}: "
                    f"{str(err).strip()[:200]}): removed it, compiling here",
                    None,
                    None,
                )
            )
        rebuilt = get_library(cfg, spec, arch=arch, progress=progress)
        if rebuilt.params != compiled.params:
            params, weight_bytes = load_weights(
                model_dir, rebuilt.params, dev, progress=on_load if progress else None
            )
        compiled = rebuilt
        runtime = start(compiled)
    info = EngineInfo(
        model_id=model_id,
        model_path=str(model_dir),
        backend=spec.backend,
        device=str(spec),
        quantization=cfg.quantization_label,
        context_window=ctx,
        weight_bytes=weight_bytes,
    )
    return TVMEngine(info, cfg, runtime, tokenizer, formatter)


Engine = TVMEngine
