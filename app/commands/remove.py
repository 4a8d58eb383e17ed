"""`llmchat remove`: remove an installed model (and any partial download of it)."""

from __future__ import annotations

import argparse

HELP = "remove an installed model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="ID", help="id of an installed model (see `llmchat models`) or HF://owner/repo"
    )


def run(args: argparse.Namespace) -> int:
    from app.cleanup import format_bytes
    from app.inference.services import LocalServices

    report = LocalServices().remove_model(args.model)
    for path in report.removed:
        print(f"removed {path}")
    print(f"reclaimed {format_bytes(report.bytes)}")
    return 0
