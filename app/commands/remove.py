"""`llmchat remove`: remove an installed model"""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet

HELP = "remove an installed model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet(
        "`llmchat remove` is not available yet in this version.",
        "follow https://github.com/llmchat/llmchat/issues for progress",
    )
