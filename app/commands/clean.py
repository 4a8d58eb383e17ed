"""`llmchat clean`: remove what interrupted runs left behind (half-written imports, libraries, GGUFs)."""

from __future__ import annotations

import argparse

HELP = "remove the temporaries of interrupted runs and say how much space that reclaimed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed")


def run(args: argparse.Namespace) -> int:
    from app.cleanup import clean_stale, stale_temporaries, tree_size

    if args.dry_run:
        paths = stale_temporaries()
        for path in paths:
            print(f"would remove {path} ({tree_size(path)} bytes)")
        if not paths:
            print("nothing to clean")
        return 0
    report = clean_stale()
    for path in report.removed:
        print(f"removed {path}")
    print(report.summary())
    return 0
