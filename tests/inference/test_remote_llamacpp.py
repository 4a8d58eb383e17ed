"""The remote engine against a real third-party server: llama.cpp's OpenAI-compatible server from PyPI
(``llama-cpp-python[server]``, built by ``make .venv-llamacpp/bin/python`` into a virtual environment
of its own: it pins its own FastAPI stack) serving a tiny GGUF on the CPU, over loopback."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from app.errors import LlmchatError
from app.inference.api import Message, ReplyStats, SamplingParams, TextDelta
from app.inference.engine.remote import RemoteEngine
from tests.inference.tiny_gguf import write_tiny_gguf

ROOT = Path(__file__).resolve().parents[2]
#: the interpreter that has llama_cpp.server: $LLMCHAT_LLAMA_CPP_PYTHON, else the Makefile's venv
PYTHON = Path(os.environ.get("LLMCHAT_LLAMA_CPP_PYTHON") or ROOT / ".venv-llamacpp" / "bin" / "python")


@contextlib.contextmanager
def llama_cpp_server(gguf: Path, *args: str) -> Iterator[str]:
    """``python -m llama_cpp.server`` on a free loopback port; its base URL once it listens."""
    if not PYTHON.exists():
        pytest.skip(f"llama.cpp's server is not installed ({PYTHON}): make .venv-llamacpp/bin/python")
    proc = subprocess.Popen(
        [
            str(PYTHON),
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--n_ctx",
            "128",
            "--verbose",
            "False",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in proc.stderr:  # uvicorn says where it listens
            seen.append(line)
            if "Uvicorn running on " in line:
                break
        else:
            raise AssertionError("llama.cpp's server did not start:\n" + "".join(seen[-30:]))
        yield line.split("Uvicorn running on ")[1].split()[0] + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("llamacpp") / "tiny.gguf")


def run(events) -> tuple[list[str], ReplyStats | None]:
    pieces, stats = [], None
    for event in events:
        if isinstance(event, TextDelta):
            pieces.append(event.text)
        elif isinstance(event, ReplyStats):
            stats = event
    return pieces, stats


def test_chat_with_llama_cpp_server(gguf):
    greedy = SamplingParams(temperature=0, max_tokens=24, seed=1)
    with llama_cpp_server(gguf) as url:
        remote = RemoteEngine(url)
        try:
            assert remote.info.model_id == str(gguf)  # llama.cpp names the model by its path
            pieces, stats = run(remote.chat("hello world", greedy))
            text = "".join(pieces)
            # the same request through the openai client directly (streamed: llama-cpp-python's
            # stream drops a character split across tokens that its non-streamed reply has)
            direct = openai.OpenAI(base_url=url, api_key="none", max_retries=0)

            def streamed(messages: list[dict]) -> tuple[str, str | None]:
                chunks = [
                    c
                    for c in direct.chat.completions.create(
                        model=str(gguf), messages=messages, temperature=0, max_tokens=24, seed=1, stream=True
                    )
                    if c.choices
                ]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
                finish = finish[-1] if finish else None
                return "".join(c.choices[0].delta.content or "" for c in chunks), finish

            expected, finish = streamed([{"role": "user", "content": "hello world"}])
            assert text == expected
            assert stats.finish_reason == ("length" if finish == "length" else "stop")
            assert stats.time_to_first_token_s > 0 and stats.generated_tokens >= 1
            assert remote.history == [Message("user", "hello world"), Message("assistant", text)]
            # the next turn carries the conversation
            pieces2, _ = run(remote.chat("more", greedy))
            assert (
                "".join(pieces2)
                == streamed(
                    [
                        {"role": "user", "content": "hello world"},
                        {"role": "assistant", "content": text},
                        {"role": "user", "content": "more"},
                    ]
                )[0]
            )
            direct.close()
            # cancel mid-stream (Esc): the stream closes, what arrived is kept
            remote.reset()
            kept = []
            events = remote.chat("hello world", SamplingParams(temperature=0, max_tokens=100))
            for event in events:
                if isinstance(event, TextDelta):
                    kept.append(event.text)
                    remote.cancel()
                elif isinstance(event, ReplyStats):
                    assert event.finish_reason == "cancelled"
            assert kept and remote.history[-1] == Message("assistant", "".join(kept))
            assert "".join(kept) == text[: len("".join(kept))]
        finally:
            remote.close()


def test_llama_cpp_server_keys(gguf, monkeypatch):
    monkeypatch.delenv("LLMCHAT_API_KEY", raising=False)
    with llama_cpp_server(gguf, "--api_key", "llama-key") as url:
        with pytest.raises(LlmchatError, match="needs an API key"):
            RemoteEngine(url)
        with pytest.raises(LlmchatError, match="refused the API key") as wrong:
            RemoteEngine(url, api_key="not-the-key")
        assert "not-the-key" not in str(wrong.value)
        remote = RemoteEngine(url, api_key="llama-key")
        assert run(remote.chat("hello", SamplingParams(temperature=0, max_tokens=4)))[1] is not None
        remote.close()
