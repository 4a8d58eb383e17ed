"""What a streamed reply's chunks cost outside the engine: CPU time per token of ``llmchat serve``'s
event loop, of its engine thread's hand-over and of the ``openai`` client, at a fixed token rate.

    .venv/bin/python benchmarks/serve_chunk_cost.py [--tok-s 130] [--tokens 400] [--rounds 3]
        [--intervals 0 0.03 0.05 0.1 default] [--impls auto asyncio,h11] [--tree DIR] [--json OUT.json]

A stand-in engine yields a token every 1/``--tok-s`` seconds, sleeping in between (the GIL released,
as TVM's calls release it), so the figures do not depend on how fast this machine decodes; one
``llmchat serve`` app per ``--stream-interval`` value (``default``: the app's own default, also for a
checkout older than the option) runs on uvicorn in its own process — the app of ``--tree`` (another
checkout, to compare with, e.g. the commit before; default: this one) — and each
round streams one reply of ``--tokens`` tokens through every one of them in turn (interleaved, so a
busy machine weighs on all alike). CPU time is read per thread from ``/proc/PID/task/TID/schedstat``
(nanoseconds on the CPU) for the server and from ``time.process_time`` for the client; reported:
medians per token, and their sum as a share of a token's time (what a CPU engine sharing the cores
loses at least). Linux only. Nothing here is a test: the figures go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVER = r"""
import socket, sys, time
import uvicorn
from app.inference.api import EngineInfo, ReplyStats, TextDelta
from app.serve.server import create_app

PERIOD = float(sys.argv[1])
OPTIONS = {} if sys.argv[2] == "default" else {"stream_interval": float(sys.argv[2])}
# uvicorn's event loop and HTTP implementation: "auto" (its default: uvloop and httptools where
# installed) or "asyncio,h11" (the standard library's loop and the pure-Python HTTP parser)
IMPL = {} if sys.argv[3] == "auto" else dict(zip(("loop", "http"), sys.argv[3].split(",")))


class StandIn:
    info = EngineInfo(model_id="m", model_path="", backend="cpu", device="cpu", quantization="q",
                      context_window=1 << 16, weight_bytes=0)

    def count_prompt_tokens(self, messages):
        return 5

    def complete(self, messages, params, cancel=None):
        started, made = time.perf_counter(), 0
        for i in range(params.max_tokens):
            time.sleep(PERIOD)
            made += 1
            yield TextDelta(f"{i}\n")
            if cancel is not None and cancel.is_set():
                break
        stats = ReplyStats()
        stats.generated_tokens, stats.decode_s = made, time.perf_counter() - started
        yield stats

    def close(self):
        pass


sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)
print(sock.getsockname()[1], flush=True)
app = create_app(StandIn(), **OPTIONS)
uvicorn.Server(uvicorn.Config(app, log_level="warning", **IMPL)).run(sockets=[sock])
"""


def thread_cpu(pid: int) -> dict[int, float]:
    """Seconds on the CPU per thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError):
            continue
    return out


async def stream(port: int, tokens: int) -> tuple[int, float]:
    """(text chunks, client CPU seconds) of one streamed reply."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        await client.models.list()  # connected before the clock starts
        cpu0, chunks = time.process_time(), 0
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=tokens
        )
        async for chunk in reply:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks += 1
        return chunks, time.process_time() - cpu0
    finally:
        await client.close()


def _interval(text: str) -> float | str:
    return text if text == "default" else float(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tok-s", type=float, default=130.0, help="the stand-in engine's decode rate")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--intervals", type=_interval, nargs="+", default=[0.0, 0.03, 0.05, 0.1, "default"])
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["auto"],
        help="uvicorn's loop,http per server: auto (uvloop/httptools where installed) or e.g. asyncio,h11",
    )
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose app.serve runs")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args()
    period = 1.0 / args.tok_s
    keys = [(interval, impl) for interval in args.intervals for impl in args.impls]
    servers: dict[tuple, tuple[subprocess.Popen, int]] = {}
    rows: dict[tuple, list[dict]] = {key: [] for key in keys}
    load_start = os.getloadavg()
    try:
        for key in keys:
            interval, impl = key
            proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(period), str(interval), impl],
                cwd=args.tree,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "PYTHONPATH": str(args.tree.resolve())},
            )
            servers[key] = (proc, int(proc.stdout.readline()))
            asyncio.run(stream(servers[key][1], 5))  # the first request imports what it needs
        for _ in range(args.rounds):
            for key, (proc, port) in servers.items():
                before = thread_cpu(proc.pid)
                chunks, client_cpu = asyncio.run(stream(port, args.tokens))
                after = thread_cpu(proc.pid)
                spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
                loop = spent.pop(proc.pid, 0.0)  # uvicorn's event loop runs on the main thread
                worker = max(spent.values(), default=0.0)  # the engine's thread: sleeps and hand-overs
                rows[key].append(
                    {
                        "chunks": chunks,
                        "loop_ms_per_token": 1000 * loop / args.tokens,
                        "engine_thread_ms_per_token": 1000 * worker / args.tokens,
                        "client_ms_per_token": 1000 * client_cpu / args.tokens,
                    }
                )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    summary = []
    for (interval, impl), measured in rows.items():
        med = {key: statistics.median(r[key] for r in measured) for key in measured[0]}
        outside = med["loop_ms_per_token"] + med["client_ms_per_token"]
        row = {
            "stream_interval_s": interval,
            "uvicorn": impl,
            "chunks": round(med["chunks"]),
            "loop_ms_per_token": round(med["loop_ms_per_token"], 3),
            "client_ms_per_token": round(med["client_ms_per_token"], 3),
            "engine_thread_ms_per_token": round(med["engine_thread_ms_per_token"], 3),
            "loop_and_client_share_of_token_time": round(outside / (1000 * period), 4),
        }
        summary.append(row)
        print(
            f"interval {interval!s:>7} {impl:>11}: {row['chunks']:4d} chunks for {args.tokens} tokens; "
            "per token: "
            f"loop {row['loop_ms_per_token']:.3f} ms, client {row['client_ms_per_token']:.3f} ms "
            f"({100 * row['loop_and_client_share_of_token_time']:.1f} % of a token's "
            f"{1000 * period:.1f} ms); engine thread (sleeps included) "
            f"{row['engine_thread_ms_per_token']:.3f} ms",
            flush=True,
        )
    figures = {
        "tok_s": args.tok_s,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "tree": str(args.tree.resolve()),
        "machine": {
            "cores": os.cpu_count(),
            "loadavg_at_start": load_start,
            "loadavg_at_end": os.getloadavg(),
        },
        "rows": summary,
        "raw": {f"{k[0]} {k[1]}": v for k, v in rows.items()},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
