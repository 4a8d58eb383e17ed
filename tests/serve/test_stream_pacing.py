"""How a streamed reply's text reaches the client: the first text at once, then at most one chunk per
``stream_interval`` with everything that came meanwhile, the end at once — the same text as the engine
gives in process. Real ``llmchat serve`` app on loopback, the official ``openai`` client, the tiny CPU
model; the job's mailbox itself on a real event loop and a real worker thread."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import openai
import pytest

from app.inference.api import Message, PrefillProgress, SamplingParams, TextDelta
from app.serve.scheduler import Job, JobDone
from app.serve.server import DEFAULT_STREAM_INTERVAL_S
from tests.serve.conftest import DecodeGate, serving
from tests.serve.test_server import direct

USER = [{"role": "user", "content": "Hello!"}]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, max_tokens=max_tokens, repetition_penalty=1.0)


def content_chunks(chunks) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def test_first_text_at_once_the_rest_gathers_and_the_end_comes_at_once(engine):
    model = engine.info.model_id
    expected, stats = direct(engine, "Hello!", greedy(24))
    assert stats.generated_tokens == 24 and len(expected) > 3  # a reply long enough to gather
    # an interval longer than the test: only the first text and the end may end a wait
    with serving(engine, stream_interval=30.0) as served, DecodeGate(engine, at_step=6) as gate:
        api = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
        started = time.monotonic()
        stream = api.chat.completions.create(
            model=model,
            messages=USER,
            temperature=0,
            top_p=1,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = []
        for chunk in stream:  # while the engine is held at its 6th decode step
            chunks.append(chunk)
            if content_chunks(chunks):
                break
        assert gate.reached.wait(30) and not gate.release.is_set()
        assert len(content_chunks(chunks)) == 1  # sent before the engine went on
        gate.release.set()
        chunks += list(stream)
        took = time.monotonic() - started
    texts = content_chunks(chunks)
    assert "".join(texts) == expected
    assert len(texts) == 2  # the first text, then all the rest with the end
    assert took < 20  # the end did not wait for the 30 s interval
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_chunks_come_at_most_once_per_interval_with_all_the_text(engine):
    model = engine.info.model_id
    expected, _ = direct(engine, "Hello!", greedy(40))
    interval = 0.2
    real = engine.runtime.decode

    def slow_decode(token):  # ~40 steps of 25 ms: the reply spans several intervals
        time.sleep(0.025)
        return real(token)

    engine.runtime.decode = slow_decode
    try:
        with serving(engine, stream_interval=interval) as served:
            api = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
            started = time.monotonic()
            chunks = list(
                api.chat.completions.create(
                    model=model, messages=USER, temperature=0, top_p=1, max_tokens=40, stream=True
                )
            )
            took = time.monotonic() - started
    finally:
        del engine.runtime.decode
    texts = content_chunks(chunks)
    assert "".join(texts) == expected
    assert took > 0.9  # 40 decode steps of at least 25 ms
    # the first text, then at most one chunk per interval, then the end's
    assert 2 <= len(texts) <= 2 + took / interval
    assert len(texts) < 30  # far fewer chunks than tokens


def test_interval_zero_sends_text_as_soon_as_the_loop_takes_it(engine):
    """``--stream-interval 0``: no gathering on purpose. Each decode step here waits (up to 5 s) for
    the loop to take the text before it, so every piece of text is a chunk of its own; the wait
    shows how long the server held the text: next to nothing with 0, the interval otherwise."""
    import statistics

    model = engine.info.model_id
    per_step = [
        e.text for e in engine.complete([Message("user", "Hello!")], greedy(8)) if isinstance(e, TextDelta)
    ]
    assert len(per_step) > 2
    real = engine.runtime.decode

    def run(interval: float) -> tuple[list[str], list[float]]:
        waits: list[float] = []

        def handed_over(token):
            job = served.state.scheduler.running
            started = time.monotonic()
            while job._text and time.monotonic() - started < 5:
                time.sleep(0.002)
            waits.append(time.monotonic() - started)
            return real(token)

        engine.runtime.decode = handed_over
        try:
            with serving(engine, stream_interval=interval) as served:
                api = openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
                chunks = list(
                    api.chat.completions.create(
                        model=model, messages=USER, temperature=0, top_p=1, max_tokens=8, stream=True
                    )
                )
        finally:
            del engine.runtime.decode
        return content_chunks(chunks), waits

    texts, waits = run(0)
    assert texts == per_step
    assert statistics.median(waits) < 0.1  # taken as it came
    held_texts, held = run(0.3)
    assert held_texts == per_step and statistics.median(held) > 0.2  # the same, held for the interval


# -- the mailbox -------------------------------------------------------------------------------
class CountingLoop:
    """A real event loop whose cross-thread wake-ups (``call_soon_threadsafe``) are counted."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups = 0
        real = self.loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            self.wakeups += 1
            return real(*args, **kwargs)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.close()


