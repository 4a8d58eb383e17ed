#!/usr/bin/env python3
"""GPU decode/prefill benchmark of llmchat's engine with random weights (MLC's protocol).

Subcommands
  compile   build the model libraries for a CUDA/ROCm architecture into a cache directory
            (on a machine with the TVM compiler; no GPU needed), e.g.
            python benchmarks/gpu_decode.py compile --cache DIR --arch sm_90 --presets llama2-7b
  run       on the GPU machine (a runtime-only TVM is enough): load each cached library with
            random weights, check it against the plain TVM pipeline's logits, and measure decode
            (1-token prompt + 512 greedy tokens) and prefill (512-token prompt). JSON to --out.
  depth     on the GPU machine: prefill speed at prompt lengths N and decode speed after N tokens
            of context (llama-bench's -p N and -n 128 -d N), random prompt ids, a fresh sequence
            for every measured run. JSON to --out.
  copy-bw   device-to-device copy bandwidth (bytes read + written per second, TB/s), measured as
            ``llmchat bench`` measures it (app.inference.hardware.copy_bandwidth).

run and depth measure through ``app.commands.bench.measure``, the code of ``llmchat bench``: the
two cannot give different figures for the same library, context window and protocol (``--gen``
counts the generated tokens, the first of which comes from the prefill, as in ``llmchat bench``).
``--backend cpu`` (with ``compile --arch cpu``) runs the same path on the CPU, as the tests do.
  make-gguf a Llama-architecture GGUF with random Q4_0 weights of the same shapes, for llama.cpp.

Presets (app.inference.engine.random_model): llama2-7b, qwen2.5-3b, qwen2.5-0.5b, ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: llama.cpp shapes for make-gguf: hidden, ffn, layers, heads, kv heads, vocab gguf file
GGUF_SHAPES = {
    "llama2-7b": (4096, 11008, 32, 32, 32, "ggml-vocab-llama-spm.gguf"),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, "ggml-vocab-qwen2.gguf"),
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, "ggml-vocab-qwen2.gguf"),
    "llama3-8b": (4096, 14336, 32, 32, 8, "ggml-vocab-llama-bpe.gguf"),
}


def _set_cache(cache: str) -> None:
    os.environ["LLMCHAT_CACHE_DIR"] = str(Path(cache).resolve())


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile (llmchat pipeline, and the plain TVM pipeline for --plain presets)."""
    _set_cache(args.cache)
    from app.inference.compile.compiler import get_library
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.engine.random_model import preset_config

    backend = ("rocm" if args.arch.startswith("gfx") else "vulkan" if args.arch.startswith("wgsl")
               else "cpu" if args.arch == "cpu" else "cuda")
    device = DeviceSpec(backend, 0)
    arch = None if backend == "cpu" else args.arch
    plain = set(filter(None, args.plain.split(",")))
    manifest_path = Path(args.cache) / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for preset in args.presets.split(","):
        for use_plain in ([False, True] if preset in plain else [False]):
            if use_plain:
                os.environ["LLMCHAT_TVM_PIPELINE"] = "default"
            else:
                os.environ.pop("LLMCHAT_TVM_PIPELINE", None)
            cfg = preset_config(preset, args.quant, args.context)
            t0 = time.time()
            lib = get_library(cfg, device, arch=arch)
            print(json.dumps({"preset": preset, "plain_pipeline": use_plain, "arch": args.arch,
                              "lib": str(lib.lib_path), "seconds": round(time.time() - t0, 1),
                              "lib_bytes": lib.lib_path.stat().st_size}), flush=True)
            fields = {k: (v.name if k == "lib_path" else v) for k, v in dataclasses.asdict(lib).items()}
            manifest[_manifest_key(backend, preset, args.quant, args.context, use_plain)] = fields
            manifest_path.write_text(json.dumps(manifest))
    os.environ.pop("LLMCHAT_TVM_PIPELINE", None)
    return 0


#: prompt of the correctness check's second part (two 64-token tiles of the prefill kernels and a
#: partial third): its logits, then a few decode steps on top of the KV it wrote, then a second
#: "turn" of SECOND_TURN tokens (attention over the cached pages plus its own keys, merged) and one
#: more decode step
CHECK_PROMPT = 150
SECOND_TURN = 70


