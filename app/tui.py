"""Start the Textual chat app."""

from __future__ import annotations

import argparse

from app.errors import NotAvailableYet


def run_tui(args: argparse.Namespace) -> int:
    """Run the chat app until the user quits; returns the exit code."""
    raise NotAvailableYet(
        "The chat app is not available yet in this version.",
        "use `llmchat --help` to see the commands that are",
    )
