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
    from app.inference.store.catalog import (
        id_for_hf_repo,
        load_catalog,
        parse_hf_reference,
        remove_model_report,
    )

    model_id = args.model
    repo = parse_hf_reference(model_id)
    if repo is not None:
        entry = load_catalog().find_hf_repo(repo)
        model_id = entry.id if entry else id_for_hf_repo(repo)
    report = remove_model_report(model_id)
    for path in report.removed:
        print(f"removed {path}")
    print(f"reclaimed {format_bytes(report.bytes)}")
    return 0
