#!/usr/bin/env python3
"""CPU decode benchmark: llmchat (TVM, llmchat's CPU pipeline) next to llama.cpp on the same machine.

MLC's protocol: a 1-token prompt, then N greedy tokens (EOS ignored); tok/s of the decode phase,
argmax on the host every step for both engines. The two engines run alternately, ``--repeats``
times, in this one process tree, so both see the same load; the medians are reported.

    .venv/bin/python benchmarks/cpu_decode.py                              # llmchat only
    .venv/bin/python benchmarks/cpu_decode.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llama-python /tmp/lcpp/bin/python                                # + llama.cpp

llmchat runs the ``smollm2-135m`` preset (SmolLM2-135M's shapes) with random ``q4f16_1`` weights;
with ``--gguf`` and ``--import-gguf`` it also runs the imported GGUF itself. llama.cpp runs through
llama-cpp-python (``pip install llama-cpp-python`` in any venv; pass its interpreter). The last
line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LLAMA_CPP_SCRIPT = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, threads, gen, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=gen + 16,
            n_batch=64, verbose=False)
eos = llm.token_eos()
n_vocab = llm.n_vocab()
for line in sys.stdin:          # one run per request line, so runs interleave with llmchat's
    llm.reset()
    llm.eval([llm.token_bos()])
    steps = []
    t0 = time.perf_counter()
    for _ in range(gen):
        t1 = time.perf_counter()
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()
        logits[eos] = -np.inf
        llm.eval([int(np.argmax(logits))])
        steps.append(time.perf_counter() - t1)
    dt = time.perf_counter() - t0
    print(json.dumps({"decode_tok_s": gen / dt, "steps": steps}), flush=True)
"""


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else 0.0


class LlamaCpp:
    """A llama-cpp-python worker process that decodes on request."""

    def __init__(self, python: str, gguf: str, threads: int, gen: int) -> None:
        self.proc = subprocess.Popen(
            [python, "-c", LLAMA_CPP_SCRIPT, gguf, str(threads), str(gen), "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def run(self) -> tuple[float, list[float]]:
        """(decode tok/s, seconds of every step)."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("llama.cpp worker exited")
        out = json.loads(line)
        return float(out["decode_tok_s"]), list(out["steps"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _llmchat_run(engine, gen: int) -> tuple[float, list[float]]:
    """(decode tok/s through ``engine.generate``, seconds of every step of a same-length runtime loop)."""
    import numpy as np

    from app.inference.api import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen)
    for _ in engine.generate([1], params, ignore_eos=True, detokenize=False):
        pass
    stats = engine.last_stats
    assert stats.generated_tokens == gen, stats
    # the same protocol one level down (argmax on the host), timing every step
    rt = engine.runtime
    rt.clear()
    steps = []
    tok = int(np.argmax(rt.prefill([1])))
    for _ in range(gen):
        t = time.perf_counter()
        tok = int(np.argmax(rt.decode(tok)))
        steps.append(time.perf_counter() - t)
    rt.clear()
    return stats.decode_tok_s, steps


def _best_decile_tok_s(steps: list[float]) -> float:
    """1 / the 10th-percentile step time: the speed of the steps that ran without being preempted."""
    ordered = sorted(steps)
    return round(1.0 / ordered[len(ordered) // 10], 1) if ordered else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--quantization", default="q4f16_1")
    ap.add_argument("--gen", type=int, default=256, help="decoded tokens per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="default: the machine's physical cores")
    ap.add_argument("--gguf", help="GGUF file for the llama.cpp peer")
    ap.add_argument("--llama-python", help="python interpreter that has llama_cpp installed")
    ap.add_argument("--import-gguf", action="store_true", help="also run llmchat on the imported --gguf")
    ap.add_argument("--keep-cache", action="store_true",
                    help="reuse the user's compiled-library cache (default: a fresh one, to time compiling)")
    args = ap.parse_args()

    from app.inference.engine.cpu_threads import configure_cpu_threads

    threads = configure_cpu_threads(args.threads)  # before TVM starts its thread pool
    if not args.keep_cache:
        os.environ["LLMCHAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="llmchat-bench-cache-")

    from app.inference.engine.random_model import load_random_engine

    result: dict[str, object] = {"preset": args.preset, "quantization": args.quantization, "gen": args.gen,
                                 "threads": threads, "cpus_online": os.cpu_count(),
                                 "load_avg_start": os.getloadavg()[0]}
    t0 = time.monotonic()
    engine = load_random_engine(args.preset, args.quantization, device="cpu",
                                context_window=max(512, args.gen + 16))
    result["load_s_incl_compile"] = round(time.monotonic() - t0, 1)
    result["weight_MB"] = round(engine.info.weight_bytes / 2**20, 1)
    from app.inference.compile.cache import libs_dir

    metas = [json.loads(p.read_text()) for p in libs_dir().glob("*.json")]
    result["compile_s"] = [m.get("compile_s") for m in metas]
    engines = {"llmchat": engine}
    if args.gguf and args.import_gguf:
        from app.inference.engine.tvm_engine import load_engine
        from app.inference.store.gguf_import import import_gguf

        os.environ.setdefault("LLMCHAT_DATA_DIR", tempfile.mkdtemp(prefix="llmchat-bench-data-"))
        model_dir = import_gguf(args.gguf, name="bench-gguf")
        t0 = time.monotonic()
        engines["llmchat_gguf"] = load_engine(model_dir, device="cpu")
        result["gguf_load_s_incl_compile"] = round(time.monotonic() - t0, 1)
    peer = LlamaCpp(args.llama_python or sys.executable, args.gguf, threads, args.gen) if args.gguf else None

    for eng in engines.values():
        _llmchat_run(eng, 16)  # warm-up
    if peer:
        peer.run()
    names = [*engines, *(["llama.cpp"] if peer else [])]
    runs: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.repeats):
        for name, eng in engines.items():
            tok_s, st = _llmchat_run(eng, args.gen)
            runs[name].append(tok_s)
            steps[name] += st
        if peer:
            tok_s, st = peer.run()
            runs["llama.cpp"].append(tok_s)
            steps["llama.cpp"] += st
        print(f"run {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()),
              file=sys.stderr, flush=True)
    if peer:
        peer.close()
    for name, values in runs.items():
        result[f"{name}_decode_tok_s"] = _median(values)
        result[f"{name}_runs"] = [round(v, 1) for v in values]
        result[f"{name}_best_decile_tok_s"] = _best_decile_tok_s(steps[name])
    if peer:
        for name in engines:
            for metric in ("decode_tok_s", "best_decile_tok_s"):
                peer_value = float(result[f"llama.cpp_{metric}"])
                if peer_value:
                    ratio = float(result[f"{name}_{metric}"]) / peer_value
                    result[f"{name}_vs_llama.cpp_{metric}"] = round(ratio, 2)
    result["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
