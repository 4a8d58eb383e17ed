"""`llmchat download`: download a model's prebuilt quantized weights"""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet

HELP = "download a model's prebuilt quantized weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet(
        "`llmchat download` is not available yet in this version.",
        "follow https://github.com/llmchat/llmchat/issues for progress",
    )
