"""`llmchat import PATH.gguf [--name NAME]`: import a llama.cpp GGUF file as an llmchat model."""

from __future__ import annotations

import argparse
import sys
import time

from app.inference.api import ProgressEvent

HELP = "import a GGUF file (llama.cpp's format) as an llmchat model, without re-quantizing"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        metavar="PATH.gguf",
        help="the GGUF file (Llama, Mistral, SmolLM2 or Qwen2; tensors F32, F16, BF16, Q8_0, Q4_0 or Q4_1)",
    )
    parser.add_argument("--name", help="model id to install it as (default: from the file name)")


class _StderrProgress:
    """One line per step on stderr, at most a few per second while converting."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, event: ProgressEvent) -> None:
        now = time.monotonic()
        final = event.total is not None and event.done == event.total
        if event.fraction is not None and not final and now - self.last < 0.5:
            return
        self.last = now
        pct = f" {event.fraction * 100:3.0f}%" if event.fraction is not None else ""
        print(f"[{event.stage}]{pct} {event.message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from app.inference.services import LocalServices

    started = time.monotonic()
    model_dir = LocalServices().import_gguf(args.path, args.name, _StderrProgress())
    print(f"imported {model_dir.name} in {time.monotonic() - started:.1f} s: {model_dir}", file=sys.stderr)
    print(f"chat with it: llmchat --model {model_dir.name}", file=sys.stderr)
    print(model_dir)
    return 0
