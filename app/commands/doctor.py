"""`llmchat doctor`: show the GPUs found, the backend chosen and why, and the memory budget"""

from __future__ import annotations

import argparse
import sys

HELP = "show the GPUs found, the backend chosen and why, and the memory budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--sysroot",
        metavar="DIR",
        default=None,
        help="read every system file relative to DIR instead of / (default: $LLMCHAT_SYSROOT or /)",
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.85,
        metavar="FRACTION",
        help="share of GPU memory the model may use (default 0.85)",
    )


def run(args: argparse.Namespace) -> int:
    from app.inference.services import LocalServices

    report = LocalServices().hardware_report(args.sysroot, utilization=args.utilization)
    sys.stdout.write(report.to_json() + "\n" if args.json else report.format_text())
    return 0