def _prompt_logits(engine: Any, steps: int) -> list[Any]:
    import numpy as np

    rt = engine.runtime
    rt.clear()
    ids = np.random.default_rng(7).integers(0, engine.config.vocab_size,
                                            size=CHECK_PROMPT + SECOND_TURN).tolist()
    outs = [rt.prefill(ids[:CHECK_PROMPT])]
    for i in range(steps):
        outs.append(rt.decode(int(ids[i])))
    outs.append(rt.prefill(ids[CHECK_PROMPT:]))
    outs.append(rt.decode(int(ids[0])))
    rt.clear()
    return outs


def _teacher_forced_logits(engine: Any, steps: int, tokens: list[int] | None) -> tuple[list[Any], list[int]]:
    import numpy as np

    rt = engine.runtime
    rt.clear()
    outs = [rt.prefill([1])]
    used = []
    for i in range(steps):
        tok = int(np.argmax(outs[-1])) if tokens is None else tokens[i]
        used.append(tok)
        outs.append(rt.decode(tok))
    rt.clear()
    return outs, used


def _check_device_argmax(engine: Any, steps: int) -> dict[str, Any] | None:
    """Greedy tokens from the library's argmax against numpy's argmax of the same logits."""
    import numpy as np

    rt = engine.runtime
    if not rt.has_device_argmax:
        return None
    rt.clear()
    token = int(np.argmax(rt.prefill([1])))
    device_tokens = []
    for _ in range(steps):
        token = rt.decode_greedy(token)
        device_tokens.append(token)
    rt.clear()
    token = int(np.argmax(rt.prefill([1])))
    host_tokens = []
    for _ in range(steps):
        token = int(np.argmax(rt.decode(token)))
        host_tokens.append(token)
    rt.clear()
    token = int(np.argmax(rt.prefill([1])))
    ahead_tokens = []  # several steps per call, the ids fed back on the device (the chat's path)
    while len(ahead_tokens) < steps:
        ahead_tokens += rt.decode_greedy_ahead(token, min(8, steps - len(ahead_tokens)))
        token = ahead_tokens[-1]
    rt.clear()
    # the chat's path: generation's batches, the next queued before one is read
    import threading

    from app.inference.api import SamplingParams
    from app.inference.engine.generation import GenerationResult, generate

    result = GenerationResult()
    for _ in generate(rt, [1], SamplingParams(temperature=0.0, max_tokens=steps + 1), kv_ids=[],
                      cancel=threading.Event(), result=result):
        pass
    rt.clear()
    equal = sum(a == b for a, b in zip(device_tokens, host_tokens, strict=True))
    ahead_equal = sum(a == b for a, b in zip(ahead_tokens, host_tokens, strict=True))
    pipelined_equal = sum(a == b for a, b in zip(result.token_ids[1:], host_tokens, strict=True))
    return {"steps": steps, "tokens_equal": equal, "ahead_tokens_equal": ahead_equal,
            "generation_tokens_equal": pipelined_equal}


def _bench_engine(engine: Any, gen: int, prompt: int, repeats: int) -> dict[str, Any]:
    """Decode (``gen`` tokens after a 1-token prompt) and prefill (a ``prompt``-token prompt; 0: none),
    the best of ``repeats`` each, measured by ``llmchat bench``'s own code."""
    from app.commands.bench import measure

    out = measure(engine, prompt, 0, gen, runs=repeats, warmup=32)
    decode = out["decode_tok_s"]
    out["ms_per_token"] = round(1000 / decode, 3) if decode else None
    return out


def _copy_bandwidth_tbps(device: Any, given: float | None) -> tuple[float | None, str]:
    """The roofline's copy bandwidth in TB/s and where it comes from: ``--copy-bw`` when given (not
    0), else measured now on ``device`` by ``llmchat bench``'s measuring code."""
    if given:
        return given, "--copy-bw"
    from app.errors import LlmchatError
    from app.inference.hardware import copy_bandwidth

    try:
        return round(copy_bandwidth.measure(device).bytes_per_s / 1e12, 4), "measured (copy_bandwidth)"
    except LlmchatError as err:
        print(f"copy bandwidth not measured: {err}", file=sys.stderr, flush=True)
        return None, "not measured"


