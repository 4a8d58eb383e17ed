"""The debug log (issue 19, "Also 3"): a swallowed exception is written to debug.log in the cache
directory, and --verbose also prints it on stderr."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import debug_log
from app.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LLMCHAT_CONFIG_DIR", str(tmp_path / "config"))
    debug_log.close()
    yield tmp_path / "cache"
    debug_log.close()


def test_the_probe_fallback_to_the_cpu_is_logged_and_printed_with_verbose(cache, monkeypatch, capsys):
    from app.inference import hardware
    from app.inference.hardware import device_spec as devices

    def broken_probe(*args, **kwargs):
        raise RuntimeError("sysfs exploded")

    monkeypatch.setattr(hardware, "probe", broken_probe)
    monkeypatch.setattr(hardware, "shared_probe", broken_probe)  # what --device auto asks (once per process)
    debug_log.setup(verbose=True)
    assert devices.resolve_device("auto").backend == "cpu"
    for handler in debug_log.log.handlers:
        handler.flush()
    text = (cache / "debug.log").read_text()
    assert "the hardware probe failed: --device auto falls back to the CPU" in text
    assert "RuntimeError: sysfs exploded" in text  # with the traceback
    assert "falls back to the CPU" in capsys.readouterr().err


def test_without_verbose_nothing_is_printed(cache, capsys):
    debug_log.setup(verbose=False)
    debug_log.log.info("a quiet fallback")
    assert "a quiet fallback" not in capsys.readouterr().err
    for handler in debug_log.log.handlers:
        handler.flush()
    assert "a quiet fallback" in (cache / "debug.log").read_text()


def test_cli_verbose_on_a_subcommand_and_a_read_only_cache(cache, tmp_path):
    assert main(["models", "--verbose", "--memory", "4"]) == 0
    assert any(getattr(h, "_llmchat_verbose", False) for h in debug_log.log.handlers)
    assert (cache / "debug.log").is_file()
    debug_log.close()
    # a cache directory that cannot be written: no log file, no error
    env = {
        **os.environ,
        "LLMCHAT_CACHE_DIR": "/proc/llmchat-cache",
        "LLMCHAT_DATA_DIR": str(tmp_path / "d"),
        "LLMCHAT_CONFIG_DIR": str(tmp_path / "c"),
    }
    out = subprocess.run(
        [sys.executable, "-m", "app", "--verbose", "models", "--memory", "4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert logging.getLogger("llmchat") is debug_log.log


def _llmchat(args: list[bytes], stdin: bytes | None, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "LLMCHAT_CACHE_DIR": str(tmp_path / "c"),
        "LLMCHAT_DATA_DIR": str(tmp_path / "d"),
        "LLMCHAT_CONFIG_DIR": str(tmp_path / "cfg"),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    return subprocess.run(
        [sys.executable.encode(), b"-m", b"app", *args],
        cwd=REPO,
        env=env,
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def test_invalid_utf8_in_an_argument_or_on_stdin_is_a_message(tmp_path):
    """Once `TypeError: TextInputSequence must be str` from deep inside the tokenizer."""
    out = _llmchat([b"ask", b"--model", b"nothing", b"caf\xe9 au lait"], None, tmp_path)
    err = out.stderr.decode()
    assert out.returncode == 1 and "Traceback" not in err
    assert "argument 4" in err and "is not valid UTF-8 (byte 0xe9 at offset 3)" in err and "fix:" in err
    out = _llmchat([b"ask", b"--model", b"nothing"], b"caf\xe9 au lait\n", tmp_path)
    err = out.stderr.decode()
    assert out.returncode == 1 and "Traceback" not in err
    assert "the prompt read from stdin is not valid UTF-8 (byte 0xe9 at offset 3)" in err
