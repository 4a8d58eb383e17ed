"""`llmchat bench`: prefill speed on a real prompt and decode speed at a depth of context.

Two passes, like ``llama-bench -p N`` and ``-n G -d D``: a prompt of ``--prompt-tokens`` random ids
is prefilled and timed (prefill tok/s; a 1-token "prefill" measures nothing, so 0 skips the pass);
then ``--depth`` tokens of context are prefilled untimed and ``--gen`` greedy tokens are decoded and
timed (decode tok/s at that depth; depth 0 is MLC's protocol: a 1-token prompt, then 512 tokens).
:func:`measure` is the code this command, ``benchmarks/gpu_decode.py`` and ``benchmarks/cpu_depth.py``
run. The roofline divides the decode speed by weight bytes ÷ the device's copy bandwidth, measured
once per device and kept (``app.inference.hardware.copy_bandwidth``); where no copy can be measured,
the datasheet's figure, and the output says which of the two (or ``--bandwidth``) it shows."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
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
    from app.inference.services import LocalServices

    presets = LocalServices().random_presets()
    add_model_arguments(parser)
    parser.add_argument(
        "--random-weights",
        metavar="ARCH",
        choices=sorted(presets),
        help="benchmark an architecture with random weights, no download: " + ", ".join(presets),
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
        help="memory bandwidth for the roofline (default: the device's copy bandwidth, measured once)",
    )
    add_engine_argument(parser)
    from app.cli import add_prebuilt_argument

    add_prebuilt_argument(parser, default=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def _probe_bandwidth(backend: str) -> tuple[float | None, str | None]:
    """(bytes/s, device name) of the GPU the probe picked, when it matches ``backend``: the
    datasheet's figure (pci_ids, amd_gpus)."""
    try:
        from app.inference.services import LocalServices

        report = LocalServices().probe()
    except Exception:  # the probe is best effort
        return None, None
    gpu = getattr(report, "gpu", None)
    if gpu is None or getattr(report, "backend", None) != backend:
        return None, None
    bw = getattr(gpu, "bandwidth_bytes_per_s", None)
    return (float(bw) if bw else None), getattr(gpu, "name", None)


@dataclass(frozen=True)
class Bandwidth:
    """The roofline's memory bandwidth and where it comes from: ``measured`` (a copy on this device,
    kept per device in the cache), ``datasheet`` (the probe's figure for the GPU model) or ``given``
    (``--bandwidth``)."""

    bytes_per_s: float
    source: str
    measured_on: str | None = None  # the day of the measurement (measured only)

    @property
    def label(self) -> str:
        gb = self.bytes_per_s / 1e9
        gb_s = f"{gb:,.0f} GB/s" if gb >= 100 else f"{gb:.1f} GB/s"
        if self.source == "measured":
            return f"measured copy bandwidth ({gb_s}, measured {self.measured_on})"
        if self.source == "datasheet":
            return f"datasheet bandwidth ({gb_s}, not measured here)"
        return f"given bandwidth ({gb_s}, --bandwidth)"


