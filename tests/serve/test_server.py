"""``llmchat serve`` on the tiny CPU model, driven over loopback by the official ``openai`` client:
streaming and not, usage, stop strings, sampling settings, errors in OpenAI's shape, the API key,
a disconnect that frees the engine, a full queue, concurrent clients."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

from app.inference.api import Message, ReplyStats, SamplingParams, TextDelta
from tests.serve.conftest import DecodeGate, serving


def client(url: str, key: str | None = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60, **kw)


def direct(engine, prompt: str, params: SamplingParams) -> tuple[str, ReplyStats]:
    """The reply of the engine itself, in process (what the server must return)."""
    text, stats = [], None
    for event in engine.complete([Message("user", prompt)], params):
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ReplyStats):
            stats = event
    return "".join(text), stats


def post_raw(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, dict]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def completion_tokens(api: openai.OpenAI, model: str, max_tokens: int) -> int:
    reply = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=max_tokens
    )
    return reply.usage.completion_tokens


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_models_health_and_a_non_streamed_reply(engine):
    expected, stats = direct(engine, "Hello!", SamplingParams(temperature=0, max_tokens=12))
    model = engine.info.model_id
    with serving(engine) as served:
        api = client(served.url)
        assert [m.id for m in api.models.list().data] == [model]
        assert api.models.retrieve(model).id == model
        status, health = get_json(served.root + "/health")
        assert status == 200 and health["status"] == "ok" and health["model"] == model
        reply = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello!"}], temperature=0, max_tokens=12
        )
    assert reply.object == "chat.completion" and reply.model == model
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "length"
    prompt_tokens = engine.count_prompt_tokens([Message("user", "Hello!")])
    assert reply.usage.prompt_tokens == prompt_tokens
    assert reply.usage.completion_tokens == 12 == stats.generated_tokens
    assert reply.usage.total_tokens == prompt_tokens + 12
    extra = reply.usage.model_extra["extra"]
    assert extra["prefill_tokens_per_s"] > 0 and extra["decode_tokens_per_s"] > 0
    assert 0 < extra["ttft_s"] <= extra["end_to_end_latency_s"]


def test_streaming_gives_the_same_reply_then_usage(engine):
    model = engine.info.model_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with serving(engine) as served:
        api = client(served.url)
        whole = api.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=20)
        chunks = list(
            api.chat.completions.create(
                model=model,
                messages=messages,
                temperature=0,
                max_tokens=20,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stop_strings_end_the_reply_before_them(engine):
    model = engine.info.model_id
    full, _ = direct(engine, "Hello!", SamplingParams(temperature=0, max_tokens=40))
    stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if full.find(full[i : i + 3]) == i)
    with serving(engine) as served:
        api = client(served.url)
        for stream in (False, True):
            reply = api.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Hello!"}],
                temperature=0,
                max_tokens=40,
                stop=stop,
                stream=stream,
            )
            if stream:
                chunks = [c for c in reply if c.choices]
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                reason = chunks[-1].choices[0].finish_reason
            else:
                text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
            assert text == full[: full.find(stop)]
            assert reason == "stop"


def test_seed_temperature_and_penalties_reach_the_sampler(engine):
    model = engine.info.model_id

    def ask(**params) -> str:
        reply = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=30, **params
        )
        return reply.choices[0].message.content

    with serving(engine) as served:
        api = client(served.url)
        a = ask(temperature=1.2, top_p=0.9, seed=7)
        assert a == ask(temperature=1.2, top_p=0.9, seed=7)
        assert a != ask(temperature=1.2, top_p=0.9, seed=8)
        greedy = ask(temperature=0)
        penalised = ask(
            temperature=0, frequency_penalty=2.0, presence_penalty=2.0, extra_body={"repetition_penalty": 1.5}
        )
    assert greedy == direct(engine, "Hi", SamplingParams(temperature=0, max_tokens=30))[0]
    assert (
        penalised
        == direct(
            engine,
            "Hi",
            SamplingParams(
                temperature=0,
                max_tokens=30,
                frequency_penalty=2.0,
                presence_penalty=2.0,
                repetition_penalty=1.5,
            ),
        )[0]
    )
    assert penalised != greedy


def test_errors_come_in_openais_shape(engine):
    model = engine.info.model_id
    user = [{"role": "user", "content": "Hi"}]
    with serving(engine) as served:
        api = client(served.url)
        status, _, body = post_raw(served.url + "/chat/completions", b"{not json")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        assert "JSON" in body["error"]["message"]
        status, _, body = post_raw(served.url + "/chat/completions", b"[1, 2]")
        assert status == 400
        with pytest.raises(openai.BadRequestError) as bad:
            api.chat.completions.create(model=model, messages=user, temperature=5)
        assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
        with pytest.raises(openai.BadRequestError) as bad:
            api.chat.completions.create(model=model, messages=user, max_tokens=0)
        assert bad.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError) as bad:
            api.chat.completions.create(model=model, messages=user, n=2)
        assert bad.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError) as bad:
            api.chat.completions.create(model=model, messages=[*user, {"role": "assistant", "content": "x"}])
        assert bad.value.body["param"] == "messages"
        with pytest.raises(openai.NotFoundError) as missing:
            api.chat.completions.create(model="gpt-9", messages=user)
        assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            api.models.retrieve("gpt-9")
        long = "llamas and alpacas " * 200
        with pytest.raises(openai.BadRequestError) as too_long:
            api.chat.completions.create(model=model, messages=[{"role": "user", "content": long}])
        assert too_long.value.code == "context_length_exceeded"
        assert str(engine.info.context_window) in too_long.value.message
        status, body = get_json(served.url + "/no/such/route")
        assert status == 404 and body["error"]["code"] == "not_found"
        # the engine still answers after all that
        assert completion_tokens(api, model, 3) == 3


def test_api_key_is_required_when_set(engine):
    model = engine.info.model_id
    user = [{"role": "user", "content": "Hi"}]
    with serving(engine, api_key="s3cret-key") as served:
        with pytest.raises(openai.AuthenticationError) as denied:
            client(served.url, "wrong-key").models.list()
        assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(served.url, "wrong-key").chat.completions.create(model=model, messages=user, max_tokens=2)
        for headers in ({}, {"Authorization": "Basic s3cret-key"}, {"Authorization": "Bearer s3cret-ke"}):
            status, _, body = post_raw(served.url + "/chat/completions", b"{}", headers)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            assert "s3cret" not in json.dumps(body)
        status, body = get_json(served.url + "/models")
        assert status == 401
        assert get_json(served.root + "/health")[0] == 200  # health needs no key
        api = client(served.url, "s3cret-key")
        assert completion_tokens(api, model, 2) == 2


def test_a_client_that_disconnects_stops_its_reply_within_one_step(engine):
    model = engine.info.model_id
    user = [{"role": "user", "content": "Hello!"}]
    with serving(engine) as served, DecodeGate(engine, at_step=3) as gate:
        api = client(served.url)
        stream = api.chat.completions.create(
            model=model, messages=user, temperature=0, max_tokens=200, stream=True
        )
        next(iter(stream))
        assert gate.reached.wait(30)
        job = served.state.scheduler.running
        stream.close()  # the client goes away while the engine is at step 3
        assert job.cancel.wait(30), "the server did not notice the disconnect"
        gate.release.set()
        # the next request runs once the engine is free again
        after = api.chat.completions.create(model=model, messages=user, temperature=0, max_tokens=5)
    stats = job.done.stats
    assert stats.finish_reason == "cancelled"
    assert stats.generated_tokens == 4  # the token out of step 3, nothing decoded after the cancel
    assert after.usage.completion_tokens == 5
    assert served.state.scheduler.cancelled == 1


def test_a_full_queue_answers_429_with_retry_after(engine):
    model = engine.info.model_id
    user = [{"role": "user", "content": "Hi"}]
    with serving(engine, max_queue=1) as served, DecodeGate(engine, at_step=2) as gate:
        api = client(served.url)
        running = api.chat.completions.create(
            model=model, messages=user, temperature=0, max_tokens=10, stream=True
        )
        first = next(iter(running))
        assert gate.reached.wait(30)
        waiting = api.chat.completions.create(
            model=model, messages=user, temperature=0, max_tokens=10, stream=True
        )  # returns with the headers: it is queued
        assert served.state.scheduler.waiting == 1
        with pytest.raises(openai.RateLimitError) as busy:
            api.chat.completions.create(model=model, messages=user, max_tokens=10)
        assert busy.value.status_code == 429 and busy.value.code == "queue_full"
        assert int(busy.value.response.headers["retry-after"]) >= 1
        gate.release.set()
        texts = []
        for stream, head in ((running, [first]), (waiting, [])):
            chunks = head + list(stream)
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert chunks[-1].choices[0].finish_reason == "length"
        assert texts[0] == texts[1] != ""
        assert completion_tokens(api, model, 3) == 3


def test_eight_concurrent_clients_get_their_own_complete_replies(engine):
    model = engine.info.model_id
    prompts = [f"Question {i}: tell me about llamas." for i in range(8)]
    # seeded sampling: each client's reply is reproducible and differs from the others'
    expected = {
        p: direct(engine, p, SamplingParams(temperature=1.0, top_p=1.0, seed=100 + i, max_tokens=8))[0]
        for i, p in enumerate(prompts)
    }
    assert len(set(expected.values())) == len(prompts)  # so that a crossed stream would show
    results: dict[tuple[int, int], tuple[str, str | None]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for round_ in range(3):
                stream = api.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompts[i]}],
                    temperature=1.0,
                    top_p=1.0,
                    seed=100 + i,
                    max_tokens=8,
                    stream=True,
                )
                chunks = [c for c in stream if c.choices]
                results[i, round_] = (
                    "".join(c.choices[0].delta.content or "" for c in chunks),
                    chunks[-1].choices[0].finish_reason,
                )
        except BaseException as err:
            errors.append(err)

    with serving(engine) as served:
        api = client(served.url)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert served.state.scheduler.completed == 24
    assert not errors, errors
    assert len(results) == 24
    for (i, _), (text, reason) in results.items():
        assert text == expected[prompts[i]] and reason == "length"


def _raw_request(served, body: dict):
    """A chat request on a plain socket (a client that can vanish at any moment)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(served.url)
    raw = json.dumps(body).encode()
    sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


