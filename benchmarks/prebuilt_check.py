"""Check a prebuilt library bundle on the machine it is meant for (e.g. a WGSL bundle built with
`llmchat build MODEL --device vulkan --arch wgsl-f16-wg49152-t256 --out DIR` on a machine without a
GPU, carried to the H200's Vulkan driver):

    python -m benchmarks.prebuilt_check --model MODEL_DIR --bundle DIR/<key> --device vulkan

The bundle is published next to the model's weights on the loopback Hub (tests/hub_server.py),
downloaded into an empty cache and loaded through llmchat's prebuilt path (manifest and sha256
checked); then the same model is compiled here into another empty cache.  Prints one JSON line:
whether the prebuilt library was used, the largest logit difference and whether the greedy tokens
agree (a bundle that fits runs the same code, so the logits should be equal).

On a machine without TVM's compiler (the H200 runs a runtime-only TVM) ``--reference float64``
compares the bundle's logits with the float64 numpy forward pass of the tests
(tests/inference/reference.py) instead of a local compile: relative error within ``--tol`` and the
same greedy tokens wherever the reference's top two differ by more than the tolerance."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = [5, 9, 14, 3, 27, 8, 41, 2]
STEPS = 16
MODEL_ID = "bundle-check"
REPO = "check/model"


def answers(engine) -> tuple[np.ndarray, list[int]]:
    rt = engine.runtime
    rows = [np.array(rt.prefill(PROMPT), dtype=np.float32).ravel()]
    tokens = [int(np.argmax(rows[0]))]
    for _ in range(STEPS - 1):
        rows.append(np.array(rt.decode(tokens[-1]), dtype=np.float32).ravel())
        tokens.append(int(np.argmax(rows[-1])))
    return np.stack(rows), tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, required=True, help="the model directory the bundle was built for"
    )
    parser.add_argument(
        "--bundle", type=Path, required=True, help="the bundle folder (manifest.json, model.so)"
    )
    parser.add_argument("--device", default="vulkan")
    parser.add_argument(
        "--reference",
        choices=("compile", "float64"),
        default="compile",
        help="what the bundle's answers are checked against",
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=1e-2,
        help="relative tolerance against the float64 reference (float16 compute: 1e-2)",
    )
    args = parser.parse_args()

    from tests.hub_server import HubServer

    root = Path(tempfile.mkdtemp(prefix="prebuilt-check-"))
    cfg = json.loads((args.model / "mlc-chat-config.json").read_text())
    registry = f"""[[model]]
id = "{MODEL_ID}"
name = "bundle check"
source = {{ hf = "{REPO}", revision = "main" }}
format = "mlc"
architecture = "{cfg.get("model_type", "llama")}"
quantization = "{cfg.get("quantization", "q4f16_1")}"
parameters = 1
download_bytes = 1
context_window = {int(cfg.get("context_window_size", 2048))}
license = "unknown"
gated = false
num_layers = 1
num_kv_heads = 1
head_dim = 1
vocab_size = 1
"""
    (root / "config").mkdir(parents=True)
    (root / "config" / "models_registry.toml").write_text(registry)
    files = {p.name: p.read_bytes() for p in args.model.iterdir() if p.is_file()}
    files.update({f"libs/{args.bundle.name}/{p.name}": p.read_bytes() for p in args.bundle.iterdir()})
    hub = HubServer().start()
    hub.add_repo(REPO, files)
    os.environ.update(
        {
            "HF_ENDPOINT": hub.endpoint,
            "LLMCHAT_DATA_DIR": str(root / "data"),
            "LLMCHAT_CACHE_DIR": str(root / "fresh-cache"),
            "LLMCHAT_CONFIG_DIR": str(root / "config"),
            "HF_HOME": str(root / "hf-home"),
        }
    )
    from app.inference.compile import build
    from app.inference.store.downloads import download_model
    from app.inference.engine.tvm_engine import load_engine

    out: dict = {"bundle": args.bundle.name, "device": args.device}
    try:
        download_model(MODEL_ID)
        messages: list[str] = []
        before = build.COMPILE_COUNT
        engine = load_engine(MODEL_ID, device=args.device, progress=lambda e: messages.append(e.message))
        out["prebuilt_used"] = any("using the prebuilt library" in m for m in messages)
        out["compiled_instead"] = before != build.COMPILE_COUNT
        out["messages"] = [m for m in messages if "prebuilt" in m]
        pre_logits, pre_tokens = answers(engine)
        engine.close()
    finally:
        hub.stop()
    if args.reference == "float64":
        ok = _against_float64(args.model, pre_logits, pre_tokens, args.tol, out)
        print(json.dumps(out), flush=True)
        return 0 if out["prebuilt_used"] and not out["compiled_instead"] and ok else 1
    os.environ["LLMCHAT_CACHE_DIR"] = str(root / "local-cache")
    engine = load_engine(args.model, device=args.device)
    loc_logits, loc_tokens = answers(engine)
    engine.close()
    out["max_abs_logit_diff"] = float(np.max(np.abs(pre_logits - loc_logits)))
    out["tokens_equal"] = pre_tokens == loc_tokens
    print(json.dumps(out), flush=True)
    return 0 if out["prebuilt_used"] and out["tokens_equal"] else 1


def _against_float64(model: Path, logits: np.ndarray, tokens: list[int], tol: float, out: dict) -> bool:
    """The bundle's logits against the tests' float64 forward pass over the same tokens."""
    from app.inference.store.weights import load_numpy
    from tests.inference.reference import forward

    config = json.loads((model / "mlc-chat-config.json").read_text())
    ref = forward(config, load_numpy(model), PROMPT + tokens[:-1])[len(PROMPT) - 1 :]
    scale = float(np.abs(ref).max())
    rel = np.abs(logits - ref).max(axis=1) / scale
    out["max_rel_logit_err"] = float(rel.max())
    decided = [i for i in range(len(tokens)) if np.diff(np.sort(ref[i])[-2:])[0] > 2 * tol * scale]
    out["tokens_checked"] = len(decided)
    out["tokens_equal"] = all(tokens[i] == int(np.argmax(ref[i])) for i in decided)
    return bool(rel.max() <= tol and out["tokens_equal"])


if __name__ == "__main__":
    raise SystemExit(main())
