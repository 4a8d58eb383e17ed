"""The installed console script and its subcommands."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app import __version__
from app.cli import SUBCOMMANDS, main

EXPECTED = ["doctor", "models", "download", "ask", "bench", "serve"]


def _llmchat() -> str:
    """The console script of the environment running the tests."""
    beside = Path(sys.executable).parent / "llmchat"
    return str(beside) if beside.exists() else (shutil.which("llmchat") or "llmchat")


def test_console_script_help_lists_subcommands():
    out = subprocess.run([_llmchat(), "--help"], capture_output=True, text=True, check=True).stdout
    for name in EXPECTED:
        assert name in out, f"{name} missing from llmchat --help"


def test_version():
    out = subprocess.run([_llmchat(), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"llmchat {__version__}"


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"llmchat {name}" in capsys.readouterr().out


def test_unknown_subcommand_fails(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code != 0
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["ask", "bench", "serve"])
@pytest.mark.parametrize("value", ["0", "-5", "1"])
def test_a_context_window_below_two_tokens_is_refused_never_the_default(command, value, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--context-window", value, *(["hi"] if command == "ask" else [])])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --context-window: {value} tokens is too small" in err
    assert "leave it out for the model's default" in err
