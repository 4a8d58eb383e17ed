"""`llmchat build`: compile a model library and write it as a prebuilt bundle (manifest + library)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "compile a model's library for a target and write it as a prebuilt bundle to publish"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="ID_OR_PATH", help="installed model id or model directory")
    parser.add_argument(
        "--device",
        dest="build_device",
        required=True,
        metavar="TARGET",
        help="cpu, cuda, rocm, vulkan or metal (the device need not be here with --arch)",
    )
    parser.add_argument(
        "--arch",
        default=None,
        help="what to build for: a CPU level (x86-64-v2, x86-64-v3 …; default: this "
        "CPU's), a GPU architecture (sm_90, gfx1100) or a WGSL adapter profile "
        "(wgsl-f16-wg32768-t256; -sg32 at the end for a fixed subgroup size of 32; see "
        "`llmchat doctor`); default: the device here",
    )
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="folder to write the bundle into (as DIR/<key>/); publish DIR's contents "
        "under libs/ in the model's repo",
    )


def run(args: argparse.Namespace) -> int:
    from app.commands.ask import StderrProgress
    from app.inference.services import LocalServices

    bundle = LocalServices().build_bundle(
        args.model, args.build_device, args.arch, args.out, StderrProgress()
    )
    print(
        f"llmchat: bundle for {bundle.target} (TVM {bundle.tvm}, engine {bundle.engine}, "
        f"host CPU {bundle.host_cpu}); manifest sha256 {bundle.manifest_sha256}",
        file=sys.stderr,
    )
    print(bundle.folder)
    return 0