def roofline_bandwidth(
    given_gb_s: float | None, device: Any, backend: str, log: Any = None
) -> tuple[Bandwidth | None, str | None]:
    """The bandwidth the roofline divides by, and the GPU's name where the probe gave it: the given
    one; else the device's copy bandwidth (measured once per device, then kept); else, where the
    copy cannot be measured, the datasheet's figure, labelled as such."""
    if given_gb_s:
        return Bandwidth(given_gb_s * 1e9, "given"), None
    from app.inference.services import LocalServices

    if device is not None or backend == "cpu":
        try:
            measured = LocalServices().copy_bandwidth(device)
        except LlmchatError as err:
            if log is not None:
                log(f"copy bandwidth not measured: {err.problem}")
        else:
            if log is not None:
                when = f"kept from {measured.date}" if measured.cached else "measured now"
                log(f"copy bandwidth of {measured.device}: {measured.bytes_per_s / 1e9:,.1f} GB/s, {when}")
            gpu_name = _probe_bandwidth(backend)[1] if backend != "cpu" else None
            return Bandwidth(measured.bytes_per_s, "measured", measured.date), gpu_name
    sheet, gpu_name = _probe_bandwidth(backend)
    return (Bandwidth(sheet, "datasheet") if sheet else None), gpu_name


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
    after ``depth`` tokens of context (None when ``gen`` is 0), the best of ``runs`` each, on random
    token ids; a warm-up pass of each kind first (none with ``warmup=0``). The figures of the best
    runs. The one measuring code of ``llmchat bench``, ``benchmarks/gpu_decode.py`` and
    ``benchmarks/cpu_depth.py``: it needs TVM's runtime only."""
    import numpy as np

    if prompt_tokens == 1 or prompt_tokens < 0 or gen == 1 or gen < 0 or depth < 0:
        raise ValueError(f"measure: prompt_tokens {prompt_tokens}, depth {depth}, gen {gen} measure nothing")
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
        if gen:
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
    out["decode_tok_s"] = None
    out["decode_runs"] = []
    if not gen:
        return out
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

    def log(text: str) -> None:
        print(f"[bench] {text}", file=sys.stderr, flush=True)

    try:
        window = int(engine.info.context_window)
        if window < max(args.prompt_tokens + 2, max(args.depth, 1) + args.gen + 1):
            raise LlmchatError(
                f"The model's context window holds {window} tokens: too few for a "
                f"{args.prompt_tokens}-token prompt or {args.depth} tokens of depth + {args.gen} generated.",
                f"keep --prompt-tokens below {window - 1} and --depth + --gen below {window}",
            )
        mem_before = _device_memory_used(engine)
        log(f"on {engine.info.device}")
        figures = measure(
            engine, args.prompt_tokens, args.depth, args.gen, runs=args.runs, warmup=args.warmup, log=log
        )
        mem_peak = _device_memory_used(engine)
        info = engine.info
        engine_memory = engine.memory_in_use_bytes()
        device = getattr(getattr(engine, "runtime", None), "device", None)
    finally:
        engine.close()
    # after the engine is closed: the copy has the memory its weights and KV cache held
    bandwidth, gpu_name = roofline_bandwidth(args.bandwidth, device, info.backend, log)
    weight_bytes = int(info.weight_bytes)
    roofline = bandwidth.bytes_per_s / weight_bytes if bandwidth and weight_bytes else None
    decode = figures["decode_tok_s"]
    result = {
        "model": info.model_id,
        "quantization": info.quantization,
        "device": info.device,
        "gpu": gpu_name,
        **figures,
        "weight_bytes": weight_bytes,
        "engine_memory_bytes": engine_memory,
        "device_memory_used_bytes": mem_peak,
        "device_memory_used_before_bench_bytes": mem_before,
        "bandwidth_bytes_per_s": bandwidth.bytes_per_s if bandwidth else None,
        "bandwidth_source": bandwidth.source if bandwidth else None,
        "bandwidth_measured_on": bandwidth.measured_on if bandwidth else None,
        "roofline_tok_s": round(roofline, 1) if roofline else None,
        "roofline_percent": round(100 * decode / roofline, 1) if roofline else None,
        "context_window": info.context_window,
    }
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
    if bandwidth and roofline:
        print(roofline_line(result["roofline_percent"], roofline, bandwidth))
    if args.json:
        print(json.dumps(result))
    return 0


def roofline_line(percent: float, roofline_tok_s: float, bandwidth: Bandwidth) -> str:
    """``roofline: 53.3% of measured copy bandwidth (4,268 GB/s, measured 2026-12-02) …``"""
    return (
        f"roofline: {percent:.1f}% of {bandwidth.label}: {roofline_tok_s:,.1f} tok/s "
        "if every weight byte were read at that rate"
    )
