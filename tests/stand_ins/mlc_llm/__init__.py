"""STAND-IN for MLC-LLM's ``mlc_llm`` package — test use only, not MLC-LLM.

MLC-LLM's wheels are not on PyPI (they are GitHub release assets listed on https://mlc.ai/wheels),
so they cannot be installed where llmchat's tests run. This module implements exactly the
documented interface of ``mlc_llm.MLCEngine`` that llmchat's optional MLC engine uses, as read in
mlc-ai/mlc-llm (python/mlc_llm/serve/engine.py, protocol/openai_api_protocol.py,
cpp/serve/metrics.cc):

- ``MLCEngine(model, device="auto", *, model_lib=None, mode="local", engine_config=None,
  enable_tracing=False)``; ``.chat.completions.create(...)``, ``.completions.create(...)``,
  ``.abort(request_id)``, ``.terminate()``, ``.max_input_sequence_length``.
- Streaming responses shaped like ``ChatCompletionStreamResponse`` / ``CompletionResponse``:
  ``.choices[i].delta.content`` / ``.choices[i].text``, ``.finish_reason``; a final chunk with
  ``choices=[]`` and ``.usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
  ``extra`` with ``prefill_tokens``, ``decode_tokens``, ``prefill_tokens_per_s``,
  ``decode_tokens_per_s``, ``ttft_s``, ``end_to_end_latency_s``, ``inter_token_latency_s``) sent
  only when ``stream_options={"include_usage": True}``.
- A too-long conversation raises ``BadRequestError("Request prompt has N tokens in total, larger
  than the model input length limit L.")`` when the stream is first read; closing the stream
  (GeneratorExit) aborts the request.

The "model" is a toy: a token is a whitespace-separated word; the reply to a conversation is
``"You said: <last user message>"`` followed by numbered filler words, one word per chunk.
Special inputs for tests: a user message containing ``__fail__`` makes the stream raise a
RuntimeError after the first chunk; ``__unicode__`` replies with multi-byte text. Every engine
records its requests in ``.requests`` (test instrumentation, not MLC's interface).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__version__ = "0.0.0+llmchat.stand.in"
STAND_IN = True

#: seconds each stand-in chunk takes (tests raise it to exercise cancel)
CHUNK_DELAY_S = 0.0


class BadRequestError(ValueError):
    """As mlc_llm.protocol.error_protocol.BadRequestError."""


@dataclass
class ChatCompletionMessage:
    content: str | None = None
    role: str = "assistant"


@dataclass
class ChatCompletionStreamResponseChoice:
    delta: ChatCompletionMessage
    finish_reason: str | None = None
    index: int = 0


@dataclass
class CompletionResponseChoice:
    text: str
    finish_reason: str | None = None
    index: int = 0


@dataclass
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    extra: dict[str, Any] | None = None


@dataclass
class ChatCompletionStreamResponse:
    id: str
    choices: list[Any]
    usage: CompletionUsage | None = None
    object: str = "chat.completion.chunk"
    system_fingerprint: str = ""


@dataclass
class CompletionResponse:
    id: str
    choices: list[Any]
    usage: CompletionUsage | None = None
    object: str = "text_completion"


@dataclass
class _Request:
    request_id: str
    kind: str
    prompt_words: list[str]
    kwargs: dict[str, Any]
    aborted: threading.Event = field(default_factory=threading.Event)
    closed: bool = False


def _words(text: str) -> list[str]:
    return text.split()


class _ChatCompletion:
    def __init__(self, engine: MLCEngine) -> None:
        self._engine = engine

    def create(
        self,
        *,
        messages: list[dict[str, Any]],
        model: str | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logprobs: bool = False,
        top_logprobs: int = 0,
        logit_bias: dict[int, float] | None = None,
        max_tokens: int | None = None,
        n: int = 1,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stream: bool = False,
        stream_options: dict[str, Any] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None,
        user: str | None = None,
        response_format: dict[str, Any] | None = None,
        request_id: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> Any:
        if not stream:
            raise NotImplementedError("the stand-in implements streaming only")
        kwargs = {
            "frequency_penalty": frequency_penalty,
            "presence_penalty": presence_penalty,
            "max_tokens": max_tokens,
            "seed": seed,
            "stop": stop,
            "stream_options": stream_options,
            "temperature": temperature,
            "top_p": top_p,
            "extra_body": extra_body,
            "messages": messages,
        }
        words: list[str] = []
        for message in messages:
            words += ["<|" + message["role"] + "|>", *_words(message.get("content") or "")]
        last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return self._engine._stream("chat", request_id, words, kwargs, last_user)


class _Completion:
    def __init__(self, engine: MLCEngine) -> None:
        self._engine = engine

    def create(
        self,
        *,
        prompt: str | list[int],
        model: str | None = None,
        best_of: int = 1,
        echo: bool = False,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logprobs: int | None = None,
        logit_bias: dict[int, float] | None = None,
        max_tokens: int | None = None,
        n: int = 1,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        stream: bool = False,
        stream_options: dict[str, Any] | None = None,
        suffix: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        user: str | None = None,
        response_format: dict[str, Any] | None = None,
        request_id: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> Any:
        if not stream:
            raise NotImplementedError("the stand-in implements streaming only")
        kwargs = {
            "max_tokens": max_tokens,
            "seed": seed,
            "stop": stop,
            "stream_options": stream_options,
            "temperature": temperature,
            "top_p": top_p,
            "extra_body": extra_body,
            "prompt": prompt,
        }
        words = [str(t) for t in prompt] if isinstance(prompt, list) else _words(prompt)
        return self._engine._stream("completion", request_id, words, kwargs, "")


class _Chat:
    def __init__(self, engine: MLCEngine) -> None:
        self.completions = _ChatCompletion(engine)


class MLCEngine:
    """Stand-in for mlc_llm.MLCEngine (see the module docstring)."""

    def __init__(
        self,
        model: str,
        device: str = "auto",
        *,
        model_lib: str | None = None,
        mode: str = "local",
        engine_config: Any = None,
        enable_tracing: bool = False,
    ) -> None:
        path = Path(model)
        if not (path / "mlc-chat-config.json").is_file():
            # the real engine fails in download_cache / _process_model_args with a ValueError
            raise ValueError(f"Invalid model: {model} (no mlc-chat-config.json)")
        if device not in ("auto", "cpu", "cuda", "rocm", "vulkan", "metal") and ":" not in device:
            raise ValueError(f"Device is not found on your local environment: {device}")
        config = json.loads((path / "mlc-chat-config.json").read_text())
        self.model = model
        self.mode = mode
        self.device = "cpu:0" if device == "auto" else device
        self.max_input_sequence_length = int(config.get("context_window_size", 4096))
        self.chat = _Chat(self)
        self.completions = _Completion(self)
        self.requests: list[_Request] = []
        self.aborted: list[str] = []
        self.terminated = False

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        for request in self.requests:
            if request.request_id == request_id:
                request.aborted.set()

    def terminate(self) -> None:
        self.terminated = True

    def _stream(
        self, kind: str, request_id: str | None, words: list[str], kwargs: dict[str, Any], last_user: str
    ) -> Iterator[Any]:
        if self.terminated:
            raise ValueError("The engine has terminated.")
        request = _Request(request_id or f"chatcmpl-{len(self.requests)}", kind, words, kwargs)
        self.requests.append(request)
        return self._generate(request, last_user)

    def _generate(self, request: _Request, last_user: str) -> Iterator[Any]:
        kwargs = request.kwargs
        if len(request.prompt_words) > self.max_input_sequence_length:
            raise BadRequestError(
                f"Request prompt has {len(request.prompt_words)} tokens in total,"
                f" larger than the model input length limit {self.max_input_sequence_length}."
            )
        debug = (kwargs.get("extra_body") or {}).get("debug_config") or {}
        if "__unicode__" in last_user:
            reply = ["Привет,", "мир!", "日本語", "🤖🚀"]
        else:
            reply = ["You", "said:", *_words(last_user)]
        max_tokens = kwargs.get("max_tokens") or 10**9
        room = self.max_input_sequence_length - len(request.prompt_words)
        filler = max_tokens if debug.get("ignore_eos") else 3
        reply += [f"w{i}" for i in range(filler)]
        stops = kwargs.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        start = time.perf_counter()
        first = None
        generated = 0
        finish = "stop"
        text_so_far = ""
        try:
            for index, word in enumerate(reply):
                if request.aborted.is_set():
                    finish = "abort"
                    break
                if generated >= max_tokens:
                    finish = "length"
                    break
                if generated >= room:
                    finish = "length"
                    break
                if CHUNK_DELAY_S:
                    time.sleep(CHUNK_DELAY_S)
                piece = word if index == 0 else " " + word
                generated += 1
                if first is None:
                    first = time.perf_counter()
                text_so_far += piece
                hit = next((s for s in stops if s in text_so_far), None)
                if hit is not None:
                    kept = text_so_far[: text_so_far.index(hit)]
                    piece = kept[len(text_so_far) - len(piece) :]
                    finish = "stop"
                    if piece:
                        yield self._chunk(request, piece, None)
                    break
                yield self._chunk(request, piece, None)
                if "__fail__" in last_user:
                    raise RuntimeError("stand-in failure in the decode loop")
            yield self._chunk(request, "", "stop" if finish == "abort" else finish)
            usage = self._usage(request, generated, start, first)
            include = (kwargs.get("stream_options") or {}).get("include_usage")
            if include:
                body = ChatCompletionStreamResponse if request.kind == "chat" else CompletionResponse
                yield body(id=request.request_id, choices=[], usage=usage)
        finally:
            request.closed = True

    def _chunk(self, request: _Request, text: str, finish: str | None) -> Any:
        if request.kind == "chat":
            choice = ChatCompletionStreamResponseChoice(
                delta=ChatCompletionMessage(content=text), finish_reason=finish
            )
            return ChatCompletionStreamResponse(id=request.request_id, choices=[choice])
        return CompletionResponse(id=request.request_id, choices=[CompletionResponseChoice(text, finish)])

    def _usage(self, request: _Request, generated: int, start: float, first: float | None) -> CompletionUsage:
        end = time.perf_counter()
        first = first or end
        prompt = len(request.prompt_words)
        extra: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "prefill_tokens": prompt,
            "decode_tokens": max(generated - 1, 0),
            "jump_forward_tokens": 0,
            "end_to_end_latency_s": end - start,
            "ttft_s": first - start,
            "inter_token_latency_s": (end - start) / max(generated, 1),
        }
        if prompt:
            extra["prefill_tokens_per_s"] = prompt / max(first - start, 1e-9)
        if generated > 1:
            extra["decode_tokens_per_s"] = (generated - 1) / max(end - first, 1e-9)
        return CompletionUsage(prompt, generated, prompt + generated, extra)
