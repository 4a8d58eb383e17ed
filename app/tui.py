"""Start the Textual chat app (``llmchat`` without a subcommand)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time


def run_tui(args: argparse.Namespace) -> int:
    """Run the chat app until the user quits; returns the exit code.

    ``--model ID`` goes straight to the chat with that model, ``--continue`` resumes the latest
    conversation, ``--device`` picks the GPU backend (default: auto).
    """
    from app.chat_app import LlmchatApp, StartOptions

    options = StartOptions(
        model=getattr(args, "model", None),
        device=getattr(args, "device", "auto") or "auto",
        continue_last=bool(getattr(args, "continue_last", False)),
    )
    app = LlmchatApp(options)
    code = app.run()
    code = int(code or 0) if app.return_code is None else int(app.return_code)
    _finish_background_work()
    return code


def _finish_background_work(grace_s: float = 3.0) -> None:
    """A compile cannot be interrupted: after a short grace period, exit without waiting for it.

    Conversations are committed message by message, so nothing is lost by not waiting.
    """
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        if not others:
            return
        time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
