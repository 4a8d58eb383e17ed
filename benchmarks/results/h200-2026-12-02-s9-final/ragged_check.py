"""TVM's WGSL ragged prefill attention (batch_prefill_ragged_kv, compiled here for lavapipe's
profile: r64.so = (4 q heads, 2 kv heads, d 64), r128.so = (4, 1, 128)) against numpy float64,
on whatever Vulkan adapter 0 is: lavapipe goes wrong past ~600-2000 rows."""
import sys, numpy as np, tvm
from pathlib import Path
from app.inference.backends import webgpu
from tests.gpu.kernels import prefill_reference
here = Path(__file__).parent
dev = webgpu.device(0)
print(webgpu.adapters()[0].name, flush=True)
for (h_q, h_kv, d, ns) in [(4, 2, 64, (300, 1000, 2000, 4000)), (4, 1, 128, (300, 600, 800, 1000, 2048))]:
    lib = tvm.runtime.load_module(str(here / f"r{d}.so"))
    rng = np.random.default_rng(0)
    for n in ns:
        q = rng.standard_normal((n, h_q, d)).astype(np.float16)
        k = rng.standard_normal((n, h_kv, d)).astype(np.float16)
        v = rng.standard_normal((n, h_kv, d)).astype(np.float16)
        ind = np.array([0, n], np.int32)
        want, wl = prefill_reference(q, k, v, [n], [n], True, d ** -0.5)
        T = lambda a: tvm.runtime.tensor(a, dev)
        out, lse = T(np.zeros(q.shape, np.float16)), T(np.zeros((n, h_q), np.float32))
        lib["ragged"](T(q), T(ind), T(k), T(v), T(ind), T(np.zeros(n, np.int32)), T(np.zeros(1, np.int32)), out, lse, 1, 0, 1.0, 10000.0, d ** -0.5)
        got = out.numpy().astype(np.float64)
        print(f"h_q {h_q} h_kv {h_kv} d {d} n {n}: max err {np.abs(got - want).max():.3e}  lse err {np.abs(lse.numpy() - wl).max():.2e}", flush=True)
