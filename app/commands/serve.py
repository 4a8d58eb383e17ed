"""`llmchat serve`: llmchat's engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

HELP = "serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models)"

#: the server's API key when --api-key is not given (kept apart from LLMCHAT_API_KEY, the client's)
API_KEY_ENV = "LLMCHAT_SERVE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from app.cli import add_model_arguments, context_window_arg

    add_model_arguments(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; any other needs --api-key)",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=16,
        metavar="N",
        help="requests that may wait behind the running one; more get 429 (default 16)",
    )
    parser.add_argument(
        "--stream-interval",
        type=_interval,
        default=None,
        metavar="SECONDS",
        help="least time between two chunks of a streamed reply: the text that comes meanwhile goes "
        "in one chunk, fewer chunks leave the engine more CPU (default 0.1; 0: about one per token)",
    )
    parser.add_argument(
        "--context-window",
        type=context_window_arg,
        default=None,
        metavar="TOKENS",
        help="KV-cache size in tokens (default: the model's, at most 8192)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's name in the API (default: its llmchat id)",
    )
    from app.commands.ask import add_engine_argument

    add_engine_argument(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default info)",
    )
    from app.cli import add_prebuilt_argument

    add_prebuilt_argument(parser, default=argparse.SUPPRESS)


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 10:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time in seconds from 0 to 10 (e.g. 0.05)")
    return value


def run(args: argparse.Namespace) -> int:
    from app.commands.ask import StderrProgress, check_device_first, open_engine, resolve_model, services_for
    from app.errors import LlmchatError
    from app.serve.run import bind, run_server
    from app.serve.server import DEFAULT_STREAM_INTERVAL_S, check_bind, create_app

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(args.host, api_key)
    if args.max_queue < 1:
        raise LlmchatError(f"--max-queue {args.max_queue} is too small.", "use at least 1")
    sock = bind(args.host, args.port)  # before the slow part: a taken port fails at once
    try:
        progress = StderrProgress()
        services = services_for(args)  # --engine tvm or mlc
        check_device_first(services, args)
        model = resolve_model(services, getattr(args, "model", None), progress)
        engine = open_engine(services, args, model, progress)
        try:
            interval = args.stream_interval
            app = create_app(
                engine,
                api_key=api_key,
                max_queue=args.max_queue,
                model_id=args.served_model_name,
                stream_interval=DEFAULT_STREAM_INTERVAL_S if interval is None else interval,
            )
            # uvicorn shuts down on Ctrl+C / SIGTERM, then re-raises it
            with contextlib.suppress(KeyboardInterrupt):
                run_server(app, sock, log_level=args.log_level)
            print("llmchat serve: stopped", file=sys.stderr)
        finally:
            engine.close()
    finally:
        sock.close()
    return 0
