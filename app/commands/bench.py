"""`llmchat bench`: prefill speed on a real prompt and decode speed at a depth of context.

Two passes, like ``llama-bench -p N`` and ``-n G -d D``: a prompt of ``--prompt-tokens`` random ids
is prefilled and timed (prefill tok/s; a 1-token "prefill" measures nothing, so 0 skips the pass);
then ``--depth`` tokens of context are prefilled untimed and ``--gen`` greedy tokens are decoded and
timed (decode tok/s at that depth; depth 0 is MLC's protocol: a 1-token prompt, then 512 tokens).
:func:`measure` is the code both this command and ``benchmarks/cpu_depth.py`` run."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from app.commands.ask import (
    StderrProgress,
    add_engine_argument,
    check_device_first,
    open_engine,
    resolve_model,
    services_for,
)
from app.errors import LlmchatError
from app.inference.api import ReplyStats, SamplingParams

if TYPE_CHECKING:
    from app.inference.services import LocalServices

HELP = "measure prefill speed on a real prompt and decode speed at a depth of context"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from app.cli import add_model_arguments, context_window_arg
    from app.inference.engine.random_model import PRESETS

    add_model_arguments(parser)
    parser.add_argument(
        "--random-weights",
        metavar="ARCH",
        choices=sorted(PRESETS),
        help="benchmark an architecture with random weights, no download: " + ", ".join(PRESETS),
    )
    parser.add_argument(
        "--quantization", default="q4f16_1", help="weight format for --random-weights (default q4f16_1)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=512,
        metavar="N",
        help="prompt of the prefill pass (default 512; 0: no prefill pass)",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=0,
        metavar="N",
        help="tokens of context before the timed decode, prefilled untimed (default 0)",
    )
    parser.add_argument("--gen", type=int, default=512, help="tokens to decode (default 512)")
    parser.add_argument(
        "--warmup", type=int, default=16, help="tokens decoded in the warm-up run (default 16; 0: no warm-up)"
    )
    parser.add_argument("--runs", type=int, default=1, help="measured runs; the best is reported (default 1)")
    parser.add_argument(
        "--context-window",
        type=context_window_arg,
        default=None,
        metavar="TOKENS",
        help="KV-cache size (default: the longest pass, rounded up, at least 1024)",
    )
    parser.add_argument("--arch", default=None, help="GPU architecture to compile for (e.g. sm_90, gfx1100)")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="GB/S",
        help="memory bandwidth for the roofline (default: from the hardware probe)",
    )
    add_engine_argument(parser)
    from app.cli import add_prebuilt_argument

    add_prebuilt_argument(parser, default=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def _probe_bandwidth(backend: str) -> tuple[float | None, str | None]:
    """(bytes/s, device name) of the GPU the probe picked, when it matches ``backend``."""
    try:
        from app.inference.hardware import shared_probe

        report = shared_probe()
    except Exception:  # the probe is best effort
        return None, None
    gpu = getattr(report, "gpu", None)
    if gpu is None or getattr(report, "backend", None) != backend:
        return None, None
    bw = getattr(gpu, "bandwidth_bytes_per_s", None)
    return (float(bw) if bw else None), getattr(gpu, "name", None)


def _device_memory_used(engine: Any) -> int | None:
    """Bytes in use on the engine's GPU (whole device), when the runtime can tell."""
    runtime = getattr(engine, "runtime", None)
    dev = getattr(runtime, "device", None)
    if dev is None or int(dev.dlpack_device_type()) == 1:  # CPU: not meaningful
        return None
    try:
        total, free = int(dev.total_global_memory), int(dev.available_global_memory)
    except Exception:
        return None
    return total - free if total > 0 and free >= 0 else None


