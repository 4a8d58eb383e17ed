#!/usr/bin/env python3
"""The CUDA twin check: llmchat's ROCm runtime (app/inference/backends/hip), bound to NVIDIA's
driver API, against TVM's own CUDA runtime on the same compiled libraries.

What it is: the test of the runtime's shared code (argument packing, function table, grid/block,
streams, workspace pool, graphs, errors) on an NVIDIA GPU -- not a run on an AMD GPU.

For each model it runs two worker processes on the same library (TVM's CUDA runtime, then the
twin with ``LLMCHAT_GPU_RUNTIME=twin``) and compares:
  * logits, teacher-forced: a 150-token prompt, 8 decode steps, a 70-token second turn on the
    cached KV, 8 more steps (max relative error per step: max|twin - native| / max|native|);
  * greedy tokens: 32 steps with the host's argmax and, where the library has one, the device's;
  * a two-turn chat (models with a tokenizer: the tiny ones), greedy: the same texts;
  * decode tok/s (``--bench``, the random-weight presets): twin vs native, best of ``--repeats``.
Pass: every max relative error <= 1e-5, every token and text equal.

Usage (on the GPU machine; the TVM compiler and nvcc build what is not in the cache yet)
  python benchmarks/twin_check.py --cache DIR --out twin.json
  python benchmarks/twin_check.py --cache DIR --presets qwen2.5-0.5b --no-tiny --out twin.json
The presets' libraries can be built ahead of time elsewhere (``--arch sm_90``) with
  python benchmarks/gpu_decode.py compile --cache DIR --arch sm_90 --presets qwen2.5-0.5b --plain ""
(``compile`` records them in DIR/manifest.json, which this script honours like ``gpu_decode run``).
The tiny models' libraries and parameter lists come from the GPU suite's prebuilt cache
(tests/gpu/prebuilt.py, ``make gpu-cache``) on a machine without TVM's compiler:
  LLMCHAT_GPU_TEST_CACHE=C python benchmarks/twin_check.py --cache C/llmchat-cache --presets "" --out t.json
where nothing is compiled (a missing library is an error naming the cache); the same tiny-model
checks run in the GPU suite (tests/gpu/test_cuda_twin.py).

It prints one ``RESULT {...}`` line per model and writes the JSON summary to ``--out``:
  {"pass": bool, "device": ..., "models": {name: {"pass", "max_rel_err", "argmax_equal",
   "greedy_equal", "device_greedy_equal", "chat_equal", "decode_tok_s": {"native", "twin",
   "twin_over_native"}, "twin": {runtime proof: "cuda-twin", graph captures/launches}, ...}}}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the tiny models (tests/conftest.py's write_tiny_model): family, quantization, overrides
TINY = {
    "tiny-llama-q0f32": ("llama", "q0f32", {"hidden_size": 256, "intermediate_size": 512,
                                            "num_attention_heads": 4, "num_key_value_heads": 2,
                                            "context_window": 1024, "prefill_chunk": 256}),
    "tiny-llama-d128-q4f16_1": ("llama", "q4f16_1", {"hidden_size": 512, "intermediate_size": 1024,
                                                     "num_attention_heads": 4, "num_key_value_heads": 2,
                                                     "context_window": 1024, "prefill_chunk": 256}),
    "tiny-qwen2-d64-q4f16_1": ("qwen2", "q4f16_1", {"hidden_size": 256, "intermediate_size": 640,
                                                    "num_attention_heads": 4, "num_key_value_heads": 1,
                                                    "context_window": 1024, "prefill_chunk": 256}),
}
PROMPT, SECOND_TURN, STEPS, GREEDY_STEPS = 150, 70, 8, 32
REL_TOL = 1e-5
CHAT_TURNS = ("Hello! How are you?", "Tell me about llamas.")


# ------------------------------------------------------------------------------- worker ----------
def _scripted_logits(engine: Any) -> tuple[list[Any], list[int]]:
    import numpy as np

    vocab = engine.config.vocab_size
    ids = np.random.default_rng(7).integers(0, vocab, size=PROMPT + SECOND_TURN + 2 * STEPS).tolist()
    prompt, decoded, second = ids[:PROMPT], ids[PROMPT:PROMPT + 2 * STEPS], ids[PROMPT + 2 * STEPS:]
    rt = engine.runtime
    rt.clear()
    outs = [rt.prefill(prompt)]
    outs += [rt.decode(t) for t in decoded[:STEPS]]
    outs.append(rt.prefill(second))
    outs += [rt.decode(t) for t in decoded[STEPS:]]
    rt.clear()
    return [np.asarray(o, dtype=np.float32).reshape(-1) for o in outs], ids


def _greedy(engine: Any) -> tuple[list[int], list[int]]:
    """(host argmax tokens, device argmax tokens or [])."""
    import numpy as np

    rt = engine.runtime
    prompt = list(range(1, 17))
    rt.clear()
    tok = int(np.argmax(rt.prefill(prompt)))
    host = [tok]
    for _ in range(GREEDY_STEPS - 1):
        tok = int(np.argmax(rt.decode(tok)))
        host.append(tok)
    rt.clear()
    device: list[int] = []
    if getattr(rt, "has_device_argmax", False):
        tok = int(np.argmax(rt.prefill(prompt)))
        device = [tok]
        for _ in range(GREEDY_STEPS - 1):
            tok = rt.decode_greedy(tok)
            device.append(int(tok))
        rt.clear()
    return host, device


def _chat(engine: Any) -> list[str]:
    from app.inference.api import SamplingParams, TextDelta

    if getattr(engine, "tokenizer", None) is None:
        return []
    engine.reset()
    texts = []
    for turn in CHAT_TURNS:
        texts.append("".join(e.text for e in engine.chat(turn, SamplingParams(temperature=0.0, max_tokens=24))
                             if isinstance(e, TextDelta)))
    engine.reset()
    return texts


def cmd_worker(args: argparse.Namespace) -> int:
    import numpy as np

    os.environ["LLMCHAT_CACHE_DIR"] = str(Path(args.cache).resolve())
    if args.runtime == "twin":
        os.environ["LLMCHAT_GPU_RUNTIME"] = "twin"
    else:
        os.environ.pop("LLMCHAT_GPU_RUNTIME", None)
    from app.inference.compile.cuda_support import prepare_cuda_runtime
    from tests.gpu import prebuilt

    prepare_cuda_runtime()
    import tvm

    if prebuilt.cache_root() is not None:  # the GPU suite's prebuilt cache: load, never compile
        prebuilt.forbid_compiling(prebuilt.cache_root())

    import app.inference.compile.compiler as compiler
    from benchmarks import gpu_decode

    built: list[str] = []
    original = compiler.get_library

    def recording(*a: Any, **k: Any) -> Any:
        lib = compiler_get(*a, **k)
        built.append(str(lib.lib_path))
        return lib

    gpu_decode._use_manifest(Path(args.cache), args.quant, args.context)  # may wrap get_library
    compiler_get = compiler.get_library
    compiler.get_library = recording
    out: dict[str, Any] = {"runtime": args.runtime, "model": args.model}
    try:
        t0 = time.time()
        if args.model.startswith("preset:"):
            from app.inference.engine.random_model import load_random_engine

            engine = load_random_engine(args.model.split(":", 1)[1], args.quant, device="cuda",
                                        context_window=args.context)
        else:
            from app.inference.engine.tvm_engine import load_engine

            engine = load_engine(args.model.split(":", 1)[1], device="cuda")
        out["load_s"] = round(time.time() - t0, 2)
        out["library"] = built[-1] if built else None
        logits, fed = _scripted_logits(engine)
        host, device = _greedy(engine)
        out["chat"] = _chat(engine)
        if args.bench:
            out["bench"] = gpu_decode._bench_engine(engine, args.gen, args.prompt, args.repeats)
        out["device"] = tvm.cuda(0).device_name
        if args.runtime == "twin":
            from app.inference.backends.hip import addon

            out["twin"] = {"status": addon.status()["runtime"],
                           "graphs": json.loads(str(tvm.get_global_func("llmchat.gpu.graphs")())),
                           "bytes_allocated": int(tvm.get_global_func("llmchat.gpu.allocated")())}
        else:
            ours = tvm.get_global_func("llmchat.gpu.version", allow_missing=True)
            out["llmchat_runtime_loaded"] = ours is not None
        np.savez(args.npz, logits=np.stack(logits), fed=np.asarray(fed), host=np.asarray(host),
                 device=np.asarray(device, dtype=np.int64))
        engine.close()
    finally:
        compiler.get_library = original
    print("WORKER " + json.dumps(out), flush=True)
    return 0


# ------------------------------------------------------------------------------- driver ----------
def _run_worker(args: argparse.Namespace, runtime: str, model: str, npz: Path, bench: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "LLMCHAT_GPU_RUNTIME"}
    if runtime == "twin":
        env["LLMCHAT_GPU_RUNTIME"] = "twin"
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--runtime", runtime, "--model", model,
           "--cache", args.cache, "--quant", args.quant, "--context", str(args.context), "--npz", str(npz),
           "--gen", str(args.gen), "--prompt", str(args.prompt), "--repeats", str(args.repeats)]
    if bench:
        cmd.append("--bench")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=args.timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WORKER ")), None)
    if proc.returncode != 0 or line is None:
        return {"error": f"{runtime} worker exited {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"}
    return json.loads(line[len("WORKER "):])


def compare(native_npz: Path, twin_npz: Path) -> dict[str, Any]:
    """The comparison of two workers' outputs (also used by tests/gpu/test_cuda_twin.py)."""
    import numpy as np

    a, b = np.load(native_npz), np.load(twin_npz)
    nat, twin = a["logits"], b["logits"]
    errs = [float(np.abs(t - n).max() / (np.abs(n).max() + 1e-30)) for n, t in zip(nat, twin, strict=True)]
    return {
        "steps": len(errs),
        "max_rel_err": max(errs),
        "rel_err_per_step": [float(f"{e:.3g}") for e in errs],
        "bitwise_equal": bool(np.array_equal(nat, twin)),
        "finite": bool(np.isfinite(twin).all() and np.isfinite(nat).all()),
        "argmax_equal": int(sum(int(np.argmax(n) == np.argmax(t)) for n, t in zip(nat, twin, strict=True))),
        "greedy_equal": bool(np.array_equal(a["host"], b["host"])),
        "greedy_tokens": [int(x) for x in b["host"][:12]],
        "device_greedy_equal": bool(np.array_equal(a["device"], b["device"])),
        "device_greedy_steps": len(b["device"]),
    }


