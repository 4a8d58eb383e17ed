"""``llmchat serve``: an OpenAI-compatible HTTP server on llmchat's engine (Starlette + uvicorn).

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``
(streamed as server-sent events with ``stream: true``). Errors use OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``. The engine decodes one sequence at a time: the
requests wait in arrival order (:mod:`app.serve.scheduler`); a full queue answers 429 with a
``Retry-After``; a client that disconnects stops its reply within one decode step. ``usage`` carries
MLC's extra figures (``usage.extra``: prefill/decode tok/s, time to first token …).

A streamed reply sends its first text at once, then at most one chunk per ``stream_interval``
(``--stream-interval``, default :data:`DEFAULT_STREAM_INTERVAL_S`) with all the text that came in
the meantime, and its end at once: the same text in fewer chunks when tokens come faster than that.
Each chunk costs the server and the client CPU time (an event-loop wake-up, an SSE event written,
then read and parsed by the client — the ``openai`` package takes most of a millisecond per chunk);
where they share the cores with the engine (a CPU model, a client on the same machine), that time
comes out of the decode: 0.81–0.88 of ``llmchat bench``'s decode speed with one chunk per token on
the 2-core box (BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.errors import LlmchatError
from app.inference.api import Message, ReplyStats, SamplingParams
from app.serve.scheduler import Job, JobDone, QueueFull, Scheduler

#: requests that may wait for the engine behind the running one (``--max-queue``)
DEFAULT_MAX_QUEUE = 16
#: most bytes of a request body
MAX_BODY_BYTES = 4 << 20
#: a streamed reply's text is sent at most this often (seconds; 0: a chunk as soon as the request's
#: loop is free to send one, about one per token): 20 chunks/s, the rate at which llmchat's own chat
#: screen pulls a local reply's text (``screens.chat.UI_REFRESH_S``). Each chunk wakes the server's
#: loop and the client, and costs each 0.2–1.2 ms of CPU on the 2-core box (BENCHMARKS.md): a chunk
#: per token took 9–12 % of a token's time at 130 tok/s, one per 0.05 s 4 %
DEFAULT_STREAM_INTERVAL_S = 0.05


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this machine."""
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key."""
    if not is_loopback(host) and not api_key:
        raise LlmchatError(
            f"Refusing to listen on {host} without an API key: anyone who can reach this machine could "
            "use the model.",
            "pass --api-key KEY (or set LLMCHAT_SERVE_API_KEY), or listen on 127.0.0.1 (the default)",
        )


# -- request parsing ----------------------------------------------------------------------------
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: request fields that ask for something this server does not do
_UNSUPPORTED = ("tools", "functions", "logprobs", "top_logprobs", "logit_bias", "audio", "prediction")


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise ApiError(
                    400, "Only text content parts are supported.", param=f"messages[{index}].content"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(
        400,
        "A message's content must be a string or a list of text parts.",
        param=f"messages[{index}].content",
    )


def parse_messages(raw: Any) -> list[Message]:
    """OpenAI's ``messages`` as llmchat's; system/developer turns become one leading system prompt."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list.", param="messages")
    system: list[str] = []
    turns: list[Message] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ApiError(400, "Each message must be an object.", param=f"messages[{i}]")
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ApiError(
                400,
                f"Unsupported role {item.get('role')!r}: use system, user or assistant.",
                param=f"messages[{i}].role",
            )
        text = _content_text(item.get("content"), i)
        if role == "system":
            system.append(text)
        else:
            turns.append(Message(role, text))
    if not turns or turns[-1].role != "user":
        raise ApiError(400, "The last message must come from the user.", param="messages")
    return ([Message("system", "\n\n".join(system))] if system else []) + turns


