"""`llmchat doctor`: show the GPUs found, the backend chosen and why, and the memory budget"""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet

HELP = "show the GPUs found, the backend chosen and why, and the memory budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet(
        "`llmchat doctor` is not available yet in this version.",
        "follow https://github.com/llmchat/llmchat/issues for progress",
    )
