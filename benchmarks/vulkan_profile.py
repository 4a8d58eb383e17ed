#!/usr/bin/env python3
"""Where a Vulkan decode step goes: host time recording launches, submitting, waiting (the
add-on's counters) and (``--copy-lib``) the floor of a dependent dispatch by the bytes it moves, for random-weight presets compiled by
``gpu_decode.py compile`` (manifest in --cache). Prints one JSON line per preset; with
``LLMCHAT_WEBGPU_PROFILE=1`` also the GPU time of each kernel per step (timestamp queries).
``--repeat NAME`` dispatches every kernel whose name contains NAME twice (``LLMCHAT_WEBGPU_REPEAT``):
the step's GPU wait minus that of a run without it is what one more such dispatch costs the real
step, which the profiler's timestamps overstate for small kernels. A repeat's second dispatch finds
the weights its first one read in the L2 cache (a 7B layer's o, down and q/k/v weights fit there):
``--skip NAME`` (``LLMCHAT_WEBGPU_SKIP``) dispatches none of those kernels instead, so the step's
GPU wait without them, against a run with them, is what they cost where they run (the tokens come
out wrong; only the time counts)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def dispatch_floor(lib, dev, rows_list: list[int]) -> None:
    """The dispatch floor: for each size, N back-to-back copies (each writing the same output, so
    wgpu puts a barrier between them) recorded, submitted once and waited for; best of 3. Prints
    per dispatch the GPU wait after the submit (the add-on's counter), the submit, and the host's
    whole time (Python, recording, submit, wait)."""
    import numpy as np
    import tvm

    from app.inference.backends import webgpu

    sync = tvm.get_global_func("llmchat.webgpu.sync")
    for rows in rows_list:
        x = tvm.runtime.tensor(np.ones((rows, 4), "float32"), dev)
        y = tvm.runtime.empty((rows, 4), "float32", dev)
        n = 2000 if rows <= 65536 else 400 if rows <= 1048576 else 100
        for _ in range(20):
            lib["copy"](x, y)
        sync(0)
        best = None
        for _ in range(3):
            a = webgpu.stats(0)
            t0 = time.perf_counter()
            for _ in range(n):
                lib["copy"](x, y)
            t1 = time.perf_counter()
            sync(0)
            t2 = time.perf_counter()
            b = webgpu.stats(0)
            r = {"bytes_moved": rows * 32, "dispatches": n, "host_loop_us": round((t1 - t0) / n * 1e6, 3),
                 "wait_us_per_dispatch": round((t2 - t1) / n * 1e6, 3),
                 "total_us_per_dispatch": round((t2 - t0) / n * 1e6, 3),
                 "submit_us": round((b["submit_ns"] - a["submit_ns"]) / n / 1e3, 3),
                 "wait_ns_counter_us": round((b["wait_ns"] - a["wait_ns"]) / n / 1e3, 3)}
            if best is None or r["wait_us_per_dispatch"] < best["wait_us_per_dispatch"]:
                best = r
        best["TBps_at_wait"] = round(rows * 32 / (best["wait_us_per_dispatch"] * 1e-6) / 1e12, 3)
        print(json.dumps(best), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=None, help="libraries of gpu_decode.py compile (for --presets)")
    ap.add_argument("--presets", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--copy-lib", default=None, help="wgsl_copy.so for the dispatch floor")
    ap.add_argument("--floor-rows", default="64,1024,16384,65536,262144,1048576,4194304",
                    help="rows of 16 bytes the floor's copies move (read and written)")
    ap.add_argument("--repeat", default="", help="dispatch the kernels whose name contains this twice")
    ap.add_argument("--skip", default="", help="dispatch none of the kernels whose name contains this")
    ap.add_argument("--prefill", type=int, default=0,
                    help="also the GPU time of each kernel of one prompt of this many tokens (with the profiler)")
    args = ap.parse_args()
    if args.skip:  # read by the add-on when the device is made
        os.environ["LLMCHAT_WEBGPU_SKIP"] = args.skip
    if args.repeat:  # read by the add-on when the device is made
        os.environ["LLMCHAT_WEBGPU_REPEAT"] = args.repeat
    import gpu_decode

    if args.presets and not args.cache:
        ap.error("--presets needs --cache")
    if args.cache:
        gpu_decode._set_cache(args.cache)
        gpu_decode._use_manifest(Path(args.cache), "q4f16_1", 2048)
    import numpy as np
    import tvm

    from app.inference.backends import webgpu
    from app.inference.engine.random_model import load_random_engine

    dev = webgpu.device(0)
    if args.copy_lib:
        dispatch_floor(tvm.runtime.load_module(args.copy_lib), dev,
                       [int(r) for r in args.floor_rows.split(",") if r])
    for preset in [p for p in args.presets.split(",") if p]:
        engine = load_random_engine(preset, "q4f16_1", device="vulkan", context_window=2048)
        rt = engine.runtime
        tok = int(np.argmax(rt.prefill([1, 2, 3])))
        rt.decode_greedy_ahead(tok, 8)
        for _ in range(2):
            rt.clear()
            tok = int(np.argmax(rt.prefill([1, 2, 3])))
            a = webgpu.stats(0)
            t0 = time.perf_counter()
            ids = rt.decode_greedy_ahead(tok, args.steps)
            wall = time.perf_counter() - t0
            b = webgpu.stats(0)
            d = {k: b[k] - a[k] for k in ("dispatches", "submits", "syncs", "readbacks", "record_ns", "submit_ns",
                                          "wait_ns", "bind_group_misses")}
            steps = args.steps
            print(json.dumps({"preset": preset, "repeat": args.repeat, "skip": args.skip, "steps": steps,
                              "ms_per_step": round(wall / steps * 1e3, 3),
                              "dispatches_per_step": d["dispatches"] / steps,
                              "record_ms_per_step": round(d["record_ns"] / steps / 1e6, 3),
                              "submit_ms_per_step": round(d["submit_ns"] / steps / 1e6, 3),
                              "wait_ms_per_step": round(d["wait_ns"] / steps / 1e6, 3),
                              "other_host_ms_per_step": round((wall * 1e9 - d["record_ns"] - d["submit_ns"]
                                                               - d["wait_ns"]) / steps / 1e6, 3),
                              "submits": d["submits"], "bind_group_misses": d["bind_group_misses"],
                              "ids": ids[:4]}), flush=True)
        if webgpu.profile(0)["enabled"]:  # LLMCHAT_WEBGPU_PROFILE=1: GPU time per kernel and step
            rt.clear()
            tok = int(np.argmax(rt.prefill([1, 2, 3])))
            webgpu.profile_reset(0)
            rt.decode_greedy_ahead(tok, args.steps)
            prof = webgpu.profile(0)
            kernels = [{"name": k["name"], "per_step": round(k["count"] / args.steps, 2),
                        "us_per_step": round(k["ns"] / args.steps / 1e3, 2),
                        "us_each": round(k["ns"] / max(k["count"], 1) / 1e3, 2)} for k in prof["kernels"]]
            print(json.dumps({"preset": preset, "gpu_ms_per_step": round(prof["total_ns"] / args.steps / 1e6, 3),
                              "kernels": kernels}), flush=True)
            if args.prefill:  # one prompt of N tokens (after one to warm up), every kernel's GPU time
                ids = np.random.default_rng(7).integers(0, engine.config.vocab_size, size=args.prefill).tolist()
                rt.clear()
                rt.prefill(ids)
                rt.clear()
                webgpu.profile_reset(0)
                t0 = time.perf_counter()
                rt.prefill(ids)
                wall = time.perf_counter() - t0
                prof = webgpu.profile(0)
                kernels = [{"name": k["name"], "count": k["count"], "ms": round(k["ns"] / 1e6, 3)}
                           for k in prof["kernels"]]
                print(json.dumps({"preset": preset, "prefill_tokens": args.prefill, "wall_ms": round(wall * 1e3, 2),
                                  "gpu_ms": round(prof["total_ns"] / 1e6, 3), "kernels": kernels}), flush=True)
                rt.clear()
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
