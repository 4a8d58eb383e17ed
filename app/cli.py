"""The ``llmchat`` command line: the TUI by default, subcommands for everything else.

Each subcommand lives in its own module under ``app/commands/`` exposing ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``; this module only wires them up and turns
``LlmchatError`` into a readable message and a non-zero exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from app import __version__
from app.errors import LlmchatError, NotAvailableYet, check_arguments

#: subcommand name -> module under app.commands
SUBCOMMANDS: dict[str, str] = {
    "doctor": "doctor",
    "models": "models",
    "download": "download",
    "remove": "remove",
    "clean": "clean",
    "import": "import_gguf",
    "ask": "ask",
    "bench": "bench",
    "serve": "serve",
    "build": "build",
}


VERBOSE_HELP = (
    "also print the debug log on stderr (what llmchat falls back from and why; always "
    "written to debug.log in the cache directory; the chat app names that file at exit)"
)


#: the smallest KV cache a reply can be written into
MIN_CONTEXT_WINDOW = 2


def context_window_arg(text: str) -> int:
    """``--context-window N``: a whole number of tokens, at least MIN_CONTEXT_WINDOW (0 never
    silently means the default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
    if value < MIN_CONTEXT_WINDOW:
        raise argparse.ArgumentTypeError(
            f"{value} tokens is too small: give at least 64, or leave it out for the model's default"
        )
    return value


def add_model_arguments(parser: argparse.ArgumentParser, saved_servers: bool = False) -> None:
    """``--model`` and ``--device`` of the commands that load a model (ask, bench, serve; ``saved_servers``:
    ``--model server:NAME`` connects to a saved server instead). SUPPRESS: a value given before the
    subcommand (``llmchat --model X ask ...``) is kept."""
    servers = ", or server:NAME for a server saved in the models screen" if saved_servers else ""
    parser.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        metavar="ID_OR_PATH",
        help=f"catalog id or model directory (default: the built-in default model){servers}",
    )
    parser.add_argument(
        "--device",
        default=argparse.SUPPRESS,
        help="auto (default), cpu, cuda, rocm, vulkan or metal, optionally :N",
    )


def add_endpoint_arguments(parser: argparse.ArgumentParser, default: object = None) -> None:
    """``--endpoint URL`` and ``--api-key KEY``: chat with a model on an OpenAI-compatible server."""
    parser.add_argument(
        "--endpoint",
        default=default,
        metavar="URL",
        help="chat with a model on an OpenAI-compatible server (vLLM, SGLang, llama.cpp, "
        "Ollama, mlc_llm serve, llmchat serve), e.g. http://127.0.0.1:8000/v1; --model "
        "then names one of its models (default: the first it lists)",
    )
    parser.add_argument(
        "--api-key",
        default=default,
        metavar="KEY",
        help="the server's API key (default: $LLMCHAT_API_KEY; $OPENAI_API_KEY only for "
        "api.openai.com); sent to that host only, never printed",
    )


def add_prebuilt_argument(parser: argparse.ArgumentParser, default: object = False) -> None:
    """``--no-prebuilt``: never use a prebuilt model library, always compile it here."""
    parser.add_argument(
        "--no-prebuilt",
        action="store_true",
        default=default,
        help="always compile the model library here, never download a prebuilt one "
        "(also: LLMCHAT_NO_PREBUILT=1, or prebuilt_libraries = false in config.toml)",
    )


def prebuilt_choice(args: argparse.Namespace) -> bool | None:
    """False under ``--no-prebuilt``; None: the settings decide (app.inference.compile.prebuilt)."""
    return False if getattr(args, "no_prebuilt", False) else None


def _command_module(name: str):
    return importlib.import_module(f"app.commands.{SUBCOMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (the TUI's options at top level, one sub-parser per command)."""
    parser = argparse.ArgumentParser(
        prog="llmchat",
        description="Chat with LLMs in the terminal, compiled for your own GPU with Apache TVM. "
        "Without a subcommand, starts the chat app.",
    )
    parser.add_argument("--version", action="version", version=f"llmchat {__version__}")
    parser.add_argument(
        "--model",
        help="catalog id or model directory to chat with, or server:NAME for a server saved in the "
        "models screen",
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (default), cpu, cuda, rocm, vulkan or metal; optionally with an index, e.g. cuda:1",
    )
    parser.add_argument(
        "--continue",
        dest="continue_last",
        action="store_true",
        help="resume the most recent conversation",
    )
    parser.add_argument(
        "--engine",
        choices=("tvm", "mlc"),
        default="tvm",
        help="tvm: llmchat's own engine (default); mlc: MLC-LLM's MLCEngine, where the mlc_llm package "
        "(MLC's wheels) is installed",
    )
    parser.add_argument(
        "--context-window",
        type=context_window_arg,
        default=None,
        metavar="TOKENS",
        help="KV-cache size in tokens (default: the model's, at most 8192)",
    )
    add_endpoint_arguments(parser)
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    add_prebuilt_argument(parser)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = _command_module(name)
        sub = subs.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def _fail(err: LlmchatError) -> int:
    print(f"llmchat: {err}", file=sys.stderr)
    return 2 if isinstance(err, NotAvailableYet) else 1


def _clean_quietly() -> None:
    """Remove the temporaries of dead llmchat processes (app.cleanup); never stops a start."""
    try:
        from app.cleanup import clean_stale

        clean_stale()
    except Exception:  # a cleanup problem must not keep anyone from chatting
        from app.debug_log import log

        log.warning("cleaning stale temporaries failed", exc_info=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``llmchat`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        check_arguments(argv)
    except LlmchatError as err:
        return _fail(err)
    args = build_parser().parse_args(argv)
    from app import debug_log

    verbose = bool(getattr(args, "verbose", False))
    # the chat app owns the terminal: its debug lines go to the file only (named at exit)
    debug_log.setup(verbose=verbose and args.command is not None)
    if args.command != "clean":
        _clean_quietly()
    try:
        if args.command is None:
            from app.tui import run_tui  # imported lazily: Textual is slow to import

            try:
                return run_tui(args)
            finally:
                if verbose:
                    print(f"llmchat: the debug log is {debug_log.log_path()}", file=sys.stderr)
        return int(_command_module(args.command).run(args) or 0)
    except LlmchatError as err:
        return _fail(err)
    except KeyboardInterrupt:
        print("llmchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`llmchat models --json | head`): stop quietly, like other CLI tools
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
