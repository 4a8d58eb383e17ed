"""The remote engine: chat with any OpenAI-compatible server (vLLM, SGLang, MLC's ``mlc_llm serve``,
llama.cpp's server, Ollama, ``llmchat serve`` …) through the ``openai`` package.

``RemoteEngine`` implements ``app.inference.api.Engine``: the conversation (and the system prompt) is
kept here and sent whole with each request (``/v1/chat/completions``, ``stream: true``,
``stream_options: {include_usage: true}``); ``/set`` becomes the request's sampling fields;
``cancel()`` closes the stream (the server sees the client go). The reply's stats are measured here
— time to first token, decode tok/s over the streamed chunks — next to the server's own ``usage``.

The API key comes from ``--api-key`` or ``LLMCHAT_API_KEY``; ``OPENAI_API_KEY`` is used only for
OpenAI's own host. It goes in the ``Authorization`` header to the endpoint's host and nowhere else:
redirects are not followed, and it is never printed or logged (``repr`` hides it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from app.errors import LlmchatError
from app.inference.api import (
    ChatEvent,
    EngineInfo,
    Message,
    ReplyStats,
    SamplingParams,
    SessionStats,
    TextDelta,
)
from app.inference.engine.conversation import ConversationState, with_system

#: where the API key of ``--endpoint`` is read when ``--api-key`` is not given
API_KEY_ENV = "LLMCHAT_API_KEY"
#: OpenAI's key variable: read only when the endpoint is OpenAI's own host
OPENAI_KEY_ENV = "OPENAI_API_KEY"
OPENAI_HOST = "api.openai.com"
#: seconds to connect / to wait for the next streamed chunk
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0


def normalize_endpoint(url: str) -> str:
    """``http(s)://host[:port][/path]`` with ``/v1`` added when the path is empty; no credentials."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LlmchatError(f"{url!r} is not an http(s) URL.", "pass --endpoint http://HOST:PORT/v1")
    if parts.username or parts.password:
        raise LlmchatError(
            "The endpoint URL contains a user name or password.",
            "pass the key with --api-key or LLMCHAT_API_KEY, not in the URL",
        )
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def resolve_api_key(endpoint: str, api_key: str | None = None) -> str | None:
    """The key for ``endpoint``: ``api_key``, else ``$LLMCHAT_API_KEY``, else ``$OPENAI_API_KEY`` when the
    endpoint is OpenAI's own host (that key is for OpenAI, and is sent nowhere else)."""
    if api_key:
        return api_key
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    if urlsplit(endpoint).hostname == OPENAI_HOST and os.environ.get(OPENAI_KEY_ENV):
        return os.environ[OPENAI_KEY_ENV]
    return None


@dataclass
class RemoteReplyStats(ReplyStats):
    """A reply's stats measured on the client, with the server's ``usage`` as it sent it."""

    server_usage: dict | None = None

    def server_line(self) -> str | None:
        """The server's own figures in words (MLC's ``usage.extra`` where it sends them)."""
        usage = self.server_usage
        if not usage:
            return None
        line = (
            f"server: {usage.get('prompt_tokens', '?')} prompt tokens, "
            f"{usage.get('completion_tokens', '?')} completion tokens"
        )
        extra = usage.get("extra") or {}
        if isinstance(extra, dict) and "decode_tokens_per_s" in extra:
            line += (
                f", prefill {float(extra.get('prefill_tokens_per_s') or 0):.1f} tok/s, "
                f"decode {float(extra['decode_tokens_per_s']):.1f} tok/s"
            )
        return line


def _context_window(card: Any) -> int:
    """The context length a model card announces (vLLM's and llmchat's ``max_model_len``, llama.cpp's
    ``meta.n_ctx_train``), or 0."""
    extra = getattr(card, "model_extra", None) or {}
    meta = extra.get("meta") if isinstance(extra.get("meta"), dict) else {}
    for value in (extra.get("max_model_len"), extra.get("context_length"), meta.get("n_ctx_train")):
        if isinstance(value, int) and value > 0:
            return value
    return 0


def make_client(
    endpoint: str, api_key: str | None, read_timeout_s: float = READ_TIMEOUT_S
) -> tuple[Any, dict[str, Any]]:
    """``(openai.OpenAI, headers for every request)`` for ``endpoint`` (normalized) and its key."""
    import openai

    client = openai.OpenAI(
        base_url=endpoint,
        api_key=api_key or "no-key",
        organization="",
        project="",
        max_retries=0,
        timeout=openai.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S),
        # the key goes to this host only: a redirect elsewhere is an error, not a second request
        http_client=openai.DefaultHttpxClient(follow_redirects=False),
    )
    # no Authorization header at all without a key; none of OpenAI's account headers either
    headers: dict[str, Any] = {"OpenAI-Organization": openai.omit, "OpenAI-Project": openai.omit}
    if not api_key:
        headers["Authorization"] = openai.omit
    return client, headers


