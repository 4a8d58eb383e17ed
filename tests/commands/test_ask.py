"""`llmchat ask`: the reply on stdout, progress on stderr, clear errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.cli import main
from app.inference.api import TextDelta
from app.inference.engine.model_defaults import model_sampling


def test_ask_streams_the_greedy_reply(tiny_model_dir, tiny_engine, capsys):
    model = tiny_model_dir("llama", "q4f32_1")
    code = main(
        [
            "ask",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--max-tokens",
            "10",
            "--stats",
            "Hello! How are you?",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    tiny_engine.set_system_prompt(None)
    # the flags given override the model's defaults (here: its config's, plus the repetition guard)
    params = replace(model_sampling(model).params, temperature=0, max_tokens=10)
    assert params.repetition_penalty == 1.1
    expected = "".join(
        e.text for e in tiny_engine.chat("Hello! How are you?", params) if isinstance(e, TextDelta)
    )
    tiny_engine.reset()
    assert out == expected + "\n"
    assert "[load]" in err and "prefill:" in err and "decode:" in err


def test_ask_penalty_flags_reach_the_sampler(tiny_model_dir, tiny_engine, capsys):
    model = tiny_model_dir("llama", "q4f32_1")
    code = main(
        [
            "ask",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "--repetition-penalty",
            "1",
            "--repeat-last-n",
            "8",
            "--presence-penalty",
            "0.5",
            "Hello! How are you?",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    params = replace(
        model_sampling(model).params,
        temperature=0,
        max_tokens=12,
        repetition_penalty=1.0,
        repeat_last_n=8,
        presence_penalty=0.5,
    )
    tiny_engine.set_system_prompt(None)
    tiny_engine.reset()
    expected = "".join(
        e.text for e in tiny_engine.chat("Hello! How are you?", params) if isinstance(e, TextDelta)
    )
    tiny_engine.reset()
    assert out == expected + "\n"


def test_ask_model_before_subcommand_and_prompt_from_stdin(tiny_model_dir, capsys, monkeypatch):
    import io

    model = tiny_model_dir("llama", "q4f32_1")
    monkeypatch.setattr("sys.stdin", io.StringIO("Tell me about llamas.\n"))
    code = main(["--model", str(model), "--device", "cpu", "ask", "--temperature", "0", "--max-tokens", "4"])
    out, _ = capsys.readouterr()
    assert code == 0 and out.endswith("\n")


def test_ask_unknown_model_suggests_download(capsys):
    code = main(["ask", "--model", "not-a-model", "--device", "cpu", "hi"])
    err = capsys.readouterr().err
    assert code == 1
    assert "not installed" in err and "llmchat download not-a-model" in err


def test_ask_on_rocm_where_it_cannot_run(tiny_model_dir, capsys):
    """llmchat's ROCm runtime without HIP or without a GPU: the reason and a fix, exit 1."""
    from app.inference.backends import hip

    if hip.problem(0) is None:
        pytest.skip("ROCm runs here")
    code = main(["ask", "--model", str(tiny_model_dir("llama", "q4f32_1")), "--device", "rocm", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "Cannot use --device rocm:0" in err and "fix:" in err and "--device cpu" in err


def test_ask_bad_sampling_value(tiny_model_dir, capsys):
    code = main(
        ["ask", "--model", str(tiny_model_dir("llama", "q4f32_1")), "--device", "cpu", "--top-p", "0", "hi"]
    )
    assert code == 1
    assert "top_p" in capsys.readouterr().err


def test_ask_with_mlc_engine_stand_in(tiny_model_dir, capsys, mlc_stand_in):
    """--engine mlc drives MLC-LLM's MLCEngine; here the STAND-IN module of tests/stand_ins (the real
    package is only on MLC's own wheel index and cannot be installed where the tests run)."""
    code = main(
        [
            "ask",
            "--engine",
            "mlc",
            "--model",
            str(tiny_model_dir("llama", "q4f32_1")),
            "--device",
            "cpu",
            "--max-tokens",
            "3",
            "hello there",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("You said: hello")


def test_ask_with_mlc_engine_missing_package(tiny_model_dir, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mlc_llm", None)
    code = main(["ask", "--engine", "mlc", "--model", str(tiny_model_dir("llama", "q4f32_1")), "hi"])
    assert code == 1 and "mlc.ai/wheels" in capsys.readouterr().err


def test_unusable_device_fails_before_the_default_model_is_fetched(capsys):
    """`llmchat ask --device rocm` where ROCm cannot run: a clear error, and nothing downloaded first."""
    from app.inference.backends import hip
    from app.paths import cache_dir, models_dir

    if hip.problem(0) is None:
        pytest.skip("ROCm runs here")
    code = main(["ask", "--device", "rocm", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "ROCm" in err
    assert "[download]" not in err
    assert not (models_dir() / "smollm2-135m-instruct").exists()
    assert not any((cache_dir() / "wheels").glob("*.whl"))


def test_progress_lines_are_throttled_per_stage(capsys):
    from app.commands.ask import StderrProgress
    from app.inference.api import ProgressEvent

    progress = StderrProgress(interval_s=60)
    progress(ProgressEvent("import", "reading the file"))
    for i in range(100):
        progress(ProgressEvent("import", f"converting tensor {i}", i, 100))
    progress(ProgressEvent("import", "imported", 100, 100))
    progress(ProgressEvent("compile", "compiling for cpu:0", 0, 3))
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "[import] reading the file",
        "[import] imported 100%",
        "[compile] compiling for cpu:0 0%",
    ]


LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # several 32-token prefill chunks
PROGRESS_LINE = r"reading the prompt: ([\d,]+) / ([\d,]+) tokens · [\d,]+ tok/s · ~\d+ s left"


def test_ask_prefill_progress_goes_to_stderr_only_when_asked(tiny_model_dir, capsys):
    """#18 item 4: stderr is not a terminal here: progress lines only with --progress, never on stdout."""
    import re

    model = str(tiny_model_dir("llama", "q4f32_1"))
    base = ["ask", "--model", model, "--device", "cpu", "--temperature", "0", "--max-tokens", "6"]
    assert main([*base, LONG_PROMPT]) == 0
    quiet_out, quiet_err = capsys.readouterr()
    assert "reading the prompt" not in quiet_err
    assert main([*base, "--progress", LONG_PROMPT]) == 0
    out, err = capsys.readouterr()
    assert out == quiet_out and "reading" not in out  # the reply alone on stdout
    lines = [m.groups() for m in re.finditer(PROGRESS_LINE, err)]
    assert len(lines) >= 3
    done = [int(d.replace(",", "")) for d, _ in lines]
    assert done == sorted(done) and done[0] == 32 and len({t for _, t in lines}) == 1


def test_ask_prefill_progress_on_a_terminal_is_one_line_erased_before_the_reply(tiny_model_dir):
    """stderr a real terminal (a pty), stdout a pipe: the progress line is rewritten in place and
    erased; stdout gets the reply only."""
    import os
    import pty
    import re
    import subprocess
    import sys

    model = str(tiny_model_dir("llama", "q4f32_1"))
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "ask",
            "--model",
            model,
            "--device",
            "cpu",
            "--temperature",
            "0",
            "--max-tokens",
            "6",
            LONG_PROMPT,
        ],
        stdout=subprocess.PIPE,
        stderr=follower,
        stdin=subprocess.DEVNULL,
    )
    os.close(follower)
    err = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        err += chunk
    out = proc.stdout.read()
    assert proc.wait(60) == 0
    os.close(leader)
    text = err.decode()
    assert re.search(r"\r\x1b\[K" + PROGRESS_LINE, text), text
    assert text.rstrip("\r\n").endswith("\r\x1b[K")  # erased before the reply
    assert b"reading" not in out and out.endswith(b"\n") and len(out) > 1


def test_ask_a_saved_server_by_name(tiny_engine, capsys, monkeypatch):
    """``ask --model server:NAME`` as the chat's: the saved endpoint, model and key (kept in the 0600 file
    here: no keyring), against a real ``llmchat serve`` that needs the key."""
    from app.inference.api import Message, SamplingParams
    from app.inference.store.saved_servers import save_server
    from tests.serve.conftest import serving

    monkeypatch.delenv("LLMCHAT_API_KEY", raising=False)
    tiny_engine.set_system_prompt(None)
    tiny_engine.reset()
    params = SamplingParams(temperature=0, top_p=1, max_tokens=12, repetition_penalty=1)
    expected = "".join(
        e.text for e in tiny_engine.complete([Message("user", "Hello!")], params) if isinstance(e, TextDelta)
    )
    flags = ["--temperature", "0", "--top-p", "1", "--max-tokens", "12", "--repetition-penalty", "1"]
    with serving(tiny_engine, api_key="s3cret") as served:
        save_server("box", served.url, tiny_engine.info.model_id, "s3cret")
        code = main(["ask", "--model", "server:box", *flags, "--stats", "Hello!"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert out == expected + "\n" and expected
        assert "decode:" in err and "server: " in err and "12 completion tokens" in err
        assert "s3cret" not in out + err
        assert served.state.scheduler.completed == 1
        # the model given before the subcommand, as with local models
        assert main(["--model", "server:box", "ask", *flags, "Hello!"]) == 0
        assert capsys.readouterr().out == expected + "\n"
        # a name that is not saved: the saved ones are named, and where to add one
        assert main(["ask", "--model", "server:nobody", "Hello!"]) == 1
        err = capsys.readouterr().err
        assert "There is no saved server 'nobody' (saved: box)." in err
        assert "fix: add it in llmchat's models screen (F2, then a: add a server)" in err
        # a saved server and --endpoint at once
        assert main(["ask", "--model", "server:box", "--endpoint", served.url, "Hello!"]) == 1
        err = capsys.readouterr().err
        assert "--endpoint and --model server:box both name a server" in err and "fix: drop --endpoint" in err
        assert served.state.scheduler.completed == 2
    tiny_engine.reset()


def test_local_only_commands_refuse_a_saved_server(capsys):
    assert main(["bench", "--model", "server:box", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "server:box is a saved server: this command runs a model on this machine." in err
    assert "llmchat ask --model server:box" in err
    assert main(["serve", "--model", "server:box", "--device", "cpu", "--port", "0"]) == 1
    assert "server:box is a saved server" in capsys.readouterr().err