def _number(body: dict, key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def parse_sampling(body: dict, context_left: int) -> SamplingParams:
    """SamplingParams from a request (OpenAI's names, MLC's ``repetition_penalty``), validated."""
    from app.inference.services import SamplingRules

    validate_value = SamplingRules().validate
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    values = {
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "max_tokens": max(1, context_left) if max_tokens is None else max_tokens,
        "seed": body.get("seed"),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "stop": [] if stop is None else stop,
    }
    checked = {}
    for key, value in values.items():
        try:
            checked[key] = validate_value(key, value)
        except LlmchatError as err:
            param = "max_tokens" if key == "max_tokens" and "max_tokens" in body else key
            if key == "max_tokens" and "max_completion_tokens" in body:
                param = "max_completion_tokens"
            raise ApiError(400, err.problem, param=param, code="invalid_value") from None
    if len(checked["stop"]) > 16:
        raise ApiError(400, "At most 16 stop strings.", param="stop")
    return SamplingParams(**checked)


# -- responses ----------------------------------------------------------------------------------
def usage(prompt_tokens: int | None, stats: ReplyStats | None, job: Job) -> dict[str, Any]:
    """OpenAI's usage, plus MLC's ``extra`` figures measured on the engine. ``prompt_tokens`` None: the
    engine could not count the prompt beforehand (MLC's), its reply's stats say it."""
    if prompt_tokens is None:
        counted = getattr(stats, "request_prompt_tokens", 0)
        prompt_tokens = int(counted or (stats.prompt_tokens if stats else 0))
    completion = stats.generated_tokens if stats else 0
    extra: dict[str, Any] = {}
    if stats is not None:
        queued = (job.started_at or job.submitted_at) - job.submitted_at
        extra = {
            "prefill_tokens": stats.prompt_tokens,  # prefilled now; the rest came from the KV cache
            "prefill_tokens_per_s": stats.prefill_tok_s,
            "decode_tokens_per_s": stats.decode_tok_s,
            "ttft_s": stats.time_to_first_token_s,
            "end_to_end_latency_s": stats.prefill_s + stats.decode_s,
            "queue_s": queued,
        }
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "extra": extra,
    }


def finish_reason(stats: ReplyStats | None) -> str:
    if stats is None:
        return "stop"
    return "length" if stats.finish_reason in ("length", "context") else "stop"


@dataclass
class ServerState:
    engine: Any
    model_id: str
    scheduler: Scheduler
    api_key: str | None
    created: int
    stream_interval: float = DEFAULT_STREAM_INTERVAL_S


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    model_id: str | None = None,
    stream_interval: float = DEFAULT_STREAM_INTERVAL_S,
) -> Starlette:
    """The ASGI app serving ``engine`` (an ``Engine`` with ``complete`` and ``count_prompt_tokens``);
    ``stream_interval``: the least time between two text chunks of a streamed reply (seconds)."""
    if not stream_interval >= 0:
        raise ValueError("stream_interval must be 0 or more seconds")
    state = ServerState(
        engine=engine,
        model_id=model_id or engine.info.model_id,
        scheduler=Scheduler(engine, max_queue=max_queue),
        api_key=api_key or None,
        created=int(time.time()),
        stream_interval=float(stream_interval),
    )

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, state.api_key.encode()):
            raise ApiError(
                401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )

    def model_card() -> dict[str, Any]:
        info = engine.info
        return {
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "llmchat",
            "max_model_len": info.context_window,
        }

    async def health(request: Request) -> Response:
        scheduler = state.scheduler
        return JSONResponse(
            {
                "status": "ok",
                "model": state.model_id,
                "running": scheduler.running is not None,
                "waiting": scheduler.waiting,
                "max_queue": scheduler.max_queue,
                "completed": scheduler.completed,
                "cancelled": scheduler.cancelled,
            }
        )

    async def list_models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> Response:
        authorize(request)
        name = request.path_params["model"]
        if name != state.model_id:
            raise ApiError(
                404,
                f"The model {name!r} does not exist: this server has {state.model_id!r}.",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(model_card())

    async def chat_completions(request: Request) -> Response:
        authorize(request)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, "The request body is too large.")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"The request body is not valid JSON: {err}.") from None
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "'model' is required.", param="model")
        if model != state.model_id:
            raise ApiError(
                404,
                f"The model {model!r} does not exist: this server has {state.model_id!r}.",
                param="model",
                code="model_not_found",
            )
        for key in _UNSUPPORTED:
            if body.get(key):
                raise ApiError(400, f"'{key}' is not supported by llmchat serve.", param=key)
        if body.get("n", 1) not in (1, None):
            raise ApiError(400, "Only n=1 is supported.", param="n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false.", param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ApiError(400, "'stream_options' must be an object.", param="stream_options")
        include_usage = bool(options.get("include_usage"))
        messages = parse_messages(body.get("messages"))
        # None: the engine counts only inside the request (MLC's); it then refuses a prompt too long
        prompt_tokens = await asyncio.to_thread(engine.count_prompt_tokens, messages)
        ctx = engine.info.context_window
        if prompt_tokens is not None and prompt_tokens >= ctx:
            raise ApiError(
                400,
                f"This model's context window is {ctx} tokens; the messages are {prompt_tokens} tokens.",
                param="messages",
                code="context_length_exceeded",
            )
        params = parse_sampling(body, ctx - (prompt_tokens or 0))
        job = Job(messages, params, asyncio.get_running_loop())
        try:
            state.scheduler.submit(job)
        except QueueFull as full:
            raise ApiError(
                429,
                f"The server is busy: {state.scheduler.max_queue} requests are waiting. "
                f"Retry in {full.retry_after_s} s.",
                type="server_busy",
                code="queue_full",
                headers={"Retry-After": str(full.retry_after_s)},
            ) from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if stream:
            first = None
            if prompt_tokens is None:  # a prompt the engine refuses is a 400, not a broken stream
                first = await _first_news(request, job)
                if first is None:
                    return Response(status_code=499)  # the client left while it waited
                end = first[1]
                if end is not None and end.error is not None:
                    return _error_from(end.error).response()
            return JobStream(
                job,
                _stream(
                    job,
                    request_id,
                    created,
                    state.model_id,
                    prompt_tokens,
                    include_usage,
                    state.stream_interval,
                    first,
                ),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(request, job, request_id, created, state.model_id, prompt_tokens)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        return ApiError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code)).response()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(state.scheduler.close)

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error},
        lifespan=lifespan,
    )
    app.state.llmchat = state
    return app


