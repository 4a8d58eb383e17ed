"""`llmchat ask`: answer one prompt, streaming the reply to stdout (progress and logs go to stderr)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import LlmchatError
from app.inference.api import Engine, PrefillProgress, ProgressEvent, ReplyStats, SamplingParams, TextDelta

if TYPE_CHECKING:
    from app.inference.services import LocalServices, Services

HELP = "answer one prompt, streaming the reply to stdout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from app.cli import add_model_arguments, context_window_arg

    add_model_arguments(parser, saved_servers=True)
    # sampling: unset flags take the model's defaults (app/inference/engine/model_defaults.py), as in
    # the chat
    parser.add_argument(
        "--temperature", type=float, default=None, help="0 = greedy (default: the model's, else 0.7)"
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling mass (default: the model's, else 0.95)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate (default 512)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="1 = off (default: the model's, else 1.1 over the last 64 tokens)",
    )
    parser.add_argument(
        "--repeat-last-n",
        type=int,
        default=None,
        help="tokens the penalties look back (default 64; 0 = the whole reply)",
    )
    parser.add_argument("--presence-penalty", type=float, default=None, help="-2 to 2 (default 0)")
    parser.add_argument("--frequency-penalty", type=float, default=None, help="-2 to 2 (default 0)")
    parser.add_argument(
        "--stop", action="append", default=None, metavar="TEXT", help="an extra stop string (repeatable)"
    )
    parser.add_argument("--system", default=None, metavar="TEXT", help="system prompt")
    parser.add_argument(
        "--context-window",
        type=context_window_arg,
        default=argparse.SUPPRESS,
        metavar="TOKENS",
        help="KV-cache size in tokens (default: the model's, at most 8192)",
    )
    add_engine_argument(parser)
    from app.cli import add_endpoint_arguments, add_prebuilt_argument

    add_endpoint_arguments(parser, default=argparse.SUPPRESS)
    add_prebuilt_argument(parser, default=argparse.SUPPRESS)
    parser.add_argument("--stats", action="store_true", help="print MLC-style speed stats to stderr")
    parser.add_argument(
        "--progress",
        action="store_true",
        help="report the reading of a long prompt on stderr also when stderr is not a "
        "terminal (on a terminal it always is)",
    )
    parser.add_argument("prompt", nargs="*", help="the prompt (read from stdin when omitted or '-')")


def add_engine_argument(parser: argparse.ArgumentParser) -> None:
    """``--engine tvm|mlc``."""
    parser.add_argument(
        "--engine",
        choices=("tvm", "mlc"),
        default="tvm",
        help="tvm: llmchat's own engine (default); mlc: MLC-LLM's MLCEngine, when the "
        "mlc_llm package (MLC's wheels) is installed",
    )


def services_for(args: argparse.Namespace) -> LocalServices:
    """The facade the command's flags ask for: a server's models (``--endpoint``), or this machine's
    with ``--engine``, ``--context-window``, ``--arch`` and ``--no-prebuilt``."""
    from app.inference.services import LocalServices, RemoteServices

    if getattr(args, "endpoint", None):
        return RemoteServices(args.endpoint, getattr(args, "api_key", None))
    from app.cli import prebuilt_choice

    return LocalServices(
        engine="mlc" if getattr(args, "engine", "tvm") == "mlc" else "tvm",
        context_window=getattr(args, "context_window", None),
        prebuilt=prebuilt_choice(args),
        arch=getattr(args, "arch", None),
    )


def open_engine(
    services: Services, args: argparse.Namespace, model: str | Path, progress: StderrProgress
) -> Engine:
    """The model loaded on ``--device`` through ``services``."""
    return services.load_engine(model, getattr(args, "device", None) or "auto", progress)


class StderrProgress:
    """Progress events as short lines on stderr (one per stage change, plus periodic updates)."""

    def __init__(self, quiet: bool = False, interval_s: float = 1.5) -> None:
        self.quiet = quiet
        self.interval_s = interval_s
        self._last = ("", 0.0)  # (stage, time of the last line printed)

    def __call__(self, event: ProgressEvent) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        frac = event.fraction
        same_stage = event.stage == self._last[0]
        if same_stage and frac is not None and frac < 1.0 and now - self._last[1] < self.interval_s:
            return  # a step of a stage already shown: at most one line per interval
        self._last = (event.stage, now)
        pct = f" {frac * 100:.0f}%" if frac is not None else ""
        print(f"[{event.stage}] {event.message}{pct}", file=sys.stderr, flush=True)


class PrefillLine:
    """Progress of the prompt's prefill on stderr, never on stdout: on a terminal one line that is
    rewritten per prefill chunk and erased before the reply starts; elsewhere (``--progress``) one
    line per chunk."""

    def __init__(self, stream: Any, enabled: bool, terminal: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.terminal = terminal
        self._shown = False

    def update(self, progress: PrefillProgress) -> None:
        if not self.enabled or (progress.done == 0 and not self.terminal):
            return
        line = progress.format()
        if self.terminal:
            self.stream.write(f"\r\x1b[K{line}")
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the terminal line (before the reply's first text)."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False


def check_device_first(services: Services, args: argparse.Namespace) -> None:
    """Fail on an unusable ``--device`` before anything is downloaded or imported."""
    services.check_device(getattr(args, "device", None) or "auto")


def resolve_model(services: Services, model: str | None, progress: StderrProgress) -> str | Path:
    """``--model`` or the default model (downloaded on first use); not a saved server (``ask`` and the
    chat connect to those)."""
    if services.servers.name_of(model) is not None:
        raise LlmchatError(
            f"{model} is a saved server: this command runs a model on this machine.",
            f"chat with it (llmchat --model {model}) or ask it (llmchat ask --model {model} ...), "
            "or pass a local model's id",
        )
    return services.model_or_default(model, progress)


def read_prompt(parts: list[str]) -> str:
    """The prompt from the arguments, or stdin."""
    if parts and parts != ["-"]:
        return " ".join(parts)
    if sys.stdin is None or sys.stdin.isatty():
        raise LlmchatError("No prompt given.", 'llmchat ask "your question"')
    from app.errors import decode_utf8

    stream = getattr(sys.stdin, "buffer", None)
    text = (
        decode_utf8(stream.read(), "the prompt read from stdin") if stream is not None else sys.stdin.read()
    ).strip()
    if not text:
        raise LlmchatError("The prompt read from stdin is empty.", 'llmchat ask "your question"')
    return text


#: the sampling flags (argparse dest = SamplingParams field)
SAMPLING_FLAGS = (
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "repetition_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "stop",
)


def sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given on the command line, validated (they override the model's defaults)."""
    from app.inference.services import SamplingRules

    rules = SamplingRules()
    given = {key: getattr(args, key) for key in SAMPLING_FLAGS if getattr(args, key, None) is not None}
    return {key: rules.validate(key, value) for key, value in given.items()}


