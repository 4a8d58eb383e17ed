"""`llmchat models`: list the model catalog with size, fit on this machine and installed state"""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet

HELP = "list the model catalog with size, fit on this machine and installed state"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet(
        "`llmchat models` is not available yet in this version.",
        "follow https://github.com/llmchat/llmchat/issues for progress",
    )
