"""The real `llmchat` in a real terminal: tmux when installed, otherwise a pseudo-terminal (stdlib pty)
with a minimal screen reading (escape sequences stripped). Types a question and /stats, reads the screen.

The model is the tiny random-weight model (compiled for the CPU once per session), installed into a
temporary data directory; the compiled library comes from the session's cache.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

MODEL_ID = "tiny-chat"
PROMPT_READY = "Enter sends"  # the prompt's placeholder: the chat is usable


def llmchat_command() -> list[str]:
    beside = Path(sys.executable).parent / "llmchat"
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "app"]


class TmuxTerminal:
    """A detached tmux session on a private server socket."""

    def __init__(self, command: list[str], env: dict[str, str], size=(110, 40)) -> None:
        self.socket = f"llmchat-test-{uuid.uuid4().hex[:8]}"
        env_args = [f"{key}={value}" for key, value in env.items()]
        shell_command = " ".join(_quote(part) for part in ["env", *env_args, *command])
        self._tmux("new-session", "-d", "-s", "t", "-x", str(size[0]), "-y", str(size[1]), shell_command)
        self.socket_path = self._tmux("display-message", "-p", "#{socket_path}").strip()

    def _tmux(self, *args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=False
        ).stdout

    def type(self, text: str) -> None:
        self._tmux("send-keys", "-t", "t", "-l", text)

    def key(self, name: str) -> None:
        self._tmux("send-keys", "-t", "t", name)

    def paste(self, text: str) -> None:
        """As a terminal pastes: bracketed (the app sees one paste, not keys)."""
        self._tmux("set-buffer", "-b", "p", text)
        self._tmux("paste-buffer", "-p", "-b", "p", "-t", "t")

    def screen(self) -> str:
        return self._tmux("capture-pane", "-t", "t", "-p")

    def alive(self) -> bool:
        return "t" in self._tmux("list-sessions", "-F", "#{session_name}").split()

    def close(self) -> None:
        self._tmux("kill-server")
        if self.socket_path.endswith(self.socket):
            Path(self.socket_path).unlink(missing_ok=True)


class PtyTerminal:
    """The app on a pseudo-terminal; the 'screen' is everything it wrote, escape sequences removed."""

    ANSI = re.compile(
        r"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b[P\]_^][^\x1b\x07]*(?:\x07|\x1b\\)|\x1b[()#][0-9A-Za-z]|\x1b."
    )

    def __init__(self, command: list[str], env: dict[str, str], size=(110, 40)) -> None:
        import fcntl
        import pty
        import struct
        import termios

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        self.proc = subprocess.Popen(
            command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            env={**os.environ, **env, "TERM": "xterm-256color"},
        )
        os.close(slave)
        self.output = ""

    def _read(self) -> None:
        while select.select([self.master], [], [], 0.05)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output += data.decode("utf-8", "replace")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def key(self, name: str) -> None:
        os.write(self.master, {"Enter": b"\r", "Escape": b"\x1b", "C-c": b"\x03"}[name])

    def paste(self, text: str) -> None:
        os.write(self.master, b"\x1b[200~" + text.encode() + b"\x1b[201~")

    def screen(self) -> str:
        self._read()
        return self.ANSI.sub("", self.output)

    def alive(self) -> bool:
        self._read()
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _unwrapped(screen: str) -> str:
    """The screen's lines joined by spaces, each without the borders and padding around it."""
    return " ".join(line.strip(" │┃║▏▕") for line in screen.splitlines())


