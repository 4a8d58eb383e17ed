"""`llmchat ask`: answer one prompt, streaming the reply to stdout"""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet

HELP = "answer one prompt, streaming the reply to stdout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet(
        "`llmchat ask` is not available yet in this version.",
        "follow https://github.com/llmchat/llmchat/issues for progress",
    )