def test_non_streamed_and_queued_clients_that_leave_are_dropped(engine):
    model = engine.info.model_id
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello!"}],
        "temperature": 0,
        "max_tokens": 200,
    }
    with serving(engine) as served, DecodeGate(engine, at_step=3) as gate:
        scheduler = served.state.scheduler
        running = _raw_request(served, body)  # not streamed: the reply would come at the end
        assert gate.reached.wait(30)
        job = scheduler.running
        queued = _raw_request(served, {**body, "stream": True})
        assert queued.recv(12).startswith(b"HTTP/1.1 200")  # headers sent: it waits in the queue
        waiting = scheduler._queue[0]
        queued.close()
        running.close()
        assert job.cancel.wait(30) and waiting.cancel.wait(30)
        gate.release.set()
        after = client(served.url).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
    assert job.done.stats.finish_reason == "cancelled" and job.done.stats.generated_tokens == 4
    assert waiting.done is not None and waiting.done.stats is None  # it never ran
    assert after.usage.completion_tokens == 3
    assert scheduler.cancelled == 2


class StepCounter:
    """Counts the runtime's decode steps by path: greedy batches (``start_greedy_ahead``: token ids
    picked on the device, no logits to the host) or one step with its logits (``decode``, for the
    sampler), and whether each reply's sampler was plain greedy (a bare argmax)."""

    def __init__(self, runtime, monkeypatch) -> None:
        self.runtime = runtime
        self.monkeypatch = monkeypatch
        self.greedy_steps = 0
        self.logit_steps = 0
        self.plain_greedy: list[bool] = []

    def __enter__(self) -> StepCounter:
        from app.inference.engine import generation

        real_greedy, real_decode = self.runtime.start_greedy_ahead, self.runtime.decode
        counter = self

        def start_greedy_ahead(token, steps):
            self.greedy_steps += steps
            return real_greedy(token, steps)

        def decode(token):
            self.logit_steps += 1
            return real_decode(token)

        class Sampler(generation.Sampler):
            def __init__(self, params) -> None:
                super().__init__(params)
                counter.plain_greedy.append(self.is_plain_greedy)

        self.runtime.start_greedy_ahead = start_greedy_ahead
        self.runtime.decode = decode
        self.monkeypatch.setattr(generation, "Sampler", Sampler)
        return self

    def __exit__(self, *exc) -> None:
        del self.runtime.start_greedy_ahead, self.runtime.decode
        self.monkeypatch.undo()


