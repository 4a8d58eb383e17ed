"""`llmchat import`: import a GGUF file as an llmchat model"""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet

HELP = "import a GGUF file as an llmchat model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet(
        "`llmchat import` is not available yet in this version.",
        "follow https://github.com/llmchat/llmchat/issues for progress",
    )