@pytest.fixture
def counting_loop():
    loop = CountingLoop()
    yield loop
    loop.close()


def _job(loop) -> Job:
    return Job([], SamplingParams(), loop)


def test_text_gathers_without_waking_the_loop_until_its_time(counting_loop):
    job = _job(counting_loop.loop)

    async def scenario():
        loop = asyncio.get_running_loop()
        job.post(PrefillProgress(0, 5, 0.0))
        assert await job.take() == ("", None)  # the reply started: the wait ends at once
        hold_until = loop.time() + 0.3
        worker = threading.Thread(target=lambda: [job.post(TextDelta(f"{i} ")) for i in range(50)])
        worker.start()
        text, end = await job.take(hold_until)
        worker.join()
        return loop.time() - hold_until, text, end

    late, text, end = counting_loop.run(scenario())
    assert late >= -0.002 and end is None  # not before the time given
    assert text == "".join(f"{i} " for i in range(50))
    assert counting_loop.wakeups == 0  # 50 pieces of text, the loop never woken for them


def test_the_end_ends_any_wait_and_a_whole_reply_waits_only_for_it(counting_loop):
    job = _job(counting_loop.loop)
    done = JobDone(None, None)

    async def gathering():
        loop = asyncio.get_running_loop()
        job.post(TextDelta("a"))
        assert await job.take() == ("a", None)

        def worker():
            time.sleep(0.05)
            job.post(TextDelta("b"))
            job.post(done)

        threading.Thread(target=worker).start()
        t0 = loop.time()
        text, end = await job.take(loop.time() + 60)
        return loop.time() - t0, text, end

    waited, text, end = counting_loop.run(gathering())
    assert (text, end) == ("b", done) and waited < 30
    assert counting_loop.wakeups == 1  # the end only

    whole = _job(counting_loop.loop)

    async def whole_reply():
        def worker():
            for piece in ("x", "y", "z"):
                time.sleep(0.02)
                whole.post(TextDelta(piece))
            whole.post(done)

        threading.Thread(target=worker).start()
        return await whole.take(text=False)

    assert counting_loop.run(whole_reply()) == ("xyz", done)
    assert counting_loop.wakeups == 2


def test_once_its_time_has_come_the_next_text_wakes_the_loop(counting_loop):
    job = _job(counting_loop.loop)

    async def scenario():
        loop = asyncio.get_running_loop()
        job.post(TextDelta("first"))
        assert await job.take() == ("first", None)

        def worker():
            time.sleep(0.1)
            job.post(TextDelta("next"))

        threading.Thread(target=worker).start()
        return await job.take(loop.time() + 0.01)  # its time passes before the text comes

    assert counting_loop.run(scenario()) == ("next", None)
    assert counting_loop.wakeups == 1


def test_serve_checks_its_stream_interval(capsys):
    from app.cli import build_parser, main

    with pytest.raises(SystemExit) as bad:
        main(["serve", "--stream-interval", "-1"])
    assert bad.value.code == 2
    assert "'-1' is not a time in seconds from 0 to 10" in capsys.readouterr().err
    parser = build_parser()
    serve = next(
        action.choices["serve"]
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    help_text = serve.format_help()
    assert f"(default {DEFAULT_STREAM_INTERVAL_S}; 0:" in " ".join(help_text.split())
    assert serve.parse_args(["--stream-interval", "0"]).stream_interval == 0.0
