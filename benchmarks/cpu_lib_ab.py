#!/usr/bin/env python3
"""Decode at depth: this tree's model library against another one, alternating in one process.

Loads the model with this tree's code (compiling its library if the cache has none), then a second
runtime on ``--other`` (a model library of the same model: an older build from the cache, e.g.
one compiled from ``main``), sharing the weights. For each depth: both runtimes prefill the same
random context (untimed), then decode ``--gen`` greedy tokens; the two alternate, ``--repeats``
times, so both see the same machine load. Prints tok/s per run and the medians, and the process's
CPU time per token (best run): with ``--threads 1`` that is the work done, which a machine shared
with other jobs changes much less than the wall-clock speed.

    .venv/bin/python benchmarks/cpu_lib_ab.py --other /path/to/main-lib.so --depths 0,1024,4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the model library (.so) to compare with")
    ap.add_argument("--model", default=None, help="model id or directory (default: the default model)")
    ap.add_argument("--depths", default="0,1024,4096")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="default: the machine's physical cores")
    args = ap.parse_args()

    from app.inference.engine.cpu_threads import configure_cpu_threads

    configure_cpu_threads(args.threads)  # before TVM starts its thread pool
    import numpy as np

    from app.inference.store.default_model import model_or_default
    from app.inference.engine.tvm_engine import load_engine
    from app.inference.engine.runtime import PAGE_SIZE, ModelRuntime

    depths = [int(x) for x in args.depths.split(",")]
    ctx = max(1024, -(-(max(depths) + args.gen + 16) // 256) * 256)
    engine = load_engine(model_or_default(args.model), device="cpu", context_window=ctx, prebuilt=False)
    ours = engine.runtime
    pages = -(-ours.context_window // PAGE_SIZE) + 1
    other = ModelRuntime(
        args.other,
        ours.device,
        ours.params,
        hidden_size=ours.hidden_size,
        model_dtype=ours.model_dtype,
        context_window=ours.context_window,
        prefill_chunk=ours.prefill_chunk,
        kv_bytes_per_token=ours.kv_bytes // (pages * PAGE_SIZE),
        weight_bytes=ours.weight_bytes,
    )
    runtimes = {"other": other, "this tree": ours}
    ours.clear()
    vocab = len(ours.prefill([1]))
    rng = np.random.default_rng(1)
    for depth in depths:
        tok_s: dict[str, list[float]] = {name: [] for name in runtimes}
        cpu_ms: dict[str, list[float]] = {name: [] for name in runtimes}
        for _ in range(args.repeats):
            for name, rt in runtimes.items():
                rt.clear()
                logits = rt.prefill(rng.integers(0, vocab, size=max(1, depth)).tolist())
                token = int(np.argmax(logits))
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.gen):
                    token = int(np.argmax(rt.decode(token)))
                tok_s[name].append(args.gen / (time.perf_counter() - t0))
                cpu_ms[name].append((time.process_time() - c0) * 1e3 / args.gen)
        line = ", ".join(
            f"{name} {statistics.median(v):.1f} tok/s ({' '.join(f'{x:.1f}' for x in v)})"
            for name, v in tok_s.items()
        )
        ratio = statistics.median(tok_s["this tree"]) / statistics.median(tok_s["other"])
        cpu = ", ".join(f"{name} {min(v):.2f}" for name, v in cpu_ms.items())
        print(
            f"depth {depth:>5}: {line}; this tree / other {ratio:.2f}x; process CPU ms per token "
            f"(best; work done with --threads 1): {cpu}",
            flush=True,
        )
    other.close()
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