def sampling_for(services: Services, engine: Engine, overrides: dict[str, Any]) -> SamplingParams:
    """The loaded model's sampling defaults with the command line's overrides on top."""
    return services.sampling.apply(services.sampling_defaults(engine).params, overrides)


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args.prompt)
    overrides = sampling_from_args(args)
    progress = StderrProgress()
    endpoint = getattr(args, "endpoint", None)
    services = services_for(args)
    saved = services.servers.name_of(getattr(args, "model", None))
    if saved is not None:  # a server saved in the models screen, as the chat's --model server:NAME
        if endpoint:
            raise LlmchatError(
                f"--endpoint and --model {args.model} both name a server.",
                f"drop --endpoint to ask the saved server, or pass --model NAME of a model on {endpoint}",
            )
        engine = services.open_server(saved)
    else:
        check_device_first(services, args)
        model = resolve_model(services, getattr(args, "model", None), progress)
        engine = open_engine(services, args, model, progress)
    try:
        params = sampling_for(services, engine, overrides)
        if args.system:
            engine.set_system_prompt(args.system)
        stats: ReplyStats | None = None
        out = sys.stdout
        terminal = bool(getattr(sys.stderr, "isatty", lambda: False)())
        prefill = PrefillLine(sys.stderr, enabled=terminal or args.progress, terminal=terminal)
        try:
            for event in engine.chat(prompt, params):
                if isinstance(event, TextDelta):
                    prefill.clear()
                    out.write(event.text)
                    out.flush()
                elif isinstance(event, PrefillProgress):
                    prefill.update(event)
                elif isinstance(event, ReplyStats):
                    prefill.clear()
                    stats = event
        except KeyboardInterrupt:
            prefill.clear()
            engine.cancel()
            raise
        except LlmchatError:  # e.g. the server went away mid-reply: what arrived stays printed
            out.write("\n")
            out.flush()
            raise
        out.write("\n")
        out.flush()
        if stats is not None and args.stats:
            print(stats.format(), file=sys.stderr)
            server = getattr(stats, "server_line", lambda: None)()
            if server:
                print(server, file=sys.stderr)
        if stats is not None and stats.finish_reason == "context":
            print("llmchat: the reply stopped at the end of the context window", file=sys.stderr)
    finally:
        engine.close()
    return 0
