"""The optional second engine: MLC-LLM's own ``mlc_llm.MLCEngine``, when the package is importable.

MLC's wheels (ROCm, Vulkan, CUDA builds of ``mlc-llm`` and its TVM fork ``mlc-ai``) are published
on MLC's own wheel index, not on PyPI, so this path is optional and is tested here only against
a stand-in module that implements MLCEngine's documented interface (tests/stand_ins/mlc_llm).
It is untested on real hardware.

MLCEngine is stateless per request: the conversation lives here and is sent in full with every
``chat.completions.create(..., stream=True, stream_options={"include_usage": True})``; MLC's
prefix cache avoids re-prefilling the shared part. Tok/s come from ``usage.extra``
(``prefill_tokens_per_s``, ``decode_tokens_per_s``, ``ttft_s``; cpp/serve/metrics.cc).
Not supported through this API: ``repetition_penalty`` (MLC's OpenAI-style request has no such
field; the model's default from mlc-chat-config.json applies).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import LlmchatError
from app.inference.api import (
    ChatEvent,
    ContextTrimmed,
    EngineInfo,
    FinishReason,
    Message,
    ProgressCallback,
    ProgressEvent,
    ReplyStats,
    SamplingParams,
    SessionStats,
    TextDelta,
)
from app.inference.engine.conversation import ConversationState
from app.inference.engine.sampling import validate

MLC_INSTALL_FIX = (
    "install MLC-LLM's wheels from MLC's own index, e.g. "
    "pip install --pre -f https://mlc.ai/wheels mlc-llm-nightly-rocm62 mlc-ai-nightly-rocm62 "
    "(cpu, cu128, cu130, rocm61 and rocm62 builds exist; all include Vulkan)"
)
# MLC's message when the whole conversation exceeds the context window (engine_utils.py)
_PROMPT_TOO_LONG = "larger than the model input length limit"
_PROMPT_TOO_LONG_NUMBERS = re.compile(r"has (\d+) tokens in total, " + _PROMPT_TOO_LONG + r" (\d+)")


@dataclass
class MLCReplyStats(ReplyStats):
    """A reply's stats with the whole prompt's length as MLC counted it (``usage.prompt_tokens``;
    ``prompt_tokens`` is what was prefilled, after MLC's prefix cache)."""

    request_prompt_tokens: int = 0


def mlc_llm_available() -> bool:
    """Whether ``mlc_llm`` can be imported and has ``MLCEngine`` (never raises).

    This imports ``mlc_llm`` and with it MLC's own TVM build, so call it when the user asks for
    the MLC engine (or for a diagnostics report), not on every start.
    """
    try:
        module = importlib.import_module("mlc_llm")
    except Exception:  # a broken install fails in many ways (missing libtvm, ABI mismatch)
        return False
    return hasattr(module, "MLCEngine")


def _import_mlc_llm() -> Any:
    try:
        module = importlib.import_module("mlc_llm")
    except ImportError as err:
        raise LlmchatError(f"the MLC-LLM engine is not installed ({err}).", MLC_INSTALL_FIX) from None
    except Exception as err:
        raise LlmchatError(
            f"the MLC-LLM package is installed but does not import: {type(err).__name__}: {err}",
            "reinstall matching mlc-llm-nightly-* and mlc-ai-nightly-* wheels; " + MLC_INSTALL_FIX,
        ) from None
    if not hasattr(module, "MLCEngine"):
        raise LlmchatError(
            "the installed 'mlc_llm' package has no MLCEngine (PyPI's mlc-llm-* 0.1 packages are empty "
            "name placeholders).",
            MLC_INSTALL_FIX,
        )
    return module


def _read_model_facts(model: str) -> tuple[str, int, int]:
    """(quantization, context window, weight bytes) from a local MLC model directory, if any."""
    path = Path(model).expanduser()
    quantization, context_window, weight_bytes = "", 0, 0
    try:
        config = json.loads((path / "mlc-chat-config.json").read_text(encoding="utf-8"))
        quantization = str(config.get("quantization", ""))
        context_window = int(config.get("context_window_size") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    for name in ("tensor-cache.json", "ndarray-cache.json"):
        try:
            cache = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        try:
            weight_bytes = int(cache.get("metadata", {}).get("ParamBytes") or 0) or sum(
                int(shard.get("nbytes", 0)) for shard in cache.get("records", [])
            )
        except (TypeError, ValueError, AttributeError):
            weight_bytes = 0
        break
    return quantization, context_window, weight_bytes


class _Reply:
    """What one streamed request produced."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.finish: str | None = None
        self.usage: Any = None
        self.chunks_with_text = 0
        self.started = time.perf_counter()
        self.first_text_at: float | None = None
        self.ended: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class MLCLLMEngine(ConversationState):
    """``app.inference.api.Engine`` on top of ``mlc_llm.MLCEngine`` (mode "interactive")."""

    def __init__(
        self,
        model: str | Path,
        device: str = "auto",
        *,
        model_lib: str | None = None,
        model_id: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        mlc = _import_mlc_llm()
        model_str = str(model)
        if progress is not None:
            progress(ProgressEvent("load", f"starting MLC-LLM's engine on {device} (it may compile first)"))
        try:
            self._engine = mlc.MLCEngine(model_str, device=device, model_lib=model_lib, mode="interactive")
        except Exception as err:
            raise LlmchatError(
                f"MLC-LLM could not load {model_str} on {device}: {type(err).__name__}: {err}",
                "check the model directory (mlc-chat-config.json, tensor-cache.json, shards) and that "
                f"the device exists; or use llmchat's own engine (without --engine mlc). {MLC_INSTALL_FIX}",
            ) from None
        quantization, context_window, weight_bytes = _read_model_facts(model_str)
        limit = getattr(self._engine, "max_input_sequence_length", None)
        if isinstance(limit, int) and limit > 0:
            context_window = limit
        resolved = getattr(self._engine, "device", None)
        device_name = str(resolved) if resolved is not None else device
        self.info = EngineInfo(
            model_id=model_id or Path(model_str).name or model_str,
            model_path=model_str,
            backend=f"mlc-llm:{device}",
            device=device_name,
            quantization=quantization,
            context_window=context_window,
            weight_bytes=weight_bytes,
        )
        self.last_stats: ReplyStats | None = None
        self.session_stats = SessionStats()
        self._system: str | None = None
        self._history: list[Message] = []
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._request_id: str | None = None
        #: the caller's cancel event of the running ``complete()`` (``llmchat serve``'s client gone)
        self._external_cancel: threading.Event | None = None
        self._closed = False

    # -- conversation state -------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation (MLC keeps no per-conversation state; its prefix cache is shared)."""
        self._history = []

    def cancel(self) -> None:
        """Stop the running reply: the stream is closed at the next chunk, and MLC is told to abort."""
        self._cancel.set()
        request_id = self._request_id
        if request_id is not None and not self._closed:
            # the request may have finished meanwhile; closing the stream then suffices
            with contextlib.suppress(Exception):
                self._engine.abort(request_id)

    # -- generation ---------------------------------------------------------------------------
    def _messages_payload(self, history: list[Message]) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self._system}] if self._system else []
        return system + [{"role": m.role, "content": m.content} for m in history]

    @staticmethod
    def _request_kwargs(params: SamplingParams) -> dict[str, Any]:
        return {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "seed": params.seed,
            "frequency_penalty": params.frequency_penalty,
            "presence_penalty": params.presence_penalty,
            "stop": list(params.stop) or None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def _begin(self) -> None:
        if self._closed:
            raise LlmchatError("the MLC-LLM engine was closed.", "load the model again")
        if not self._lock.acquire(blocking=False):
            raise LlmchatError("The engine is already generating a reply.", "wait for it, or cancel it first")
        self._cancel.clear()

    def chat(self, user_message: str, params: SamplingParams | None = None) -> Iterator[ChatEvent]:
        params = validate(params or SamplingParams())
        self._begin()
        history = [*self._history, Message("user", user_message)]
        reply = _Reply()
        finished = False
        try:
            dropped = 0
            while True:
                reply = _Reply()
                announced = dropped == 0
                deltas = self._stream(
                    reply, chat=True, messages=self._messages_payload(history), params=params
                )
                try:
                    with contextlib.closing(deltas):
                        for delta in deltas:
                            if not announced:
                                announced = True
                                yield ContextTrimmed(dropped, self.info.context_window)
                            yield delta
                except _PromptTooLong as err:
                    if len(history) <= 1:
                        raise LlmchatError(
                            f"The prompt does not fit the context window ({self.info.context_window} "
                            f"tokens): {err}",
                            "shorten the message or the system prompt",
                        ) from None
                    # drop the oldest turn: a user message and the assistant reply after it
                    cut = 2 if len(history) > 2 and history[1].role == "assistant" else 1
                    history = history[cut:]
                    dropped += cut
                    continue
                break
            if not announced:
                yield ContextTrimmed(dropped, self.info.context_window)
            finished = True
            self._history = [*history, Message("assistant", reply.text)]
            stats = self._stats(reply, params)
            self.last_stats = stats
            self.session_stats.add(stats)
            yield stats
        finally:
            if not finished and reply.text_parts:
                # the consumer stopped early or generation failed midway: keep what was shown
                self._history = [*history, Message("assistant", reply.text)]
            self._lock.release()

    def count_prompt_tokens(self, messages: list[Message]) -> int | None:
        """None: MLC's documented API renders and counts the prompt only inside a request (it then
        refuses one beyond the context window, which ``complete`` reports as ContextLengthExceeded)."""
        return None

    def complete(
        self, messages: list[Message], params: SamplingParams, *, cancel: threading.Event | None = None
    ) -> Iterator[ChatEvent]:
        """One reply to a whole conversation given by the caller (``llmchat serve --engine mlc``): the
        engine's own conversation is not touched; MLC's prefix cache spares the shared prefix.
        ``cancel`` stops it at the next chunk (the stream is closed, which aborts it in MLC)."""
        from app.inference.engine.tvm_engine import ContextLengthExceeded

        params = validate(params)
        self._begin()
        self._external_cancel = cancel
        try:
            reply = _Reply()
            payload = [{"role": m.role, "content": m.content} for m in messages]
            deltas = self._stream(reply, chat=True, messages=payload, params=params)
            try:
                with contextlib.closing(deltas):
                    yield from deltas
            except _PromptTooLong as err:
                found = _PROMPT_TOO_LONG_NUMBERS.search(str(err))
                tokens, limit = (int(found[1]), int(found[2])) if found else (0, self.info.context_window)
                raise ContextLengthExceeded(tokens, limit, "shorten the conversation") from None
            stats = self._stats(reply, params)
            self.last_stats = stats
            self.session_stats.add(stats)
            yield stats
        finally:
            self._external_cancel = None
            self._lock.release()

    def _cancelled(self) -> bool:
        external = self._external_cancel
        return self._cancel.is_set() or (external is not None and external.is_set())

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        ignore_eos: bool = False,
        detokenize: bool = True,
    ) -> Iterator[ChatEvent]:
        """Raw completion of ``prompt_ids`` (``completions.create`` with a token-id prompt)."""
        if not prompt_ids:
            raise LlmchatError("generate() needs at least one prompt token.", "pass a non-empty prompt")
        params = validate(params)
        self._begin()
        try:
            reply = _Reply()
            extra = {"extra_body": {"debug_config": {"ignore_eos": True}}} if ignore_eos else {}
            deltas = self._stream(reply, chat=False, prompt=list(prompt_ids), params=params, **extra)
            try:
                with contextlib.closing(deltas):
                    for delta in deltas:
                        if detokenize:
                            yield delta
            except _PromptTooLong as err:
                raise LlmchatError(
                    f"The prompt is {len(prompt_ids)} tokens long; {err}", "use a shorter prompt"
                ) from None
            stats = self._stats(reply, params)
            self.last_stats = stats
            self.session_stats.add(stats)
            yield stats
        finally:
            self._lock.release()

    def _stream(
        self, reply: _Reply, *, chat: bool, params: SamplingParams, **request: Any
    ) -> Iterator[TextDelta]:
        """Open one streamed request, yield its text, always close it (closing aborts it in MLC)."""
        self._request_id = f"llmchat-{uuid.uuid4().hex}"
        api = self._engine.chat.completions if chat else self._engine.completions
        try:
            try:
                stream = api.create(request_id=self._request_id, **request, **self._request_kwargs(params))
            except Exception as err:  # request validation happens in create()
                raise _mlc_error(err) from None
            consumer = self._consume(stream, reply, chat=chat)
            try:
                yield from consumer
            finally:
                consumer.close()
        finally:
            self._request_id = None

    def _consume(self, stream: Any, reply: _Reply, *, chat: bool) -> Iterator[TextDelta]:
        """Yield the text of each chunk; stop at cancel (closing the stream, which aborts the request)."""
        iterator = iter(stream)
        try:
            while True:
                if self._cancelled():
                    reply.finish = "cancelled"
                    break
                try:
                    chunk = next(iterator)
                except StopIteration:
                    break
                except Exception as err:
                    if self._cancelled():  # the abort ended the stream with an error chunk
                        reply.finish = "cancelled"
                        break
                    raise _mlc_error(err) from None
                usage = getattr(chunk, "usage", None)
                if usage is not None:
                    reply.usage = usage
                for choice in getattr(chunk, "choices", None) or []:
                    text = choice.delta.content if chat else choice.text
                    if isinstance(text, str) and text:
                        if reply.first_text_at is None:
                            reply.first_text_at = time.perf_counter()
                        reply.text_parts.append(text)
                        reply.chunks_with_text += 1
                        yield TextDelta(text)
                    if choice.finish_reason is not None and reply.finish is None:
                        if choice.finish_reason == "error":
                            raise LlmchatError(
                                "MLC-LLM reported an error while generating.",
                                "try again; if it persists, reset the chat or reload the model",
                            )
                        reply.finish = str(choice.finish_reason)
        finally:
            reply.ended = time.perf_counter()
            close = getattr(stream, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()

    def _stats(self, reply: _Reply, params: SamplingParams) -> MLCReplyStats:
        stats = MLCReplyStats()
        usage = reply.usage
        extra: dict[str, Any] = dict(getattr(usage, "extra", None) or {}) if usage is not None else {}
        if usage is not None:
            prefill_tokens = int(extra.get("prefill_tokens") or 0)
            stats.prompt_tokens = prefill_tokens or int(getattr(usage, "prompt_tokens", 0) or 0)
            stats.generated_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
            stats.request_prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
        else:
            stats.generated_tokens = reply.chunks_with_text
        wall_ttft = (reply.first_text_at or reply.ended or reply.started) - reply.started
        ttft = float(extra.get("ttft_s") or 0.0) or wall_ttft
        stats.time_to_first_token_s = ttft
        prefill_rate = float(extra.get("prefill_tokens_per_s") or 0.0)
        stats.prefill_s = stats.prompt_tokens / prefill_rate if prefill_rate > 0 else ttft
        decode_rate = float(extra.get("decode_tokens_per_s") or 0.0)
        decode_tokens = int(extra.get("decode_tokens") or max(stats.generated_tokens - 1, 0))
        if decode_rate > 0:
            stats.decode_s = decode_tokens / decode_rate
        else:
            end_to_end = float(extra.get("end_to_end_latency_s") or 0.0)
            total = end_to_end or ((reply.ended or reply.started) - reply.started)
            stats.decode_s = max(total - ttft, 0.0)
        stats.finish_reason = self._finish_reason(reply, stats, params)
        return stats

    @staticmethod
    def _finish_reason(reply: _Reply, stats: ReplyStats, params: SamplingParams) -> FinishReason:
        if reply.finish in ("cancelled", "abort"):
            return "cancelled"
        if reply.finish == "length":
            # MLC says "length" for max_tokens and for a full context window alike
            return "length" if stats.generated_tokens >= params.max_tokens else "context"
        return "stop"

    # -- resources ----------------------------------------------------------------------------
    def memory_in_use_bytes(self) -> int | None:
        return None  # MLCEngine does not report it through its Python API

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._engine.terminate()
        except Exception as err:
            raise LlmchatError(
                f"MLC-LLM did not shut down cleanly: {type(err).__name__}: {err}",
                "restart llmchat to free the GPU memory",
            ) from None


class _PromptTooLong(Exception):
    """MLC refused the request: the conversation exceeds the context window."""


def _mlc_error(err: Exception) -> Exception:
    """The exception to raise for an error out of mlc_llm."""
    if _PROMPT_TOO_LONG in str(err):
        return _PromptTooLong(str(err))
    return LlmchatError(
        f"MLC-LLM failed while generating: {type(err).__name__}: {err}",
        "try again; if it persists, reset the chat or reload the model",
    )
