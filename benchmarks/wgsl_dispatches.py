#!/usr/bin/env python3
"""Kernel launches per greedy decode step of random-weight presets on WGSL (Vulkan), counted from
the scheduled module (``app.inference.pipelines.kernel_count``; not timed, no GPU needed), with
the WGSL fusion (``pipelines/wgsl_fusion``) on and off. One JSON line per preset and setting:
the total and the launches per PrimFunc name.

    python benchmarks/wgsl_dispatches.py --presets qwen2.5-0.5b,qwen2.5-3b,llama2-7b
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-3b,llama2-7b")
    ap.add_argument("--arch", default="wgsl-f16-wg49152-t256", help="the WGSL adapter profile")
    ap.add_argument("--quant", default="q4f16_1")
    ap.add_argument("--fusion", default="on,off", help="settings of LLMCHAT_WGSL_FUSION to count")
    args = ap.parse_args()
    from app.inference.compile.targets import make_target
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.pipelines.kernel_count import decode_step_kernels, scheduled_module
    from app.inference.pipelines.wgsl_fusion import FUSION_ENV
    from app.inference.engine.random_model import preset_config

    target = make_target(DeviceSpec("vulkan", 0), args.arch)
    for preset in args.presets.split(","):
        for setting in args.fusion.split(","):
            os.environ[FUSION_ENV] = "" if setting == "on" else setting
            counts = decode_step_kernels(scheduled_module(preset_config(preset, args.quant, 2048), target))
            print(json.dumps({"preset": preset, "arch": args.arch, "fusion": setting,
                              "launches_per_step": sum(counts.values()),
                              "by_kernel": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
