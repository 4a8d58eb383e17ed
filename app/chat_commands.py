"""Slash commands typed into the chat input: parsing and help text (no UI, no engine).

``parse("hello")`` is ``None`` (a message for the model); ``parse("/set temperature=0.5")`` is
``Command("set", "temperature=0.5")``; an unknown command raises ``LlmchatError`` with a hint, so it is
never sent to the model. ``//text`` sends the literal text ``/text`` to the model.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from app.errors import LlmchatError


@dataclass(frozen=True)
class CommandSpec:
    """One slash command as listed by /help and the command palette."""

    name: str
    usage: str
    help: str


@dataclass(frozen=True)
class Command:
    """A parsed slash command: its canonical name and the rest of the line."""

    name: str
    arg: str = ""


COMMANDS: tuple[CommandSpec, ...] = (
    CommandSpec("help", "/help", "list the commands and keys"),
    CommandSpec("stats", "/stats", "speed of the last reply, session totals, device, backend, memory"),
    CommandSpec("reset", "/reset", "clear the conversation and the KV cache (starts a new conversation)"),
    CommandSpec(
        "set",
        "/set key=value; …",
        "sampling: temperature, top_p, max_tokens, seed, repetition_penalty, repeat_last_n, stop "
        "(no value: show; reset: the model's defaults)",
    ),
    CommandSpec(
        "system", "/system [TEXT|clear]", "set the system prompt (no text: show it; clear: clear it)"
    ),
    CommandSpec("model", "/model [ID]", "switch to model ID (no ID: open the models screen)"),
    CommandSpec("models", "/models", "open the models screen (catalog, download, remove)"),
    CommandSpec("hardware", "/hardware", "open the hardware report (llmchat doctor)"),
    CommandSpec("history", "/history", "list saved conversations and resume one"),
    CommandSpec(
        "export",
        "/export [PATH]",
        "save this conversation as Markdown (no PATH: a new file in the current directory)",
    ),
    CommandSpec("exit", "/exit", "quit llmchat"),
)

ALIASES: dict[str, str] = {"quit": "exit", "clear": "reset", "?": "help"}

_BY_NAME = {spec.name: spec for spec in COMMANDS}


def parse(text: str) -> Command | None:
    """The command in ``text``, or ``None`` when it is a message for the model.

    Raises ``LlmchatError`` for an unknown command (with the closest known one as the fix).
    """
    stripped = text.strip()
    if not stripped.startswith("/") or stripped.startswith("//"):
        return None
    word, _, arg = stripped[1:].partition(" ")
    if "\n" in word:
        word, _, rest = word.partition("\n")
        arg = f"{rest} {arg}".strip()
    name = word.lower()
    name = ALIASES.get(name, name)
    if name not in _BY_NAME:
        raise LlmchatError(f"Unknown command /{word}.", _hint(word))
    return Command(name, arg.strip())


def message_text(text: str) -> str:
    """The text to send to the model: ``//x`` becomes ``/x``; anything else unchanged."""
    stripped = text.strip()
    return stripped[1:] if stripped.startswith("//") else stripped


def _hint(word: str) -> str:
    close = difflib.get_close_matches(word.lower(), [*list(_BY_NAME), *ALIASES], n=1, cutoff=0.5)
    suggestion = f"did you mean /{ALIASES.get(close[0], close[0])}? " if close else ""
    return f"{suggestion}type /help for the commands; start with // to send a message beginning with /"


def help_text(keys: list[tuple[str, str]] | None = None) -> str:
    """The /help text as Markdown: every command, then the keys."""
    lines = ["**Commands**", ""]
    lines += [f"- `{spec.usage}` — {spec.help}" for spec in COMMANDS]
    if keys:
        lines += ["", "**Keys**", ""]
        lines += [f"- `{key}` — {what}" for key, what in keys]
    return "\n".join(lines)
