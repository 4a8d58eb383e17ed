"""`llmchat bench`: measure prefill and decode speed (MLC's protocol: 1-token prompt, 512 tokens)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from app.commands.ask import (
    StderrProgress,
    add_engine_argument,
    check_device_first,
    open_engine,
    resolve_model,
)
from app.errors import LlmchatError
from app.inference.api import ReplyStats, SamplingParams

HELP = "measure prefill and decode speed (MLC's protocol: 1-token prompt, 512 tokens)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from app.inference.random_model import PRESETS

    parser.add_argument("--model", default=argparse.SUPPRESS, metavar="ID_OR_PATH",
                        help="catalog id or model directory (default: the built-in default model)")
    parser.add_argument("--random-weights", metavar="ARCH", choices=sorted(PRESETS),
                        help="benchmark an architecture with random weights, no download: "
                        + ", ".join(PRESETS))
    parser.add_argument("--quantization", default="q4f16_1",
                        help="weight format for --random-weights (default q4f16_1)")
    parser.add_argument("--device", default=argparse.SUPPRESS,
                        help="auto (default), cpu, cuda, rocm, vulkan or metal, optionally :N")
    parser.add_argument("--prompt-tokens", type=int, default=1, help="prompt length (default 1)")
    parser.add_argument("--gen", type=int, default=512, help="tokens to decode (default 512)")
    parser.add_argument("--warmup", type=int, default=16,
                        help="tokens decoded in the warm-up run (default 16)")
    parser.add_argument("--runs", type=int, default=1, help="measured runs; the best is reported (default 1)")
    parser.add_argument("--context-window", type=int, default=None, metavar="TOKENS",
                        help="KV-cache size (default: prompt + gen, rounded up, at least 1024)")
    parser.add_argument("--arch", default=None, help="GPU architecture to compile for (e.g. sm_90, gfx1100)")
    parser.add_argument("--bandwidth", type=float, default=None, metavar="GB/S",
                        help="memory bandwidth for the roofline (default: from the hardware probe)")
    add_engine_argument(parser)
    from app.cli import add_prebuilt_argument

    add_prebuilt_argument(parser, default=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def _probe_bandwidth(backend: str) -> tuple[float | None, str | None]:
    """(bytes/s, device name) of the GPU the probe picked, when it matches ``backend``."""
    try:
        from app.inference.hardware import probe

        report = probe()
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


def _load(args: argparse.Namespace, progress: StderrProgress, ctx: int) -> Any:
    device = getattr(args, "device", None) or "auto"
    if args.random_weights:
        if getattr(args, "model", None):
            raise LlmchatError("--model and --random-weights exclude each other.", "pass one of them")
        if args.engine != "tvm":
            raise LlmchatError("--random-weights works with llmchat's own engine only.", "drop --engine")
        from app.inference.random_model import load_random_engine

        return load_random_engine(args.random_weights, args.quantization, device=device, context_window=ctx,
                                  progress=progress, arch=args.arch)
    if not getattr(args, "arch", None):  # --arch cross-compiles for a GPU that need not be here
        check_device_first(args)
    model = resolve_model(getattr(args, "model", None), progress)
    return open_engine(args, model, progress, ctx)


def _run_once(engine: Any, prompt: list[int], gen: int) -> ReplyStats:
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=gen)
    stats = None
    for event in engine.generate(prompt, params, ignore_eos=True, detokenize=False):
        if isinstance(event, ReplyStats):
            stats = event
    assert stats is not None
    return stats


def run(args: argparse.Namespace) -> int:
    if args.prompt_tokens < 1 or args.gen < 2:
        raise LlmchatError("bench needs --prompt-tokens >= 1 and --gen >= 2.", "use the defaults: 1 and 512")
    ctx = args.context_window or max(1024, -(-(args.prompt_tokens + args.gen + 16) // 256) * 256)
    progress = StderrProgress()
    mem_before = None
    engine = _load(args, progress, ctx)
    try:
        mem_before = _device_memory_used(engine)
        config = getattr(engine, "config", None)
        vocab = config.vocab_size if config is not None else 1000
        import numpy as np

        prompt = np.random.default_rng(0).integers(0, vocab, size=args.prompt_tokens).tolist()
        print(f"[bench] warm-up ({args.warmup} tokens) on {engine.info.device}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        _run_once(engine, prompt, max(2, args.warmup))
        warmup_s = time.perf_counter() - t0
        best: ReplyStats | None = None
        for _ in range(max(1, args.runs)):
            stats = _run_once(engine, prompt, args.gen)
            if best is None or stats.decode_tok_s > best.decode_tok_s:
                best = stats
        assert best is not None
        mem_peak = _device_memory_used(engine)
        bandwidth = args.bandwidth * 1e9 if args.bandwidth else None
        gpu_name = None
        if bandwidth is None:
            bandwidth, gpu_name = _probe_bandwidth(engine.info.backend)
        weight_bytes = int(engine.info.weight_bytes)
        roofline = bandwidth / weight_bytes if bandwidth and weight_bytes else None
        result = {
            "model": engine.info.model_id,
            "quantization": engine.info.quantization,
            "device": engine.info.device,
            "gpu": gpu_name,
            "prompt_tokens": best.prompt_tokens,
            "generated_tokens": best.generated_tokens,
            "prefill_tok_s": round(best.prefill_tok_s, 2),
            "decode_tok_s": round(best.decode_tok_s, 2),
            "time_to_first_token_s": round(best.time_to_first_token_s, 5),
            "weight_bytes": weight_bytes,
            "engine_memory_bytes": engine.memory_in_use_bytes(),
            "device_memory_used_bytes": mem_peak,
            "device_memory_used_before_bench_bytes": mem_before,
            "bandwidth_bytes_per_s": bandwidth,
            "roofline_tok_s": round(roofline, 1) if roofline else None,
            "roofline_percent": round(100 * best.decode_tok_s / roofline, 1) if roofline else None,
            "warmup_s": round(warmup_s, 2),
            "context_window": engine.info.context_window,
        }
    finally:
        engine.close()

    print(f"{result['model']} ({result['quantization']}) on {result['device']}: "
          f"{result['prompt_tokens']}-token prompt, {result['generated_tokens']} generated tokens")
    print(f"prefill: {result['prefill_tok_s']:.1f} tok/s, decode: {result['decode_tok_s']:.1f} tok/s")
    mem = result["device_memory_used_bytes"] or result["engine_memory_bytes"]
    print(f"weights: {weight_bytes / 2**20:.1f} MiB, device memory: "
          f"{mem / 2**20:.1f} MiB" if mem else f"weights: {weight_bytes / 2**20:.1f} MiB")
    if roofline:
        print(f"roofline: {result['roofline_percent']:.1f}% of {roofline:.1f} tok/s "
              f"({bandwidth / 1e9:.0f} GB/s / weight bytes)")
    if args.json:
        print(json.dumps(result))
    return 0
