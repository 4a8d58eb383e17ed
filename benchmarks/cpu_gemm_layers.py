#!/usr/bin/env python3
"""One prompt layer on the CPU: llmchat's prefill GEMM (pipelines/cpu_gemm.py) against the generic
schedule (``LLMCHAT_CPU_GEMM=tvm``) and OpenBLAS's float32 sgemm (numpy) on the same shapes, in one
process, alternating; CPU time of the process (robust on a shared machine: run it with
``TVM_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1`` for per-core figures).

    TVM_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_gemm_layers.py \\
        --format ggml_q4_1 --shape 576x3072 --rows 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.frontend import nn

    from app.inference.pipelines.cpu import cpu_pipeline
    from app.inference.pipelines.cpu_schedule import CPUScheduleConfig
    from app.inference.quantization import get_format

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="ggml_q4_1")
    ap.add_argument("--shape", default="576x3072", help="IN x OUT features (SmolLM2: 576x960, "
                    "576x576, 576x3072, 1536x576)")
    ap.add_argument("--rows", default="256", help="prompt rows, comma-separated")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    k, n = (int(v) for v in args.shape.lower().split("x"))
    fmt = get_format(args.format)
    dtype = fmt.model_dtype
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})

    class Proj(nn.Module):
        def __init__(self) -> None:
            self.proj = fmt.linear(k, n, bias=False, dtype=dtype)

        def prefill(self, x):
            return self.proj(x)

    spec = {"prefill": {"x": nn.spec.Tensor([1, "n", k], dtype),
                        "$": {"param_mode": "packed", "effect_mode": "none"}}}
    mod, named = Proj().export_tvm(spec=spec)
    rng = np.random.default_rng(0)
    params = fmt.quantize(rng.standard_normal((n, k)) / np.sqrt(k))
    weight = fmt.dequantize(params)
    dev = tvm.cpu()
    vms = {}
    for name, gemm in (("generic", False), ("cpu_gemm", True)):
        pipeline = cpu_pipeline(target, CPUScheduleConfig(prefill_gemm=gemm))
        ex = tvm.compile(mod, target=target, relax_pipeline=pipeline)
        vms[name] = relax.VirtualMachine(ex, dev)
    packed = [tvm.runtime.tensor(params[p.rpartition(".")[2]], dev) for p, _ in named]
    w32 = np.ascontiguousarray(weight.T.astype(np.float32))
    for m in (int(v) for v in args.rows.split(",")):
        x = rng.standard_normal((1, m, k)).astype(dtype)
        xt = tvm.runtime.tensor(x, dev)
        ref = x.astype(np.float64)[0] @ weight.T
        times: dict[str, list[float]] = {name: [] for name in (*vms, "openblas")}
        errors = {name: float(np.abs(vm["prefill"](xt, packed).numpy()[0] - ref).max() / np.abs(ref).max())
                  for name, vm in vms.items()}
        x32 = x[0].astype(np.float32)
        for _ in range(args.repeats):
            for name, vm in vms.items():
                t0 = time.process_time()
                vm["prefill"](xt, packed)
                times[name].append(time.process_time() - t0)
            t0 = time.process_time()
            x32 @ w32
            times["openblas"].append(time.process_time() - t0)
        for name, ts in times.items():
            best = min(ts)
            err = f", max error {errors[name]:.1e} (relative)" if name in errors else ""
            print(f"{args.format} {k}x{n}, {m} rows, {name}: {best * 1e3:.3f} ms CPU, "
                  f"{2 * m * n * k / best / 1e9:.1f} GFLOP/s{err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