class JobStream(StreamingResponse):
    """A streamed reply whose job is cancelled however the response ends (finished, or the client
    gone while a chunk was being sent, where the generator itself may not see it until collected)."""

    def __init__(self, job: Job, content: AsyncIterator[str], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


def _error_from(err: BaseException) -> ApiError:
    from app.inference.api import ContextLengthExceeded

    if isinstance(err, ContextLengthExceeded):
        return ApiError(400, str(err.problem), param="messages", code="context_length_exceeded")
    if isinstance(err, LlmchatError):
        return ApiError(500, err.problem, type="server_error")
    return ApiError(500, f"The engine failed: {type(err).__name__}: {err}", type="server_error")


async def _stream(
    job: Job,
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int | None,
    include_usage: bool,
    interval: float = 0.0,
    first_news: tuple[str, JobDone | None] | None = None,
) -> AsyncIterator[str]:
    """The reply as OpenAI's chat.completion.chunk events: the role when the reply starts, its text
    (the first at once, then at most one chunk per ``interval`` seconds, each with all the text that
    came since), its end at once; leaving early (the client went) cancels it."""

    def chunk(delta: dict, reason: str | None = None) -> dict:
        return {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        }

    loop = asyncio.get_running_loop()
    role_sent = False
    not_before = 0.0  # the loop's time before which new text waits for more
    try:
        while True:
            if first_news is not None:
                (text, end), first_news = first_news, None
            else:
                text, end = await job.take(not_before)
            if not role_sent:  # the reply started: its prompt is being read, or its text came
                role_sent = True
                yield _sse(chunk({"role": "assistant", "content": ""}))
            if text:
                yield _sse(chunk({"content": text}))
                not_before = loop.time() + interval
            if end is not None:
                if end.error is not None:
                    yield _sse(_error_from(end.error).body())
                else:
                    yield _sse(chunk({}, finish_reason(end.stats)))
                    if include_usage:
                        done = {**chunk({}), "choices": [], "usage": usage(prompt_tokens, end.stats, job)}
                        yield _sse(done)
                yield "data: [DONE]\n\n"
                return
    finally:
        job.cancel.set()  # a no-op when it finished; stops it (or its wait) when the client left


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _first_news(request: Request, job: Job) -> tuple[str, JobDone | None] | None:
    """The job's first news (:meth:`Job.take`), or None when the client left first (then cancelled)."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    taker = asyncio.ensure_future(job.take())
    try:
        finished, _ = await asyncio.wait({taker, gone}, return_when=asyncio.FIRST_COMPLETED)
        if taker in finished:
            return taker.result()
        taker.cancel()
        job.cancel.set()
        return None
    finally:
        gone.cancel()


async def _complete(
    request: Request, job: Job, request_id: str, created: int, model: str, prompt_tokens: int | None
) -> Response:
    """A non-streamed reply; a client that disconnects while it waits cancels it."""
    gone = asyncio.ensure_future(_wait_disconnect(request))
    taker = asyncio.ensure_future(job.take(text=False))  # the whole text comes with the end
    try:
        finished, _ = await asyncio.wait({taker, gone}, return_when=asyncio.FIRST_COMPLETED)
        if taker not in finished:
            taker.cancel()
            job.cancel.set()
            return Response(status_code=499)  # nobody reads it
        text, end = taker.result()
        assert end is not None
        if end.error is not None:
            return _error_from(end.error).response()
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish_reason(end.stats),
                        "logprobs": None,
                    }
                ],
                "usage": usage(prompt_tokens, end.stats, job),
            }
        )
    finally:
        gone.cancel()
        job.cancel.set()
