"""`llmchat serve` as a user runs it: a real process on a loopback port, the official client, Ctrl+C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai

from app.cli import main


def test_serve_refuses_to_listen_beyond_loopback_without_a_key(capsys, monkeypatch):
    monkeypatch.delenv("LLMCHAT_SERVE_API_KEY", raising=False)
    code = main(["serve", "--host", "0.0.0.0", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1
    assert "Refusing to listen on 0.0.0.0 without an API key" in err and "--api-key" in err


def test_serve_answers_the_openai_client_and_stops_on_ctrl_c(tiny_model_dir, tiny_engine):
    model = tiny_model_dir("llama", "q4f32_1")  # tiny_engine: its library is compiled and cached
    script = Path(sys.executable).parent / "llmchat"
    env = {**os.environ, "LLMCHAT_SERVE_API_KEY": "key-from-env"}
    proc = subprocess.Popen(
        [
            str(script),
            "serve",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            "0",
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                break
        assert lines and "listening on" in lines[-1], "".join(lines)
        url = lines[-1].split("listening on ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        api = openai.OpenAI(base_url=url, api_key="key-from-env", max_retries=0, timeout=60)
        assert [m.id for m in api.models.list().data] == [model.name]
        reply = api.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=6
        )
        assert reply.usage.completion_tokens == 6
        with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as wrong:
            try:
                wrong.models.list()
                raise AssertionError("a wrong key was accepted")
            except openai.AuthenticationError:
                pass
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=30) == 0, rest
        assert "key-from-env" not in "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_with_the_mlc_engine(tiny_model_dir):
    """--engine mlc serves MLC-LLM's MLCEngine; here the STAND-IN of tests/stand_ins (on PYTHONPATH of
    the real `llmchat serve` process), as for `ask --engine mlc`."""
    from tests.conftest import STAND_INS

    model = tiny_model_dir("llama", "q4f32_1")
    script = Path(sys.executable).parent / "llmchat"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STAND_INS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [
            str(script),
            "serve",
            "--engine",
            "mlc",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            "0",
            "--log-level",
            "warning",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                break
        assert lines and "listening on" in lines[-1], "".join(lines)
        url = lines[-1].split("listening on ")[1].split()[0]
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60) as api:
            assert [m.id for m in api.models.list().data] == [model.name]
            hi = [{"role": "user", "content": "Hi"}]
            reply = api.chat.completions.create(model=model.name, messages=hi)
            assert reply.choices[0].message.content == "You said: Hi w0 w1 w2"  # the stand-in's answer
            assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (2, 6)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_with_the_mlc_engine_missing(tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlc_llm", None)
    model = tiny_model_dir("llama", "q4f32_1")
    code = main(["serve", "--engine", "mlc", "--model", str(model), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 1 and "MLC-LLM engine is not installed" in err and "mlc.ai/wheels" in err
