"""Does the engine decode slower inside ``llmchat serve`` than in ``llmchat bench``? A/Bs in one process.

    .venv/bin/python benchmarks/serve_engine_ab.py [--device cpu] [--rounds 6] [--variants ...]
        [--pause 1.0] [--context-window 2048] [--json OUT.json]

One engine is loaded once; every round runs each variant once (the order rotates from round to
round, so that no variant always comes first), with ``--pause`` seconds between two variants (TVM's
pool threads spin after a parallel job, see below). Every variant decodes the same number of
tokens (the chat reply's length, SmolLM2 stops by itself) and reports the engine's own decode tok/s
(``ReplyStats.decode_tok_s``, what ``llmchat bench`` prints). Variants:

- ``bench_main``: ``llmchat bench``'s pass (``engine.generate``, a 1-token random prompt, greedy,
  ``ignore_eos``, no detokenizing) on the main thread;
- ``bench_thread``: the same on a long-lived worker thread (the server's engine thread is one);
- ``bench_thread_loop``: the same while the main thread waits in an idle asyncio loop;
- ``prompt_main``: ``generate`` of the chat prompt's ids (the served request's depth), no detokenizing;
- ``complete_main`` / ``complete_thread``: ``engine.complete`` of the served request (chat template,
  detokenizing, stop strings: the server's call) on the main / a worker thread;
- ``bench_unbound``: ``bench_main``'s pass on a thread whose TVM pool was made with
  ``TVM_BIND_THREADS=0`` (no thread pinned to a core);
- ``bench_ctx2``: ``bench_main``'s pass on a second engine whose KV cache holds
  ``--second-context-window`` tokens (default 1024, what ``llmchat bench`` sizes it to);
- ``serve_0`` / ``serve_05``: the server's path without HTTP: the request's job through
  :class:`app.serve.scheduler.Scheduler` (its engine thread), the text taken on an asyncio loop on
  the main thread as ``_stream`` takes it, with stream intervals 0 and 0.05 s.

Per variant also the CPU time of the process's threads while it ran (``/proc/self/task/*/schedstat``):
on-CPU and run-queue wait, summed over TVM's pool threads and the Python threads.

Nothing here is a test; the figures are noisy on a shared machine (the load is printed with them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_ID = "smollm2-135m-instruct"
PROMPT = "Count from 1 to 1000, one number per line."
VARIANTS = [
    "bench_main",
    "bench_thread",
    "bench_thread_loop",
    "prompt_main",
    "complete_main",
    "complete_thread",
    "serve_0",
    "serve_05",
    "bench_unbound",
    "bench_ctx2",
]


def thread_times() -> dict[int, tuple[str, int, int]]:
    """tid -> (name, ns on the CPU, ns waiting on a run queue) of this process's threads (a Python
    thread by its name, the others, TVM's pool workers, as ``tvm-TID``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
            name = names.get(int(task.name), f"tvm-{task.name}")
        except (OSError, ValueError):
            continue
        out[int(task.name)] = (name, run_ns, wait_ns)
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, float]:
    """ms on the CPU / waiting, per thread name (summed), between two thread_times()."""
    sums: dict[str, float] = {}
    for tid, (name, run, wait) in after.items():
        run0, wait0 = before.get(tid, (name, 0, 0))[1:]
        if run - run0 < 1e6 and wait - wait0 < 1e6:
            continue
        sums[f"{name}.run_ms"] = sums.get(f"{name}.run_ms", 0) + (run - run0) / 1e6
        sums[f"{name}.wait_ms"] = sums.get(f"{name}.wait_ms", 0) + (wait - wait0) / 1e6
    return {k: round(v, 1) for k, v in sorted(sums.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between two variants")
    parser.add_argument("--context-window", type=int, default=2048)
    parser.add_argument("--second-context-window", type=int, default=1024)
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args()

    from app.commands.bench import _run_once
    from app.inference.api import Message, ReplyStats, SamplingParams
    from app.inference.services import LocalServices
    from app.serve.scheduler import Job, Scheduler

    services = LocalServices(context_window=args.context_window)
    engine = services.load_engine(MODEL_ID, args.device)
    messages = [Message("user", PROMPT)]
    chat_params = SamplingParams(temperature=0.0, top_p=1.0, seed=1, max_tokens=256)

    def complete() -> ReplyStats:
        stats = None
        for event in engine.complete(messages, chat_params):
            if isinstance(event, ReplyStats):
                stats = event
        return stats

    # warm up, and the reply's length: every variant decodes as many tokens
    complete()
    gen = complete().generated_tokens
    prompt_ids = engine._encode(list(messages))
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size

    def bench_once() -> ReplyStats:
        return _run_once(engine, rng.integers(0, vocab, size=1).tolist(), gen)

    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ab-worker")
    scheduler = Scheduler(engine, max_queue=4)

    engine2 = None
    if "bench_ctx2" in args.variants:
        engine2 = LocalServices(context_window=args.second_context_window).load_engine(MODEL_ID, args.device)

    def unbound_thread() -> ThreadPoolExecutor:
        # TVM reads TVM_BIND_THREADS when a thread's pool is made: at that thread's first kernel
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ab-unbound")

        def first() -> None:
            os.environ["TVM_BIND_THREADS"] = "0"
            try:
                _run_once(engine, [1], 2)
            finally:
                os.environ.pop("TVM_BIND_THREADS")

        pool.submit(first).result()
        return pool

    unbound = unbound_thread() if "bench_unbound" in args.variants else None

    def on_worker(fn) -> ReplyStats:
        return worker.submit(fn).result()

    def on_worker_with_loop(fn) -> ReplyStats:
        async def wait() -> ReplyStats:
            return await asyncio.wrap_future(worker.submit(fn))

        return asyncio.run(wait())

    def served(interval: float) -> ReplyStats:
        async def go() -> ReplyStats:
            loop = asyncio.get_running_loop()
            job = Job(messages, SamplingParams(temperature=0.0, top_p=1.0, seed=1, max_tokens=gen), loop)
            scheduler.submit(job)
            not_before = 0.0
            out = []
            while True:
                text, end = await job.take(not_before)
                if text:
                    out.append(json.dumps({"choices": [{"delta": {"content": text}}]}))
                    not_before = loop.time() + interval
                if end is not None:
                    return end.stats

        return asyncio.run(go())

    runs = {
        "bench_main": bench_once,
        "bench_thread": lambda: on_worker(bench_once),
        "bench_thread_loop": lambda: on_worker_with_loop(bench_once),
        "prompt_main": lambda: _run_once(engine, prompt_ids, gen),
        "complete_main": complete,
        "complete_thread": lambda: on_worker(complete),
        "bench_unbound": lambda: unbound.submit(bench_once).result(),
        "bench_ctx2": lambda: _run_once(engine2, rng.integers(0, vocab, size=1).tolist(), gen),
        "serve_0": lambda: served(0.0),
        "serve_05": lambda: served(0.05),
    }
    for name in args.variants:  # each once untimed: every thread's pool exists before the rounds
        runs[name]()
    figures: dict = {
        "machine": {"cores": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "tokens": gen,
        "prompt_tokens": len(prompt_ids),
        "context_window": engine.info.context_window,
        "env": {k: os.environ.get(k) for k in ("TVM_NUM_THREADS", "TVM_BIND_THREADS", "TVM_EXCLUDE_WORKER0")},
        "rounds": [],
    }
    print(f"{gen} tokens, prompt {len(prompt_ids)} tokens, load {os.getloadavg()}", flush=True)
    names = list(args.variants)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        row = {}
        for name in order:
            time.sleep(args.pause)
            before = thread_times()
            t0 = time.perf_counter()
            stats = runs[name]()
            wall_ms = (time.perf_counter() - t0) * 1000
            cpu = cpu_delta(before, thread_times())
            # the decoding thread (the one that ran longest): the rest of the wall time it neither ran
            # nor waited for a core it slept, i.e. waited for the GIL (TVM's pool spins, never sleeps)
            runs_ms = {k[: -len(".run_ms")]: v for k, v in cpu.items() if k.endswith(".run_ms")}
            python = {k: v for k, v in runs_ms.items() if not k.startswith("tvm-")}
            main_thread = max(python, key=python.get) if python else None
            slept = (
                wall_ms - runs_ms[main_thread] - cpu.get(f"{main_thread}.wait_ms", 0.0)
                if main_thread
                else None
            )
            row[name] = {
                "decode_tok_s": round(stats.decode_tok_s, 1),
                "tokens": stats.generated_tokens,
                "wall_ms": round(wall_ms, 1),
                "decoding_thread": main_thread,
                "decoding_thread_slept_ms": round(slept, 1) if slept is not None else None,
                "cpu": cpu,
            }
        row["loadavg"] = os.getloadavg()
        figures["rounds"].append(row)
        print(
            f"round {r}: "
            + "  ".join(f"{n} {row[n]['decode_tok_s']}" for n in names)
            + f"  load {row['loadavg'][0]:.2f}",
            flush=True,
        )
    medians = {n: statistics.median(row[n]["decode_tok_s"] for row in figures["rounds"]) for n in names}
    base = medians.get("bench_main")
    figures["medians"] = medians
    figures["machine"]["loadavg_at_end"] = os.getloadavg()
    for n in names:
        ratio = f"  ({medians[n] / base:.3f} of bench_main)" if base else ""
        print(f"median {n:18s} {medians[n]:6.1f} tok/s{ratio}")
    for n in names:
        slept = [row[n]["decoding_thread_slept_ms"] for row in figures["rounds"]]
        print(f"decoding thread slept (GIL waits), ms per reply: {n:18s} {slept}")
    print("cpu of the last round:", json.dumps({n: figures["rounds"][-1][n]["cpu"] for n in names}, indent=1))
    scheduler.close()
    worker.shutdown()
    if unbound is not None:
        unbound.shutdown()
    if engine2 is not None:
        engine2.close()
    engine.close()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