def test_a_greedy_request_decodes_on_benchs_path(engine, monkeypatch):
    """``serve_bench``'s request (temperature 0, top_p 1, a seed: what its ``openai`` client sends)
    decodes as ``llmchat bench`` does: a plain greedy sampler, and the same kind of step (greedy
    batches on the device where the library has an argmax, else one step with its logits each)."""
    from app.commands.bench import measure

    device_argmax = engine.runtime.has_device_argmax
    with StepCounter(engine.runtime, monkeypatch) as bench:
        tokens = measure(engine, 0, 0, 24, warmup=0)["generated_tokens"]
    assert bench.plain_greedy == [True]
    # the 1-token prompt is one step with logits (its first token), then one step per token
    assert bench.logit_steps == (1 if device_argmax else tokens)
    assert (bench.greedy_steps >= tokens - 1) if device_argmax else bench.greedy_steps == 0
    with serving(engine) as served, StepCounter(engine.runtime, monkeypatch) as server:
        stream = client(served.url).chat.completions.create(
            model=engine.info.model_id,
            messages=[{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
            stream=True,
            temperature=0,
            top_p=1,
            seed=1,
            max_tokens=24,
            stream_options={"include_usage": True},
        )
        (usage,) = [chunk.usage for chunk in stream if chunk.usage is not None]  # read to its end
    served_tokens = usage.completion_tokens
    assert served_tokens > 1
    assert server.plain_greedy == [True]
    # the prompt is prefilled in chunks (its logits give the first token), then one step per token
    assert server.logit_steps == (0 if device_argmax else served_tokens - 1)
    assert (server.greedy_steps >= served_tokens - 1) if device_argmax else server.greedy_steps == 0
