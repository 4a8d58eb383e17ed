"""`llmchat bench`: measure prefill and decode speed (MLC's protocol: 1-token prompt, 512 tokens)"""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet

HELP = "measure prefill and decode speed (MLC's protocol: 1-token prompt, 512 tokens)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options yet."""


def run(args: argparse.Namespace) -> int:
    raise NotAvailableYet(
        "`llmchat bench` is not available yet in this version.",
        "follow https://github.com/llmchat/llmchat/issues for progress",
    )
