#!/usr/bin/env python3
"""The CPU decode attention kernel alone, on a KV cache of a given depth, as a decode step calls it.

For each depth: ``--layers`` separate paged caches (one per layer, as TVM's KV cache keeps them),
each ``depth`` tokens deep, and one decode query per layer; a "token" is one call per layer, so the
caches are read from memory as in a real decode step (189 MB per token at 4k tokens for SmolLM2 in
float32). Prints ms per token and the cache bytes read per second. ``--baseline FILE``: a copy of
another ``cpu_attention.py`` (e.g. ``git show main:app/inference/pipelines/cpu_attention.py``) whose
``decode_attention_kernel`` runs alternately with this tree's, token by token, in this process.

    TVM_NUM_THREADS=2 .venv/bin/python benchmarks/cpu_decode_attention.py --depths 1024,4096
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_cpu_attention", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="1024,4096", help="tokens in the cache (default 1024,4096)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads (default SmolLM2's 9,3)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--dtype", default="float32", help="cache, query and output dtype (default float32)")
    ap.add_argument("--tokens", type=int, default=20, help="timed tokens per kernel and depth")
    ap.add_argument("--baseline", default=None, help="another cpu_attention.py to compare with")
    args = ap.parse_args()

    import numpy as np
    import tvm

    from app.inference.pipelines import cpu_attention

    h_q, h_kv = (int(x) for x in args.heads.split(","))
    d, page = args.head_dim, args.page
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})

    def build(mod):
        func = mod.decode_attention_kernel(h_kv, h_q, d, args.dtype, False, page)
        return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)["main"]

    kernels = {"this tree": build(cpu_attention)}
    if args.baseline:
        kernels = {"baseline": build(_load(args.baseline)), **kernels}
    dev = tvm.cpu()
    rng = np.random.default_rng(0)
    for depth in (int(x) for x in args.depths.split(",")):
        n_pages = -(-depth // page)
        caches = [
            tvm.runtime.tensor(
                rng.standard_normal((n_pages, 2, h_kv, page, d)).astype(args.dtype), device=dev
            )
            for _ in range(args.layers)
        ]
        small = [
            tvm.runtime.tensor(a, device=dev)
            for a in (
                np.array([0, n_pages], "int32"),
                np.arange(n_pages, dtype="int32"),
                np.array([depth - (n_pages - 1) * page], "int32"),
                np.zeros(1, "int32"),
                np.zeros(1, "int32"),
            )
        ]
        q = tvm.runtime.tensor(rng.standard_normal((1, h_q, d)).astype(args.dtype), device=dev)
        out = tvm.runtime.tensor(np.zeros((1, h_q, d), args.dtype), device=dev)
        lse = tvm.runtime.tensor(np.zeros((1, h_q), "float32"), device=dev)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        cpu: dict[str, list[float]] = {name: [] for name in kernels}
        for step in range(args.tokens + 2):
            for name, kernel in kernels.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for cache in caches:
                    kernel(q, cache, *small, out, lse, 0, 1.0, 10000.0, d**-0.5)
                if step >= 2:  # two warm-up tokens
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
        read = args.layers * 2 * h_kv * depth * d * np.dtype(args.dtype).itemsize
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            print(
                f"depth {depth:>6}  {name:>10}: {ms:7.3f} ms/token (median of {len(ts)}, best "
                f"{min(ts) * 1e3:.3f}), CPU time {statistics.median(cpu[name]) * 1e3:7.3f} ms/token; "
                f"{read / 1e6:.0f} MB of cache -> {read / ms / 1e6:.1f} GB/s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
