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
    conversation, ``--device`` picks the GPU backend (default: auto), ``--engine mlc`` chats through
    MLC-LLM's engine where the mlc_llm package is installed, ``--endpoint URL`` chats with a model
    on an OpenAI-compatible server.
    """
    from app.chat_app import LlmchatApp, StartOptions
    from app.inference.services import LocalServices, RemoteServices, Services

    options = StartOptions(
        model=getattr(args, "model", None),
        device=getattr(args, "device", "auto") or "auto",
        continue_last=bool(getattr(args, "continue_last", False)),
    )
    services: Services
    if getattr(args, "endpoint", None):
        services = RemoteServices(args.endpoint, getattr(args, "api_key", None))
    else:
        no_prebuilt = bool(getattr(args, "no_prebuilt", False))  # always compile the library here
        services = LocalServices(
            engine="mlc" if getattr(args, "engine", "tvm") == "mlc" else "tvm",
            context_window=getattr(args, "context_window", None),
            prebuilt=False if no_prebuilt else None,
        )
    app = LlmchatApp(options, services)
    code = app.run()
    code = int(code or 0) if app.return_code is None else int(app.return_code)
    _finish_background_work(code)
    return code


def _finish_background_work(code: int, grace_s: float = 3.0) -> None:
    """Leave without waiting for work that cannot be interrupted (a compile in progress).

    A daemon thread still inside TVM would abort the interpreter's shutdown ("terminate called ..."),
    so when one is alive the process ends with ``os._exit``; other threads get ``grace_s`` seconds.
    Conversations are committed message by message, so nothing is lost by not waiting.
    """
    deadline = time.monotonic() + grace_s
    while True:
        others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
        if not others:
            return
        if any(t.daemon for t in others) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