def _load(args: argparse.Namespace, services: LocalServices, progress: StderrProgress) -> Any:
    device = getattr(args, "device", None) or "auto"
    if args.random_weights:
        if getattr(args, "model", None):
            raise LlmchatError("--model and --random-weights exclude each other.", "pass one of them")
        if args.engine != "tvm":
            raise LlmchatError("--random-weights works with llmchat's own engine only.", "drop --engine")
        return services.load_random_engine(args.random_weights, args.quantization, device, progress)
    if not getattr(args, "arch", None):  # --arch cross-compiles for a GPU that need not be here
        check_device_first(services, args)
    model = resolve_model(services, getattr(args, "model", None), progress)
    return open_engine(services, args, model, progress)


def _run_once(engine: Any, prompt: list[int], gen: int) -> ReplyStats:
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=gen)
    stats = None
    for event in engine.generate(prompt, params, ignore_eos=True, detokenize=False):
        if isinstance(event, ReplyStats):
            stats = event
    assert stats is not None
    return stats


def context_needed(prompt_tokens: int, depth: int, gen: int) -> int:
    """The KV-cache size both passes fit in: the longer one plus a margin, rounded up to 256."""
    longest = max(prompt_tokens + 2, max(depth, 1) + gen)
    return max(1024, -(-(longest + 16) // 256) * 256)


def check_sizes(prompt_tokens: int, depth: int, gen: int, context_window: int | None) -> None:
    """Refuse sizes the passes cannot run with, naming the one at fault."""
    if prompt_tokens < 0 or prompt_tokens == 1:
        raise LlmchatError(
            f"--prompt-tokens {prompt_tokens}: a prefill needs a real prompt.",
            "use at least 2 (default 512), or 0 to skip the prefill pass",
        )
    if depth < 0 or gen < 2:
        raise LlmchatError(
            "bench needs --depth >= 0 and --gen >= 2.", "use the defaults: --depth 0 --gen 512"
        )
    if context_window is not None and context_window < max(prompt_tokens + 2, max(depth, 1) + gen + 1):
        raise LlmchatError(
            f"--context-window {context_window} is smaller than the passes need "
            f"(prompt {prompt_tokens}, depth {depth} + {gen} generated).",
            f"leave --context-window out (it is then {context_needed(prompt_tokens, depth, gen)})",
        )


def measure(
    engine: Any,
    prompt_tokens: int,
    depth: int,
    gen: int,
    runs: int = 1,
    warmup: int = 16,
    seed: int = 0,
    log: Any = None,
) -> dict[str, Any]:
    """Prefill tok/s of a ``prompt_tokens`` prompt (None when 0) and decode tok/s of ``gen`` tokens
    after ``depth`` tokens of context, the best of ``runs`` each, on random token ids; a warm-up
    pass of each kind first (none with ``warmup=0``). The figures of the best runs."""
    import numpy as np

    config = getattr(engine, "config", None)
    vocab = config.vocab_size if config is not None else 1000
    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab, size=max(1, n)).tolist()

    def say(text: str) -> None:
        if log is not None:
            log(text)

    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "depth": depth,
        "generated_tokens": gen,
        "prefill_tok_s": None,
        "prefill_runs": [],
        "time_to_first_token_s": None,
    }
    t0 = time.perf_counter()
    if warmup > 0:  # 0: the caller has warmed the engine up
        if prompt_tokens:
            say(f"warm-up: a {prompt_tokens}-token prompt")
            _run_once(engine, ids(prompt_tokens), 2)
        say(f"warm-up: {warmup} tokens")
        _run_once(engine, ids(1), max(2, warmup))
    out["warmup_s"] = round(time.perf_counter() - t0, 2)
    best_prefill: ReplyStats | None = None
    for _ in range(max(1, runs) if prompt_tokens else 0):
        stats = _run_once(engine, ids(prompt_tokens), 2)  # fresh ids: nothing is reused from a cache
        out["prefill_runs"].append(round(stats.prefill_tok_s, 2))
        if best_prefill is None or stats.prefill_tok_s > best_prefill.prefill_tok_s:
            best_prefill = stats
    if best_prefill is not None:
        out["prefill_tok_s"] = round(best_prefill.prefill_tok_s, 2)
        out["time_to_first_token_s"] = round(best_prefill.time_to_first_token_s, 5)
    best: ReplyStats | None = None
    decode_runs = []
    for _ in range(max(1, runs)):
        if depth:
            say(f"decode after {depth} tokens of context")
        stats = _run_once(engine, ids(depth), gen)  # the depth's prefill is not part of decode tok/s
        decode_runs.append(round(stats.decode_tok_s, 2))
        if best is None or stats.decode_tok_s > best.decode_tok_s:
            best = stats
    assert best is not None
    out["decode_tok_s"] = round(best.decode_tok_s, 2)
    out["decode_runs"] = decode_runs
    out["generated_tokens"] = best.generated_tokens
    return out


