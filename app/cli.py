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
from app.errors import LlmchatError, NotAvailableYet

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


def add_endpoint_arguments(parser: argparse.ArgumentParser, default: object = None) -> None:
    """``--endpoint URL`` and ``--api-key KEY``: chat with a model on an OpenAI-compatible server."""
    parser.add_argument("--endpoint", default=default, metavar="URL",
                        help="chat with a model on an OpenAI-compatible server (vLLM, SGLang, llama.cpp, "
                        "Ollama, mlc_llm serve, llmchat serve), e.g. http://127.0.0.1:8000/v1; --model "
                        "then names one of its models (default: the first it lists)")
    parser.add_argument("--api-key", default=default, metavar="KEY",
                        help="the server's API key (default: $LLMCHAT_API_KEY; $OPENAI_API_KEY only for "
                        "api.openai.com); sent to that host only, never printed")


def add_prebuilt_argument(parser: argparse.ArgumentParser, default: object = False) -> None:
    """``--no-prebuilt``: never use a prebuilt model library, always compile it here."""
    parser.add_argument("--no-prebuilt", action="store_true", default=default,
                        help="always compile the model library here, never download a prebuilt one "
                        "(also: LLMCHAT_NO_PREBUILT=1, or prebuilt_libraries = false in config.toml)")


def prebuilt_choice(args: argparse.Namespace) -> bool | None:
    """False under ``--no-prebuilt``; None: the settings decide (app.inference.prebuilt)."""
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
    parser.add_argument("--model", help="catalog id or model directory to chat with")
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
    add_endpoint_arguments(parser)
    add_prebuilt_argument(parser)
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = _command_module(name)
        sub = subs.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
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
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``llmchat`` console script."""
    args = build_parser().parse_args(argv)
    if args.command != "clean":
        _clean_quietly()
    try:
        if args.command is None:
            from app.tui import run_tui  # imported lazily: Textual is slow to import

            return run_tui(args)
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