def _roofline_pct(res: dict[str, Any], copy_tbps: float | None) -> float | None:
    if not copy_tbps or not res.get("decode_tok_s"):
        return None
    return round(100 * res["decode_tok_s"] * res["weight_bytes"] / (copy_tbps * 1e12), 1)


def cmd_run(args: argparse.Namespace) -> int:
    """Measure each preset; compare with the plain pipeline where its library is cached."""
    _set_cache(args.cache)
    import numpy as np

    if args.backend == "vulkan":
        return cmd_run_vulkan(args)
    if args.backend == "cuda":
        from app.inference.compile.cuda_support import prepare_cuda_runtime

        prepare_cuda_runtime()
    if args.forbid_nvcc:  # prove the libraries carry binary kernels
        import app.inference.compile.cuda_support as cs

        def _no_nvcc(*_a: Any, **_k: Any) -> bytes:
            raise RuntimeError("nvcc was called at run time")

        cs.compile_fatbin = _no_nvcc
    import tvm

    from app.inference.engine.random_model import load_random_engine

    _use_manifest(Path(args.cache), args.quant, args.context)
    dev = tvm.device(args.backend, 0)
    copy_tbps, copy_source = _copy_bandwidth_tbps(dev, args.copy_bw)
    results: dict[str, Any] = {"device": dev.device_name if args.backend == "cuda" else args.backend,
                               "tvm": tvm.__version__,
                               "compute_version": dev.compute_version if args.backend == "cuda" else None,
                               "runtime_only": _runtime_only(), "copy_bw_TBps": copy_tbps,
                               "copy_bw_source": copy_source, "presets": {}}
    plain = set(filter(None, args.plain.split(",")))
    for preset in args.presets.split(","):
        res: dict[str, Any] = {}
        try:
            os.environ.pop("LLMCHAT_TVM_PIPELINE", None)
            t0 = time.time()
            engine = load_random_engine(preset, args.quant, device=args.backend,
                                        context_window=args.context)
            res["load_s"] = round(time.time() - t0, 1)
            res["weight_bytes"] = engine.info.weight_bytes
            res.update(_bench_engine(engine, args.gen, args.prompt, args.repeats))
            res["roofline_pct"] = _roofline_pct(res, copy_tbps)
            res["device_argmax"] = _check_device_argmax(engine, args.check_steps)
            if preset in plain:
                logits, toks = _teacher_forced_logits(engine, args.check_steps, None)
                prompt_logits = _prompt_logits(engine, 4)
                engine.close()
                del engine
                os.environ["LLMCHAT_TVM_PIPELINE"] = "default"
                ref = load_random_engine(preset, args.quant, device=args.backend,
                                         context_window=args.context)
                ref_logits, _ = _teacher_forced_logits(ref, args.check_steps, toks)
                ref_prompt = _prompt_logits(ref, 4)
                prompt_pairs = list(zip(prompt_logits, ref_prompt, strict=True))
                res["check_prompt_vs_plain_pipeline"] = {
                    "prompt_tokens": CHECK_PROMPT, "second_turn_tokens": SECOND_TURN,
                    "steps": len(prompt_pairs),
                    "max_rel_err": max(float(np.abs(a - b).max() / (np.abs(b).max() + 1e-9))
                                       for a, b in prompt_pairs),
                    "argmax_equal": sum(int(np.argmax(a) == np.argmax(b)) for a, b in prompt_pairs),
                }
                pairs = list(zip(logits, ref_logits, strict=True))
                errs = [float(np.abs(a - b).max() / (np.abs(b).max() + 1e-9)) for a, b in pairs]
                res["check_vs_plain_pipeline"] = {
                    "steps": len(errs), "max_rel_err": max(errs),
                    "argmax_equal": sum(int(np.argmax(a) == np.argmax(b)) for a, b in pairs),
                    "finite": bool(all(np.isfinite(x).all() for x in logits)),
                }
                res["plain_pipeline"] = _bench_engine(ref, args.gen, args.prompt if args.plain_prefill else 0,
                                                      1)
                ref.close()
                del ref
            else:
                engine.close()
                del engine
        except Exception as err:  # keep measuring the other presets
            res["error"] = f"{type(err).__name__}: {err}"[:3000]
        finally:
            os.environ.pop("LLMCHAT_TVM_PIPELINE", None)
        results["presets"][preset] = res
        print("RESULT", json.dumps({preset: res}), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def cmd_depth(args: argparse.Namespace) -> int:
    """Prefill tok/s for each prompt length and decode tok/s after each depth, per preset, measured by
    ``llmchat bench``'s code (a fresh prompt of random ids for every run: no prefix is reused)."""
    _set_cache(args.cache)
    import tvm

    from app.commands.bench import measure
    from app.inference.engine.random_model import load_random_engine

    if args.backend == "cuda":
        from app.inference.compile.cuda_support import prepare_cuda_runtime

        prepare_cuda_runtime()
    _use_manifest(Path(args.cache), args.quant, args.context)
    if args.backend == "vulkan":
        from app.inference.backends import webgpu

        dev = webgpu.device(0)
    else:
        dev = tvm.device(args.backend, 0)
    results: dict[str, Any] = {"device": dev.device_name if args.backend == "cuda" else args.backend,
                               "tvm": tvm.__version__, "context": args.context,
                               "gen": args.gen, "repeats": args.repeats, "presets": {}}
    prompts = [int(x) for x in args.prompts.split(",") if x]
    depths = [int(x) for x in args.depths.split(",") if x]
    for preset in args.presets.split(","):
        res: dict[str, Any] = {"prefill": {}, "decode_at_depth": {}}
        try:
            engine = load_random_engine(preset, args.quant, device=args.backend, context_window=args.context)
            measure(engine, 0, 0, 32, warmup=0, seed=3)  # warm-up: module load, CUDA-graph capture
            for i, d in enumerate(depths):
                got = measure(engine, 0, d, args.gen, runs=args.repeats, warmup=0, seed=10 + i)
                res["decode_at_depth"][str(d)] = {"tok_s": got["decode_tok_s"], "runs": got["decode_runs"],
                                                  "generated": got["generated_tokens"]}
                print("DECODE", preset, d, res["decode_at_depth"][str(d)], flush=True)
            for i, n in enumerate(prompts):  # a warm-up prompt of each length first
                got = measure(engine, n, 0, 0, runs=args.repeats, warmup=1, seed=100 + i)
                res["prefill"][str(n)] = {"tok_s": got["prefill_tok_s"], "runs": got["prefill_runs"]}
                print("PREFILL", preset, n, res["prefill"][str(n)], flush=True)
            engine.close()
            del engine
        except Exception as err:  # keep measuring the other presets
            res["error"] = f"{type(err).__name__}: {err}"[:3000]
        results["presets"][preset] = res
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def _logit_check(a: list[Any], b: list[Any]) -> dict[str, Any]:
    import numpy as np

    pairs = list(zip(a, b, strict=True))
    errs = [float(np.abs(x - y).max() / (np.abs(y).max() + 1e-9)) for x, y in pairs]
    return {"steps": len(errs), "max_rel_err": max(errs),
            "argmax_equal": sum(int(np.argmax(x) == np.argmax(y)) for x, y in pairs),
            "finite": bool(all(np.isfinite(x).all() for x in a))}


def cmd_run_vulkan(args: argparse.Namespace) -> int:
    """Each preset on Vulkan (llmchat's WebGPU device API on wgpu-native): decode and prefill as
    for CUDA; correctness against the CUDA library of the same preset and random weights (its
    logits on the same teacher-forced tokens and prompts) where ``--reference cuda`` is given."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.engine.random_model import load_random_engine

    _use_manifest(Path(args.cache), args.quant, args.context)
    dev = webgpu.device(0)
    adapter = webgpu.adapters()[0]
    results: dict[str, Any] = {"device": f"{adapter.name} ({adapter.backend}, {adapter.driver})",
                               "tvm": tvm.__version__, "profile": str(webgpu.Profile.of(adapter)),
                               "runtime_only": _runtime_only(), "copy_bw_TBps": args.copy_bw, "presets": {}}
    del dev
    for preset in args.presets.split(","):
        res: dict[str, Any] = {}
        try:
            t0 = time.time()
            engine = load_random_engine(preset, args.quant, device="vulkan", context_window=args.context)
            res["load_s"] = round(time.time() - t0, 1)
            res["weight_bytes"] = engine.info.weight_bytes
            res.update(_bench_engine(engine, args.gen, args.prompt, args.repeats))
            res["roofline_pct"] = _roofline_pct(res, args.copy_bw)
            res["device_argmax"] = _check_device_argmax(engine, args.check_steps)
            res["webgpu_stats"] = webgpu.stats(0)
            if args.reference == "cuda":
                logits, toks = _teacher_forced_logits(engine, args.check_steps, None)
                prompt_logits = _prompt_logits(engine, 4)
                engine.close()
                del engine
                from app.inference.compile.cuda_support import prepare_cuda_runtime

                prepare_cuda_runtime()
                ref = load_random_engine(preset, args.quant, device="cuda", context_window=args.context)
                ref_logits, _ = _teacher_forced_logits(ref, args.check_steps, toks)
                ref_prompt = _prompt_logits(ref, 4)
                res["check_vs_cuda"] = _logit_check(logits, ref_logits)
                res["check_prompt_vs_cuda"] = _logit_check(prompt_logits, ref_prompt)
                res["cuda"] = _bench_engine(ref, args.gen, args.prompt, args.repeats)
                ref.close()
                del ref
            else:
                engine.close()
                del engine
        except Exception as err:  # keep measuring the other presets
            res["error"] = f"{type(err).__name__}: {err}"[:3000]
        results["presets"][preset] = res
        print("RESULT", json.dumps({preset: res}), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def cmd_wgsl_copy(args: argparse.Namespace) -> int:
    """WGSL copy bandwidth (bytes read + written per second) through llmchat's device API: a
    vec4<f32> copy kernel TVM compiled for webgpu. ``--build LIB`` compiles it (needs the TVM
    compiler); ``--lib LIB`` runs it (on the GPU machine)."""
    import tvm

    if args.build:
        from tvm import s_tir, te

        from app.inference.pipelines.wgsl_vector_params import install

        if not args.scalar:  # one vec4 load and store a row, as the product's kernels
            install()

        n = te.var("n")
        a = te.placeholder((n, 4), name="A", dtype="float32")
        b = te.compute((n, 4), lambda i, j: a[i, j], name="B")
        mod = tvm.IRModule({"copy": te.create_prim_func([a, b]).with_attr("global_symbol", "copy")})
        sch = s_tir.Schedule(mod)
        sch.work_on("copy")
        i, j = sch.get_loops(sch.get_sblock("B"))
        bx, tx = sch.split(i, [None, 256])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(j)
        lib = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "webgpu", "host": {"kind": "llvm"}}))
        lib.export_library(args.build)
        print(args.build)
        return 0
    import numpy as np

    from app.inference.backends import webgpu

    dev = webgpu.device(0)
    lib = tvm.runtime.load_module(args.lib)
    # 1 GiB each way where the adapter binds that much (NVIDIA: 2 GiB; lavapipe: 128 MiB)
    rows = min(1 << 30, webgpu.adapters()[0].max_binding_bytes) // 16
    x = tvm.runtime.empty((rows, 4), "float32", dev)
    y = tvm.runtime.empty((rows, 4), "float32", dev)
    small = np.arange(4096 * 4, dtype="float32").reshape(4096, 4)
    xs, ys = tvm.runtime.tensor(small, dev), tvm.runtime.empty((4096, 4), "float32", dev)
    lib["copy"](xs, ys)
    assert np.array_equal(ys.numpy(), small), "the WGSL copy kernel copied wrongly"
    sync = tvm.get_global_func("llmchat.webgpu.sync")
    for _ in range(3):
        lib["copy"](x, y)
    sync(0)
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        lib["copy"](x, y)
    sync(0)
    seconds = (time.perf_counter() - t0) / reps
    print(round(2 * rows * 16 / seconds / 1e12, 3))
    return 0


def _manifest_key(backend: str, preset: str, quant: str, context: int, plain: bool) -> str:
    return f"{backend}|{preset}|{quant}|{context}|{'plain' if plain else 'llmchat'}"


def _use_manifest(cache: Path, quant: str, context: int) -> None:
    """Load exactly the libraries ``compile`` built (recorded in manifest.json), even if the
    engine's sources changed since (which would change the cache key and force a rebuild)."""
    manifest_path = cache / "manifest.json"
    if not manifest_path.exists():
        return
    manifest = json.loads(manifest_path.read_text())
    import app.inference.compile.compiler as compiler
    from app.inference.compile import cache as library_cache

    original = compiler.get_library

    def get_library(cfg: Any, device: Any, arch: str | None = None, progress: Any = None,
                    **kwargs: Any) -> Any:
        from app.inference.engine.random_model import PRESETS

        plain = os.environ.get("LLMCHAT_TVM_PIPELINE") == "default"
        for preset in PRESETS:
            entry = manifest.get(_manifest_key(device.backend, preset, quant, context, plain))
            if entry and cfg.code_key() == _preset_key(preset, quant, context):
                fields = dict(entry, lib_path=library_cache.libs_dir() / entry["lib_path"])
                return library_cache.CompiledModel(**fields)
        return original(cfg, device, arch=arch, progress=progress, **kwargs)  # fetch= (prebuilt libraries)

    compiler.get_library = get_library


def _preset_key(preset: str, quant: str, context: int) -> Any:
    from app.inference.engine.random_model import preset_config

    return preset_config(preset, quant, context).code_key()


def _runtime_only() -> bool:
    """Whether this process runs TVM without its compiler (a runtime-only wheel, or
    ``TVM_USE_RUNTIME_LIB=1``)."""
    import tvm

    loaded = getattr(tvm.base, "_LOADED_LIBS", None)
    if isinstance(loaded, dict):
        return "tvm_compiler" not in loaded
    return not (Path(tvm.__file__).parent / "lib" / "libtvm_compiler.so").exists()


def cmd_copy_bw(args: argparse.Namespace) -> int:
    """The device's copy bandwidth in TB/s (bytes read + written), measured by ``llmchat bench``'s code."""
    import tvm

    from app.inference.hardware import copy_bandwidth

    dev = None if args.device == "cpu" else tvm.device(args.device, 0)
    print(round(copy_bandwidth.measure(dev).bytes_per_s / 1e12, 4))
    return 0


def cmd_make_gguf(args: argparse.Namespace) -> int:
    """Random Q4_0 GGUF (llama architecture) with a vocab-only GGUF's tokenizer."""
    import numpy as np

    sys.path.insert(0, args.gguf_py)
    import gguf
    from gguf import GGMLQuantizationType, GGUFValueType

    hidden, ffn, layers, heads, kv_heads, vocab_file = GGUF_SHAPES[args.preset]
    vocab = gguf.GGUFReader(os.path.join(args.vocab_dir, vocab_file))
    w = gguf.GGUFWriter(args.out, "llama")
    w.add_context_length(16384)  # depth runs go past Llama-2's 4,096 (random weights: no matter)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(2)
    n_vocab = 0
    for f in vocab.fields.values():
        if not f.name.startswith("tokenizer."):
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            vals = [f.parts[i] for i in f.data]
            vals = ([bytes(v) for v in vals] if f.types[1] == GGUFValueType.STRING
                    else [v[0].item() for v in vals])
            w.add_array(f.name, vals)
            if f.name == "tokenizer.ggml.tokens":
                n_vocab = len(vals)
        elif f.types[0] == GGUFValueType.STRING:
            w.add_string(f.name, bytes(f.parts[f.data[0]]).decode())
        else:
            w.add_key_value(f.name, f.parts[f.data[0]][0].item(), f.types[0])
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=(1 << 22, 18), dtype=np.uint8)
    pool[:, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # block scale

    def q4_0(rows: int, cols: int) -> Any:
        blocks = rows * cols // 32
        arr = np.tile(pool, (-(-blocks // len(pool)), 1))[:blocks] if blocks > len(pool) else pool[:blocks]
        return arr.reshape(rows, cols // 32 * 18)

    head_dim = hidden // heads
    q4 = GGMLQuantizationType.Q4_0
    w.add_tensor("token_embd.weight", q4_0(n_vocab, hidden), raw_dtype=q4)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "attn_q.weight", q4_0(heads * head_dim, hidden), raw_dtype=q4)
        w.add_tensor(p + "attn_k.weight", q4_0(kv_heads * head_dim, hidden), raw_dtype=q4)
        w.add_tensor(p + "attn_v.weight", q4_0(kv_heads * head_dim, hidden), raw_dtype=q4)
        w.add_tensor(p + "attn_output.weight", q4_0(hidden, heads * head_dim), raw_dtype=q4)
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_gate.weight", q4_0(ffn, hidden), raw_dtype=q4)
        w.add_tensor(p + "ffn_up.weight", q4_0(ffn, hidden), raw_dtype=q4)
        w.add_tensor(p + "ffn_down.weight", q4_0(hidden, ffn), raw_dtype=q4)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", q4_0(n_vocab, hidden), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(json.dumps({"gguf": args.out, "preset": args.preset, "vocab": n_vocab,
                      "bytes": os.path.getsize(args.out)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", required=True, help="LLMCHAT_CACHE_DIR for the compiled libraries")
    common.add_argument("--presets", default="llama2-7b,qwen2.5-3b,qwen2.5-0.5b")
    common.add_argument("--quant", default="q4f16_1")
    common.add_argument("--context", type=int, default=2048, help="context window (KV cache size)")
    common.add_argument("--plain", default="llama2-7b",
                        help="presets also built/checked with TVM's plain pipeline (comma list)")
    c = sub.add_parser("compile", parents=[common])
    c.add_argument("--arch", default="sm_90",
                   help="sm_90, gfx1100, a WGSL profile (wgsl-f16-wg49152-t256), or cpu")
    r = sub.add_parser("run", parents=[common])
    r.add_argument("--gen", type=int, default=512)
    r.add_argument("--prompt", type=int, default=512, help="prefill benchmark prompt length (0: skip)")
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--check-steps", type=int, default=8)
    r.add_argument("--copy-bw", type=float, default=None,
                   help="copy bandwidth for the roofline, TB/s (default or 0: measured here, as "
                        "llmchat bench measures it)")
    r.add_argument("--plain-prefill", action="store_true")
    r.add_argument("--forbid-nvcc", action="store_true")
    r.add_argument("--out", required=True)
    r.add_argument("--backend", choices=("cuda", "vulkan", "cpu"), default="cuda")
    r.add_argument("--reference", choices=("none", "cuda"), default="none",
                   help="vulkan: check the logits against the CUDA library of the same preset")
    d = sub.add_parser("depth", parents=[common])
    d.add_argument("--prompts", default="512,4096,8192", help="prompt lengths for prefill (comma list)")
    d.add_argument("--depths", default="0,4096,8192", help="context depths for decode (comma list)")
    d.add_argument("--gen", type=int, default=128)
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--out", required=True)
    d.add_argument("--backend", choices=("cuda", "vulkan", "cpu"), default="cuda")
    cb = sub.add_parser("copy-bw")
    cb.add_argument("--device", choices=("cuda", "rocm", "cpu"), default="cuda")
    w = sub.add_parser("wgsl-copy")
    w.add_argument("--build", default=None, metavar="LIB")
    w.add_argument("--lib", default=None, metavar="LIB")
    w.add_argument("--scalar", action="store_true",
                   help="--build without wgsl_vector_params: four 4-byte loads and stores a row (TVM's WGSL)")
    g = sub.add_parser("make-gguf")
    g.add_argument("--preset", required=True, choices=list(GGUF_SHAPES))
    g.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py directory")
    g.add_argument("--vocab-dir", required=True, help="llama.cpp's models/ directory")
    g.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    prompts = [args.prompt] if args.cmd == "run" else (
        [int(x) for x in args.prompts.split(",") if x] if args.cmd == "depth" else [])
    if 1 in prompts:  # a 1-token "prefill" measures nothing (as llmchat bench refuses it)
        ap.error("a prefill figure needs a prompt of 2 tokens or more (--prompt 0 skips the prefill pass)")
    return {"compile": cmd_compile, "run": cmd_run, "copy-bw": cmd_copy_bw,
            "make-gguf": cmd_make_gguf, "wgsl-copy": cmd_wgsl_copy, "depth": cmd_depth}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