def options(cache: str | Path, **overrides: Any) -> argparse.Namespace:
    """The worker options with their defaults (for callers other than the command line)."""
    base = {"cache": str(cache), "quant": "q4f16_1", "context": 2048, "gen": 256, "prompt": 512, "repeats": 3,
            "timeout": 3600}
    base.update(overrides)
    return argparse.Namespace(**base)


def check_model(args: argparse.Namespace, name: str, model: str, work: Path, bench: bool) -> dict[str, Any]:
    """Native worker, twin worker, comparison: one model's entry of the summary."""
    res: dict[str, Any] = {"model": model}
    npz = {rt: work / f"{name}-{rt}.npz" for rt in ("native", "twin")}
    native = _run_worker(args, "native", model, npz["native"], bench)  # builds the library if needed
    twin = _run_worker(args, "twin", model, npz["twin"], bench)
    res["native"], res["twin"] = native, twin
    if "error" in native or "error" in twin:
        res["pass"] = False
        return res
    res.update(compare(npz["native"], npz["twin"]))
    res["same_library"] = native.get("library") == twin.get("library") and native.get("library") is not None
    res["chat_equal"] = native.get("chat") == twin.get("chat")
    res["chat"] = twin.get("chat")
    if bench:
        n, t = native["bench"]["decode_tok_s"], twin["bench"]["decode_tok_s"]
        res["decode_tok_s"] = {"native": n, "twin": t, "twin_over_native": round(t / n, 3) if n else None}
        if native["bench"].get("prefill_tok_s") is not None:  # None: no prefill pass (--prompt 0)
            pn, pt = native["bench"]["prefill_tok_s"], twin["bench"]["prefill_tok_s"]
            res["prefill_tok_s"] = {"native": pn, "twin": pt,
                                    "twin_over_native": round(pt / pn, 3) if pn else None}
    res["pass"] = bool(res["max_rel_err"] <= REL_TOL and res["finite"] and res["greedy_equal"]
                       and res["device_greedy_equal"] and res["chat_equal"] and res["same_library"]
                       and twin.get("twin", {}).get("status") == "cuda-twin"
                       and not native.get("llmchat_runtime_loaded"))
    return res


