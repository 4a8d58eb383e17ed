"""``llmchat serve --engine mlc``: the server on MLC-LLM's MLCEngine, driven by the official ``openai``
client over loopback. As for ``ask --engine mlc``, MLCEngine is the STAND-IN of tests/stand_ins (MLC's
wheels are only on MLC's own index); the server, the client and the HTTP path are the real ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from app.inference.engine.mlc_engine import MLCLLMEngine
from tests.serve.conftest import serving


@pytest.fixture
def mlc_engine(tmp_path: Path, mlc_stand_in):
    directory = tmp_path / "Tiny-q4f16_1-MLC"
    directory.mkdir()
    (directory / "mlc-chat-config.json").write_text(
        json.dumps({"model_type": "llama", "quantization": "q4f16_1", "context_window_size": 40})
    )
    engine = MLCLLMEngine(directory, device="cpu", model_id="tiny-mlc")
    yield engine
    engine.close()


def test_streamed_and_whole_replies_with_usage(mlc_engine):
    with serving(mlc_engine) as served, openai.OpenAI(base_url=served.url, api_key="x", max_retries=0) as api:
        assert [m.id for m in api.models.list().data] == ["tiny-mlc"]
        messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hello there"}]
        whole = api.chat.completions.create(model="tiny-mlc", messages=messages, max_tokens=50)
        assert whole.choices[0].message.content == "You said: hello there w0 w1 w2"
        assert whole.choices[0].finish_reason == "stop"
        # MLC counted the prompt: <|system|> Be kind. <|user|> hello there
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (6, 7)
        assert whole.usage.model_extra["extra"]["decode_tokens_per_s"] > 0
        chunks = list(
            api.chat.completions.create(
                model="tiny-mlc",
                messages=messages,
                stream=True,
                max_tokens=4,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "You said: hello there"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (6, 4)
        # the stand-in received what the client sent, sampling included
        sent = mlc_engine._engine.requests[-1].kwargs
        assert sent["messages"] == messages and sent["max_tokens"] == 4
    assert mlc_engine.history == []  # the engine's own conversation is not the server's


def test_a_prompt_beyond_the_context_window_is_a_400(mlc_engine):
    long = " ".join(["word"] * 60)  # the stand-in's window: 40 words
    with serving(mlc_engine) as served, openai.OpenAI(base_url=served.url, api_key="x", max_retries=0) as api:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                api.chat.completions.create(
                    model="tiny-mlc", messages=[{"role": "user", "content": long}], stream=stream
                )
            assert err.value.code == "context_length_exceeded"
            assert "61 tokens long; the context window holds 40" in err.value.message
        ok = api.chat.completions.create(model="tiny-mlc", messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content == "You said: hi w0 w1 w2"


def test_a_client_that_leaves_stops_its_reply(mlc_engine, mlc_stand_in, monkeypatch):
    monkeypatch.setattr(mlc_stand_in, "CHUNK_DELAY_S", 0.05)
    echo = " ".join(f"x{i}" for i in range(30))  # a 35-chunk reply: 1.75 s
    with serving(mlc_engine) as served, openai.OpenAI(base_url=served.url, api_key="x", max_retries=0) as api:
        stream = api.chat.completions.create(
            model="tiny-mlc", messages=[{"role": "user", "content": echo}], stream=True
        )
        got = 0
        for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got == 3:
                break
        stream.close()
        request = mlc_engine._engine.requests[-1]
        deadline = time.monotonic() + 10
        while not (request.closed and served.state.scheduler.cancelled == 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert request.closed and served.state.scheduler.cancelled == 1
        assert mlc_engine.last_stats.finish_reason == "cancelled"
        assert mlc_engine.last_stats.generated_tokens < 20  # stopped early, not run to the end
        # the engine is free for the next client
        ok = api.chat.completions.create(model="tiny-mlc", messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content == "You said: hi w0 w1 w2"
