"""Slash-command parsing: commands, aliases, plain messages and unknown commands."""

from __future__ import annotations

import pytest

from app.chat_commands import COMMANDS, Command, help_text, message_text, parse
from app.errors import LlmchatError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/help", Command("help")),
        ("  /stats  ", Command("stats")),
        ("/set temperature=0.5; top_p=0.9", Command("set", "temperature=0.5; top_p=0.9")),
        ("/system You are terse.", Command("system", "You are terse.")),
        ("/model smollm2-135m-instruct", Command("model", "smollm2-135m-instruct")),
        ("/MODEL", Command("model")),
        ("/quit", Command("exit")),
        ("/clear", Command("reset")),
        ("/export /tmp/chat.md", Command("export", "/tmp/chat.md")),
        ("/system\nline two", Command("system", "line two")),
    ],
)
def test_commands_parse(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("text", ["hello", "what is 1/2?", "  path /usr/bin", "//etc is a folder", ""])
def test_plain_messages_are_not_commands(text):
    assert parse(text) is None


def test_double_slash_sends_literal_slash():
    assert message_text("//etc is a folder") == "/etc is a folder"
    assert message_text("  hi  ") == "hi"


def test_unknown_command_hints_the_closest_and_help():
    with pytest.raises(LlmchatError) as info:
        parse("/stat")
    assert "/stat" in info.value.problem
    assert "/stats" in info.value.fix
    assert "/help" in info.value.fix


def test_unknown_command_without_a_close_match_still_hints_help():
    with pytest.raises(LlmchatError) as info:
        parse("/xyzzy now")
    assert "did you mean" not in info.value.fix
    assert "/help" in info.value.fix


def test_help_lists_every_command_and_the_keys():
    text = help_text([("esc", "stop the reply")])
    for spec in COMMANDS:
        assert spec.usage in text
    assert "stop the reply" in text
