"""Which sequence of calls makes the CUDA decode segfault after long prefills (device-side repro)."""
import faulthandler, os, sys, time
faulthandler.enable()
sys.path.insert(0, os.getcwd())
CACHE = os.environ.get("REPRO_CACHE", "scratch/depth/cache")
os.environ["LLMCHAT_CACHE_DIR"] = os.path.abspath(CACHE)
scenario = sys.argv[1]
preset = sys.argv[2] if len(sys.argv) > 2 else "llama2-7b"
import numpy as np
sys.argv = [sys.argv[0]]
import benchmarks.gpu_decode as gd
from pathlib import Path
from app.inference.compile.cuda_support import prepare_cuda_runtime
prepare_cuda_runtime()
gd._use_manifest(Path(CACHE), "q4f16_1", 8448)
from app.inference.engine.random_model import load_random_engine
from app.inference.api import SamplingParams
eng = load_random_engine(preset, "q4f16_1", device="cuda", context_window=8448)
rng = np.random.default_rng(3)
V = eng.config.vocab_size
print("prefill_chunk", eng.runtime.prefill_chunk, "ctx", eng.runtime.context_window, flush=True)
def run(n, m, temp=0.0):
    ids = rng.integers(0, V, size=max(1, n)).tolist()
    p = SamplingParams(temperature=temp, top_p=1.0, max_tokens=m, seed=0)
    for _ in eng.generate(ids, p, ignore_eos=True, detokenize=False):
        pass
    s = eng.last_stats
    print(f"  run({n},{m},t={temp}) ok prefill {s.prefill_tok_s:.0f} decode {s.decode_tok_s:.1f}", flush=True)
if os.environ.get("NO_FENCE") == "1":
    eng.runtime._make_fence = lambda: False
if scenario == "R":  # greedy batches vs one synchronous step at a time, same prompt
    rt = eng.runtime
    ids = rng.integers(0, V, size=300).tolist()
    p = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=200, seed=0)
    for _ in eng.generate(ids, p, ignore_eos=True, detokenize=False):
        pass
    from app.inference.engine.generation import GenerationResult, generate
    import threading
    rt.clear()
    res = GenerationResult()
    for _ in generate(rt, ids, p, kv_ids=[], cancel=threading.Event(), result=res):
        pass
    batched = list(res.token_ids)
    rt.clear()
    tok = int(np.argmax(rt.prefill(ids)))
    host = [tok]
    for _ in range(199):
        tok = int(np.argmax(rt.decode(tok)))
        host.append(tok)
    rt.clear()
    same = sum(a == b for a, b in zip(batched, host))
    first_diff = next((i for i, (a, b) in enumerate(zip(batched, host)) if a != b), None)
    print("R distinct host tokens", len(set(host)), "equal", same, "of", len(host), "first diff", first_diff, flush=True)
    sys.exit(0)
steps = {"A": [(1, 32), (8192, 1), (1, 129)],
         "B": [(1, 32), (512, 1), (1, 129)],
         "C": [(1, 32), (4096, 1), (1, 129)],
         "D": [(8192, 1), (1, 129)],
         "E": [(1, 32), (8192, 129)],
         "F": [(1, 32), (8192, 1), (1, 129, 0.7)],
         "G": [(1, 32), (2048, 1), (1, 129)],
         "H": [(1, 32), (3000, 1), (1, 129)],
         "I": [(1, 32), (4096, 129), (8192, 129)]}[scenario]
for st in steps:
    run(*st)
print("SCENARIO", scenario, "PASSED", flush=True)