def cmd_run(args: argparse.Namespace) -> int:
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="twin-check-", dir=args.cache))
    models: dict[str, tuple[str, bool]] = {}
    if args.tiny:
        from tests.conftest import write_tiny_model

        for name, (family, quant, overrides) in TINY.items():
            path = Path(args.cache) / "twin-models" / name
            if not (path / "mlc-chat-config.json").exists():
                write_tiny_model(path, family, quant, **overrides)
            models[name] = (f"dir:{path}", False)
    for preset in filter(None, args.presets.split(",")):
        models[preset] = (f"preset:{preset}", True)
    summary: dict[str, Any] = {"what": "CUDA twin of llmchat's ROCm runtime vs TVM's CUDA runtime "
                                       "(same libraries); not a run on an AMD GPU",
                               "rel_tol": REL_TOL, "models": {}}
    for name, (model, bench) in models.items():
        try:
            res = check_model(args, name, model, work, bench and args.bench)
        except Exception as err:  # keep checking the other models
            res = {"pass": False, "error": f"{type(err).__name__}: {err}"[:3000]}
        summary["models"][name] = res
        summary["device"] = summary.get("device") or res.get("twin", {}).get("device")
        print("RESULT " + json.dumps({name: {k: v for k, v in res.items() if k not in ("native", "twin")}}),
              flush=True)
        summary["pass"] = all(m.get("pass") for m in summary["models"].values())
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({"pass": summary.get("pass"), "models": {
        k: {f: v.get(f) for f in ("pass", "max_rel_err", "greedy_equal", "chat_equal", "decode_tok_s",
                                  "error")}
        for k, v in summary["models"].items()}}, indent=1))
    return 0 if summary.get("pass") else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache", required=True, help="LLMCHAT_CACHE_DIR (libraries; made if missing)")
    common.add_argument("--quant", default="q4f16_1", help="quantization of the presets")
    common.add_argument("--context", type=int, default=2048, help="context window of the presets")
    common.add_argument("--gen", type=int, default=256, help="decode benchmark: tokens generated")
    common.add_argument("--prompt", type=int, default=512, help="prefill benchmark prompt (0: skip)")
    common.add_argument("--repeats", type=int, default=3)
    r = sub.add_parser("run", parents=[common], help="the check (default)")
    r.add_argument("--presets", default="qwen2.5-0.5b",
                   help="random-weight presets (comma list; '' for none)")
    r.add_argument("--no-tiny", dest="tiny", action="store_false", help="skip the tiny models")
    r.add_argument("--no-bench", dest="bench", action="store_false", help="skip the tok/s measurement")
    r.add_argument("--timeout", type=int, default=3600, help="seconds per worker")
    r.add_argument("--out", required=True)
    w = sub.add_parser("worker", parents=[common], help="one runtime, one model (internal)")
    w.add_argument("--runtime", choices=("native", "twin"), required=True)
    w.add_argument("--model", required=True, help="preset:NAME or dir:PATH")
    w.add_argument("--npz", required=True)
    w.add_argument("--bench", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("run", "worker", "-h", "--help"):
        argv = ["run", *argv]
    args = ap.parse_args(argv)
    return cmd_worker(args) if args.cmd == "worker" else cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