def list_models(endpoint: str, api_key: str | None = None, hints: ErrorHints | None = None) -> list[str]:
    """The names of the models the server at ``endpoint`` offers (``/v1/models``); errors (unreachable,
    a missing or refused key, no OpenAI API there) as ``LlmchatError`` with ``hints``' fixes."""
    endpoint = normalize_endpoint(endpoint)
    key = resolve_api_key(endpoint, api_key)
    client, headers = make_client(endpoint, key, read_timeout_s=CONNECT_TIMEOUT_S)
    try:
        return [card.id for card in client.models.list(extra_headers=headers).data]
    except Exception as err:
        raise server_error(err, endpoint, has_key=bool(key), hints=hints) from None
    finally:
        client.close()


@dataclass(frozen=True)
class ErrorHints:
    """The fixes an error names, in the words of where the endpoint came from (the command line's
    options by default; the models screen's fields there)."""

    key: str = f"pass --api-key KEY or set {API_KEY_ENV}"
    url: str = "check --endpoint and that the server is running"
    path: str = "check --endpoint (usually ending in /v1) and --model"
    model: str = "pass --model with one of them"


CLI_HINTS = ErrorHints()


def server_error(
    err: BaseException,
    endpoint: str,
    *,
    has_key: bool,
    model: str | None = None,
    hints: ErrorHints | None = None,
) -> LlmchatError:
    """An error of the ``openai`` client talking to ``endpoint`` as a problem and its fix."""
    import openai

    hints = hints or CLI_HINTS
    where = f"The server at {endpoint}"
    if isinstance(err, LlmchatError):
        return err
    if isinstance(err, openai.AuthenticationError | openai.PermissionDeniedError):
        problem = f"{where} refused the API key." if has_key else f"{where} needs an API key."
        return LlmchatError(f"{problem} ({err.status_code})", hints.key)
    if isinstance(err, openai.NotFoundError):
        what = f"has no model {model!r}" if model else "has no OpenAI API at this URL"
        return LlmchatError(f"{where} {what} (404): {_message(err)}", hints.path)
    if isinstance(err, openai.RateLimitError):
        retry = err.response.headers.get("retry-after")
        return LlmchatError(
            f"{where} is busy (429): {_message(err)}",
            f"try again in {retry} s" if retry else "try again shortly",
        )
    if isinstance(err, openai.BadRequestError):
        text = _message(err)
        if getattr(err, "code", None) == "context_length_exceeded" or "context" in text.lower():
            return LlmchatError(
                f"The conversation no longer fits the model's context window: {text}",
                "/reset starts a new conversation",
            )
        return LlmchatError(f"{where} rejected the request (400): {text}", "check the /set values")
    if isinstance(err, openai.APIStatusError):
        return LlmchatError(f"{where} answered {err.status_code}: {_message(err)}", "check the server's log")
    if isinstance(err, openai.APITimeoutError):
        return LlmchatError(f"{where} did not answer in time.", hints.url)
    if isinstance(err, openai.APIConnectionError):
        cause = err.__cause__ or err
        return LlmchatError(f"Cannot reach the server at {endpoint}: {cause}.", hints.url)
    return LlmchatError(f"{where} failed: {type(err).__name__}: {err}", "check the server")