def wait_for(terminal, predicate, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = terminal.screen()
        if predicate(screen):
            return screen
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; the screen:\n{screen[-3000:]}")
        time.sleep(0.1)


@pytest.fixture
def installed_tiny_model(tmp_path, chat_model_dir, chat_engine):
    """The tiny model installed under a fresh data dir; the cache already holds its compiled library."""
    data = tmp_path / "e2e-data"
    shutil.copytree(chat_model_dir, data / "models" / MODEL_ID)
    return {
        "LLMCHAT_DATA_DIR": str(data),
        "LLMCHAT_CONFIG_DIR": str(tmp_path / "e2e-config"),
        "LLMCHAT_CACHE_DIR": os.environ["LLMCHAT_CACHE_DIR"],
        "PYTHONUNBUFFERED": "1",
    }


@pytest.mark.parametrize("kind", ["tmux", "pty"])
def test_llmchat_in_a_terminal_question_and_stats(kind, installed_tiny_model):
    if kind == "tmux" and shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (the pty variant covers this)")
    terminal_class = TmuxTerminal if kind == "tmux" else PtyTerminal
    started = time.monotonic()
    command = [*llmchat_command(), "--model", MODEL_ID, "--device", "cpu"]
    terminal = terminal_class(command, installed_tiny_model)
    try:
        wait_for(terminal, lambda s: PROMPT_READY in s, 120, "the chat prompt")
        startup_s = time.monotonic() - started
        terminal.type("Hello, who are you?")
        terminal.key("Enter")
        wait_for(terminal, lambda s: "Hello, who are you?" in s, 30, "the question in the chat")
        # a long reply (random weights) may scroll the question away before its stats line appears
        wait_for(terminal, lambda s: "decode:" in s, 60, "the reply's stats")
        terminal.type("/stats")
        terminal.key("Enter")
        screen = wait_for(terminal, lambda s: "memory in use" in s, 30, "the /stats output")
        assert re.search(r"prefill: [\d.]+ tok/s, decode: [\d.]+ tok/s", screen)
        assert "device: cpu:0, backend: cpu" in screen
        assert "Traceback" not in screen
        terminal.key("C-c")
        deadline = time.monotonic() + 15
        while terminal.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not terminal.alive(), "llmchat did not quit on Ctrl+C"
        print(f"\n[{kind}] start-up to a usable prompt: {startup_s:.2f} s")
    finally:
        terminal.close()
    # the conversation was saved in the data directory
    import sqlite3

    db = Path(installed_tiny_model["LLMCHAT_DATA_DIR"]) / "history.sqlite3"
    rows = sqlite3.connect(db).execute("SELECT role, content FROM messages ORDER BY id").fetchall()
    assert rows[0] == ("user", "Hello, who are you?") and rows[1][0] == "assistant"


def test_ctrl_c_during_compile_quits_at_once(installed_tiny_model, tmp_path):
    """A compile cannot be interrupted; quitting must not wait for it, nor crash the interpreter."""
    env = {**installed_tiny_model, "LLMCHAT_CACHE_DIR": str(tmp_path / "empty-cache")}
    terminal = PtyTerminal([*llmchat_command(), "--model", MODEL_ID, "--device", "cpu"], env)
    try:
        wait_for(terminal, lambda s: "ompiling" in s, 120, "the compile to start")
        terminal.key("C-c")
        started = time.monotonic()
        terminal.proc.wait(timeout=10)
        assert time.monotonic() - started < 3
        assert terminal.proc.returncode == 0
        screen = terminal.screen()
        assert "Traceback" not in screen and "terminate called" not in screen
    finally:
        terminal.close()


@pytest.mark.parametrize("kind", ["tmux", "pty"])
def test_ctrl_c_in_a_terminal_stops_the_reply_and_again_quits(kind, installed_tiny_model):
    """Ctrl+C as the terminal sends it (byte 0x03): the first stops the reply, keeping the app; at the
    idle prompt the next one quits."""
    if kind == "tmux" and shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (the pty variant covers this)")
    terminal_class = TmuxTerminal if kind == "tmux" else PtyTerminal
    command = [*llmchat_command(), "--model", MODEL_ID, "--device", "cpu"]
    terminal = terminal_class(command, installed_tiny_model)
    try:
        wait_for(terminal, lambda s: PROMPT_READY in s, 120, "the chat prompt")
        # greedy, no penalty: the random-weight model then never picks its stop token (a long reply)
        terminal.type("/set temperature=0; repetition_penalty=1; max_tokens=8000")
        terminal.key("Enter")
        wait_for(terminal, lambda s: "max_tokens=8000" in s and "kept for" in s, 30, "the /set notice")
        terminal.type("Tell me a very long story")
        terminal.key("Enter")
        wait_for(terminal, lambda s: "▍ ~" in s, 60, "the reply streaming (its live stats line)")
        terminal.key("C-c")
        # the stats line: it may wrap anywhere between words (where depends on its length, which
        # depends on the token count and the speeds, so on the machine's load)
        stopped = re.compile(r"TTFT\s+[\d.]+\s+s\s+·\s+stopped")
        screen = wait_for(
            terminal, lambda s: stopped.search(_unwrapped(s)) is not None, 60, "the reply to stop"
        )
        assert terminal.alive(), "the first Ctrl+C quit llmchat instead of stopping the reply"
        assert "Traceback" not in screen
        terminal.key("C-c")
        deadline = time.monotonic() + 15
        while terminal.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not terminal.alive(), "llmchat did not quit on Ctrl+C at the idle prompt"
    finally:
        terminal.close()


@pytest.mark.parametrize("kind", ["tmux", "pty"])
def test_a_long_prompt_shows_its_reading_and_ctrl_c_stops_it(kind, installed_tiny_model):
    """#18 item 4 in a real terminal: a pasted ~6,000-token prompt shows the tokens read of the total,
    tok/s and the time left while it is read; Ctrl+C stops it between chunks, keeping the app."""
    if kind == "tmux" and shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (the pty variant covers this)")
    terminal_class = TmuxTerminal if kind == "tmux" else PtyTerminal
    # prompt chunks of 2 tokens: the tiny model reads 6,000 tokens in 32-token chunks in a fraction of
    # a second, before a terminal can show them; 3,000 chunks take seconds (the library is compiled
    # for this chunk size once)
    model_dir = Path(installed_tiny_model["LLMCHAT_DATA_DIR"]) / "models" / MODEL_ID
    config_path = model_dir / "mlc-chat-config.json"
    config = json.loads(config_path.read_text())
    config["prefill_chunk_size"] = config["model_config"]["prefill_chunk_size"] = 2
    config_path.write_text(json.dumps(config))
    command = [*llmchat_command(), "--model", MODEL_ID, "--device", "cpu"]
    terminal = terminal_class(command, installed_tiny_model)
    try:
        wait_for(terminal, lambda s: PROMPT_READY in s, 240, "the chat prompt")
        terminal.paste("The quick brown fox jumps over the lazy dog. " * 170)
        wait_for(terminal, lambda s: "Pasted 1 line" in s, 30, "the paste's count")
        terminal.key("Enter")
        progress = re.compile(r"reading the prompt: [\d,]+ / [\d,]+ tokens · [\d,]+ tok/s · ~\d+ s left")
        if kind == "tmux":  # the whole screen as drawn
            wait_for(terminal, lambda s: progress.search(s) is not None, 60, "the prompt's progress")
        else:  # the bytes written (a redraw may touch part of a line): its words
            wait_for(terminal, lambda s: "reading the prompt" in s and "s left" in s, 60, "the progress")
        terminal.key("C-c")
        stopped = "stopped while reading the prompt"
        screen = wait_for(terminal, lambda s: stopped in s, 30, "the prefill to stop")
        assert terminal.alive(), "the first Ctrl+C quit llmchat instead of stopping the prompt"
        assert "Traceback" not in screen
        terminal.key("C-c")
        deadline = time.monotonic() + 15
        while terminal.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not terminal.alive(), "llmchat did not quit on Ctrl+C at the idle prompt"
    finally:
        terminal.close()