def run(args: argparse.Namespace) -> int:
    check_sizes(args.prompt_tokens, args.depth, args.gen, args.context_window)
    ctx = args.context_window or context_needed(args.prompt_tokens, args.depth, args.gen)
    progress = StderrProgress()
    mem_before = None
    services = services_for(args)
    services.context_window = ctx
    engine = _load(args, services, progress)
    try:
        window = int(engine.info.context_window)
        if window < max(args.prompt_tokens + 2, max(args.depth, 1) + args.gen + 1):
            raise LlmchatError(
                f"The model's context window holds {window} tokens: too few for a "
                f"{args.prompt_tokens}-token prompt or {args.depth} tokens of depth + {args.gen} generated.",
                f"keep --prompt-tokens below {window - 1} and --depth + --gen below {window}",
            )
        mem_before = _device_memory_used(engine)
        print(f"[bench] on {engine.info.device}", file=sys.stderr, flush=True)
        figures = measure(
            engine,
            args.prompt_tokens,
            args.depth,
            args.gen,
            runs=args.runs,
            warmup=args.warmup,
            log=lambda text: print(f"[bench] {text}", file=sys.stderr, flush=True),
        )
        mem_peak = _device_memory_used(engine)
        bandwidth = args.bandwidth * 1e9 if args.bandwidth else None
        gpu_name = None
        if bandwidth is None:
            bandwidth, gpu_name = _probe_bandwidth(engine.info.backend)
        weight_bytes = int(engine.info.weight_bytes)
        roofline = bandwidth / weight_bytes if bandwidth and weight_bytes else None
        decode = figures["decode_tok_s"]
        result = {
            "model": engine.info.model_id,
            "quantization": engine.info.quantization,
            "device": engine.info.device,
            "gpu": gpu_name,
            **figures,
            "weight_bytes": weight_bytes,
            "engine_memory_bytes": engine.memory_in_use_bytes(),
            "device_memory_used_bytes": mem_peak,
            "device_memory_used_before_bench_bytes": mem_before,
            "bandwidth_bytes_per_s": bandwidth,
            "roofline_tok_s": round(roofline, 1) if roofline else None,
            "roofline_percent": round(100 * decode / roofline, 1) if roofline else None,
            "context_window": engine.info.context_window,
        }
    finally:
        engine.close()
    if args.depth == 0:  # what the models screen's speed estimates for this machine start from
        services.record_bench(result)

    print(f"{result['model']} ({result['quantization']}) on {result['device']}")
    if result["prefill_tok_s"] is not None:
        print(f"prefill: {result['prefill_tok_s']:.1f} tok/s on a {result['prompt_tokens']}-token prompt")
    print(
        f"decode: {result['decode_tok_s']:.1f} tok/s, {result['generated_tokens']} tokens after "
        f"{result['depth']} tokens of context"
    )
    mem = result["device_memory_used_bytes"] or result["engine_memory_bytes"]
    print(
        f"weights: {weight_bytes / 2**20:.1f} MiB, device memory: {mem / 2**20:.1f} MiB"
        if mem
        else f"weights: {weight_bytes / 2**20:.1f} MiB"
    )
    if roofline:
        print(
            f"roofline: {result['roofline_percent']:.1f}% of {roofline:.1f} tok/s "
            f"({bandwidth / 1e9:.0f} GB/s / weight bytes)"
        )
    if args.json:
        print(json.dumps(result))
    return 0