class RemoteEngine(ConversationState):
    """A model on an OpenAI-compatible server, with one conversation (implements ``Engine``)."""

    def __init__(
        self,
        endpoint: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        hints: ErrorHints | None = None,
        saved_as: str | None = None,
    ) -> None:
        self.endpoint = normalize_endpoint(endpoint)
        self._hints = hints or CLI_HINTS
        #: ``server:NAME`` for a server saved in the models screen (how history names the model)
        self.saved_as = saved_as
        key = resolve_api_key(self.endpoint, api_key)
        self._has_key = bool(key)
        self._client, self._headers = make_client(self.endpoint, key, read_timeout_s)
        self._system: str | None = None
        self._history: list[Message] = []
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self.last_stats: ReplyStats | None = None
        self.session_stats = SessionStats()
        try:
            cards = self.models()
            names = [card.id for card in cards]
            if not names:
                raise LlmchatError(
                    f"The server at {self.endpoint} offers no model.", "load a model on the server"
                )
            name = model or names[0]
            if name not in names:
                raise LlmchatError(
                    f"The server at {self.endpoint} has no model {name!r}; it offers: {', '.join(names)}.",
                    self._hints.model,
                )
        except BaseException:
            self._client.close()
            raise
        card = cards[names.index(name)]
        parts = urlsplit(self.endpoint)
        self.info = EngineInfo(
            model_id=name,
            model_path=self.endpoint,
            backend="remote",
            device=parts.netloc,
            quantization="server",
            context_window=_context_window(card),
            weight_bytes=0,
        )

    def __repr__(self) -> str:  # never the key
        return f"RemoteEngine({self.endpoint!r}, model={self.info.model_id!r})"

    # -- the server ------------------------------------------------------------------------------
    def models(self) -> list[Any]:
        """The server's ``/v1/models`` (model cards, ``.id`` the name to ask for)."""
        try:
            return list(self._client.models.list(extra_headers=self._headers).data)
        except Exception as err:
            raise self._error(err) from None

    def _error(self, err: BaseException, model: str | None = None) -> LlmchatError:
        return server_error(err, self.endpoint, has_key=self._has_key, model=model, hints=self._hints)

    # -- conversation ----------------------------------------------------------------------------
    def reset(self) -> None:
        self._history = []

    def cancel(self) -> None:
        """Stop the reply: close the stream (from any thread)."""
        self._cancel.set()
        stream = self._stream
        if stream is not None:
            with contextlib.suppress(Exception):  # closed already
                stream.response.close()

    def _request(self, params: SamplingParams) -> dict[str, Any]:
        """The request's sampling fields: only what differs from the servers' defaults beyond the
        standard ones, so that servers which reject unknown fields accept it."""
        fields: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
        }
        if params.seed is not None:
            fields["seed"] = params.seed
        if params.presence_penalty:
            fields["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            fields["frequency_penalty"] = params.frequency_penalty
        if params.stop:
            fields["stop"] = list(params.stop)
        if params.repetition_penalty != 1.0:
            fields["extra_body"] = {"repetition_penalty": params.repetition_penalty}
        return fields

    def chat(self, user_message: str, params: SamplingParams | None = None) -> Iterator[ChatEvent]:
        params = params or SamplingParams()
        if not self._lock.acquire(blocking=False):
            raise LlmchatError("A reply is already streaming.", "wait for it, or cancel it first")
        try:
            yield from self._chat(user_message, params)
        finally:
            self._lock.release()

    def _chat(self, user_message: str, params: SamplingParams) -> Iterator[ChatEvent]:
        self._cancel.clear()
        history = [*self._history, Message("user", user_message)]
        messages = [{"role": m.role, "content": m.content} for m in with_system(self._system, history)]
        model = self.info.model_id
        started = time.perf_counter()
        try:
            stream = self._client.chat.completions.create(
                model=model,
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=self._headers,
                **self._request(params),
            )
        except Exception as err:
            raise self._error(err, model) from None
        self._stream = stream
        if self._cancel.is_set():  # cancelled while the request was being sent
            self.cancel()
        pieces: list[str] = []
        first_at = last_at = None
        chunks = 0
        usage: dict | None = None
        finish: str | None = None
        cut: BaseException | None = None
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump(exclude_none=True)
                for choice in chunk.choices:
                    text = choice.delta.content if choice.delta is not None else None
                    if text:
                        last_at = time.perf_counter()
                        first_at = first_at or last_at
                        chunks += 1
                        pieces.append(text)
                        yield TextDelta(text)
                    if choice.finish_reason:
                        finish = choice.finish_reason
                if self._cancel.is_set():
                    break
        except Exception as err:
            if not self._cancel.is_set():  # a read failing because cancel() closed it is no error
                cut = err
        finally:
            self._stream = None
            with contextlib.suppress(Exception):
                stream.close()
            if pieces or cut is None:  # a reply that never started leaves no turn behind
                self._history = [*history, Message("assistant", "".join(pieces))]
        if cut is not None and not pieces:
            raise self._error(cut, model)
        stats = RemoteReplyStats(
            prompt_tokens=int((usage or {}).get("prompt_tokens", 0)),
            generated_tokens=int((usage or {}).get("completion_tokens", chunks)),
            time_to_first_token_s=(first_at - started) if first_at else 0.0,
            prefill_s=(first_at - started) if first_at else 0.0,
            decode_s=(last_at - first_at) if first_at and last_at else 0.0,
            finish_reason=(
                "cancelled" if self._cancel.is_set() else "length" if finish == "length" else "stop"
            ),
            server_usage=usage,
        )
        if stats.generated_tokens and cut is None:
            self.last_stats = stats
            self.session_stats.add(stats)
        if cut is not None:
            stats.finish_reason = "cancelled"
            yield stats
            raise LlmchatError(
                f"The connection to {self.endpoint} broke mid-reply ({type(cut).__name__}): the reply is "
                f"cut short; what arrived is kept.",
                "check the server, then send the message again",
            )
        yield stats

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        ignore_eos: bool = False,
        detokenize: bool = True,
    ) -> Iterator[ChatEvent]:
        raise LlmchatError(
            "Token-level completion is not available through a remote server.",
            "run llmchat bench with a local model",
        )

    def memory_in_use_bytes(self) -> int | None:
        return None

    def close(self) -> None:
        self.cancel()
        self._client.close()


def _message(err: Any) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        if isinstance(inner.get("message"), str):
            return inner["message"]
    return str(getattr(err, "message", err))


def load_remote_engine(endpoint: str, model: str | None = None, api_key: str | None = None) -> RemoteEngine:
    """``RemoteEngine`` for ``--endpoint`` (``--model``: a name from the server's /v1/models)."""
    return RemoteEngine(endpoint, api_key=api_key, model=model)
