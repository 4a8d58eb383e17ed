"""The CUDA twin of llmchat's ROCm runtime (app/inference/backends/hip, ``LLMCHAT_GPU_RUNTIME=twin``)
against TVM's own CUDA runtime, on the same libraries: kernels with scalars, views and big grids;
memory errors the chat survives; the tiny models' logits (relative error <= 1e-5), greedy tokens
(host and device argmax) and a two-turn chat, equal.  Each runtime runs in its own process (the
twin replaces TVM's CUDA names in the process that loads it): benchmarks/twin_check.py's workers,
the script the H200 check runs with the 0.5B-shape preset and tok/s.

This tests the runtime's shared code on an NVIDIA GPU; it is not a run on an AMD GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from benchmarks import twin_check

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


def _twin(code: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMCHAT_GPU_RUNTIME": "twin", "LLMCHAT_CACHE_DIR": str(cache)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module")
def twin_cache(cuda, tmp_path_factory) -> Path:
    """The workers' LLMCHAT_CACHE_DIR: a fresh one, or the prebuilt cache's engine libraries."""
    if cuda.cache is not None:
        return cuda.cache.engine_cache()
    return tmp_path_factory.mktemp("twin-cache")


def compile_scale_kernel(target, path: Path) -> Path:
    """B[i] = A[i] * s + k for any n, compiled for ``target`` (nvcc: a fatbin in the module) and
    exported to ``path`` (also by ``make gpu-cache``: tests/gpu/prebuilt.py)."""
    import tvm
    from tvm import s_tir, te

    from app.inference.compile.cuda_support import cuda_build_hooks

    n = te.var("n")
    s = te.var("s", dtype="float32")
    k = te.var("k", dtype="int32")
    a = te.placeholder((n,), name="A", dtype="float32")
    b = te.compute((n,), lambda i: a[i] * s + k.astype("float32"), name="B")
    mod = tvm.IRModule({"scale": te.create_prim_func([a, b, s, k]).with_attr("global_symbol", "scale")})
    sch = s_tir.Schedule(mod)
    sch.work_on("scale")
    (i,) = sch.get_loops(sch.get_sblock("B"))
    bx, tx = sch.split(i, [None, 32])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    with cuda_build_hooks(target, require=True) as info:
        lib = tvm.compile(sch.mod, target=target)
    assert info["compiled"] == 1
    path.parent.mkdir(parents=True, exist_ok=True)
    lib.export_library(str(path))
    return path


@pytest.fixture(scope="module")
def scale_lib(cuda, tmp_path_factory) -> Path:
    """The scale kernel for this GPU: compiled here, or from the prebuilt cache."""
    if cuda.cache is not None:
        return cuda.file("twin-scale")
    return compile_scale_kernel(cuda.target, tmp_path_factory.mktemp("twin-lib") / "scale.so")


def test_kernels_memory_and_attributes_through_the_twin(cuda, scale_lib, twin_cache):
    device = cuda.device
    out = _twin(
        f"""
        import json
        import numpy as np
        from app.inference.compile.cuda_support import prepare_cuda_runtime
        prepare_cuda_runtime()
        import tvm
        from app.inference.backends.hip import addon
        assert addon.status()["runtime"] == "cuda-twin"
        dev = tvm.cuda(0)
        lib = tvm.runtime.load_module({str(scale_lib)!r})
        report = {{"exist": dev.exist, "name": dev.device_name, "cc": dev.compute_version,
                   "warp": dev.warp_size, "threads": dev.max_threads_per_block, "kind": lib.imports[0].kind}}
        bad = []
        for n in (1, 31, 32, 33, 1000, 32 * 70_001 + 5):  # the last: a grid over 65,535 blocks
            a = np.random.default_rng(n).standard_normal(n).astype("float32")
            ta, tb = tvm.runtime.tensor(a, dev), tvm.runtime.empty((n,), "float32", dev)
            lib["scale"](ta, tb, 2.5, -3)
            # nvcc contracts a * s + k into one FMA (one rounding): a * 2.5 - 3 is exact in float64,
            # so its float32 rounding is the FMA's result; the unfused result is accepted too
            fused = (a.astype("float64") * 2.5 - 3).astype("float32")
            unfused = a * np.float32(2.5) + np.float32(-3)
            got = tb.numpy()
            if not (np.array_equal(got, fused) or np.array_equal(got, unfused)):
                bad.append(n)
        report["bad"] = bad
        # views at byte offsets: TVM moves the pointer (device pointer arithmetic on the host)
        base = np.arange(64, dtype="uint8")
        t = tvm.runtime.tensor(base, dev)
        v = t._create_view((7,), "uint8", 5)
        v.copyfrom(np.full(7, 200, "uint8"))
        base[5:12] = 200
        report["views"] = bool(np.array_equal(t.numpy(), base))
        # out of memory: an error with the numbers, and the device still works
        try:
            tvm.runtime.empty((1 << 46,), "float32", dev)
            report["oom"] = "no error"
        except Exception as err:
            report["oom"] = str(err)
        again = tvm.runtime.tensor(np.ones(8, "float32"), dev)
        report["after_oom"] = float(again.numpy().sum())
        print("REPORT " + json.dumps(report))
    """,
        twin_cache,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("REPORT "))[7:])
    assert got["exist"] and got["kind"] == "cuda"
    assert got["name"] == device.device_name and got["cc"] == device.compute_version
    assert got["warp"] == 32 and got["threads"] == device.max_threads_per_block
    assert got["bad"] == []
    assert got["views"]
    assert "out of GPU memory allocating" in got["oom"] and "bytes free" in got["oom"]
    assert got["after_oom"] == 8.0


@pytest.mark.parametrize("name", list(twin_check.TINY))
def test_tiny_models_match_tvms_cuda_runtime(cuda, twin_cache, tmp_path, name):
    """Logits to 1e-5 (float32 and float16 models), greedy tokens on the host and the device, a
    two-turn chat and CUDA graphs: the twin against TVM's CUDA runtime, on one library."""
    from tests.conftest import write_tiny_model

    family, quant, overrides = twin_check.TINY[name]
    model_dir = write_tiny_model(tmp_path / name, family, quant, **overrides)
    res = twin_check.check_model(
        twin_check.options(twin_cache), name, f"dir:{model_dir}", tmp_path, bench=False
    )
    assert "error" not in res["native"], res["native"]["error"]
    assert "error" not in res["twin"], res["twin"]["error"]
    print(
        f"{name}: max relative error {res['max_rel_err']:.2e}, bitwise equal {res['bitwise_equal']}, "
        f"graphs {res['twin']['twin']['graphs']}"
    )
    assert res["same_library"], (res["native"]["library"], res["twin"]["library"])
    assert res["twin"]["twin"]["status"] == "cuda-twin" and not res["native"]["llmchat_runtime_loaded"]
    assert res["finite"] and res["max_rel_err"] <= twin_check.REL_TOL, res["rel_err_per_step"]
    assert res["argmax_equal"] == res["steps"]
    assert res["greedy_equal"] and res["device_greedy_equal"]
    assert res["chat_equal"] and len(res["chat"]) == 2 and all(res["chat"])
    # llmchat's CUDA libraries capture their decode step: the twin captured and replayed graphs
    graphs = res["twin"]["twin"]["graphs"]
    assert graphs["captures"] >= 1 and graphs["launches"] >= 1


def test_the_compare_helper_sees_a_difference(tmp_path):
    """twin_check.compare is what the assertions above rely on: it must notice a changed logit
    and a changed token (runs anywhere; marked gpu with its file)."""
    logits = np.random.default_rng(0).standard_normal((4, 50)).astype("float32")
    np.savez(
        tmp_path / "a.npz",
        logits=logits,
        fed=np.arange(3),
        host=np.arange(5),
        device=np.arange(5, dtype=np.int64),
    )
    other = logits.copy()
    other[2, 7] += 1e-3 * np.abs(logits[2]).max()
    np.savez(
        tmp_path / "b.npz",
        logits=other,
        fed=np.arange(3),
        host=np.array([0, 1, 2, 3, 9]),
        device=np.arange(5, dtype=np.int64),
    )
    res = twin_check.compare(tmp_path / "a.npz", tmp_path / "b.npz")
    assert 0.9e-3 < res["max_rel_err"] < 1.1e-3 and not res["bitwise_equal"]
    assert not res["greedy_equal"] and res["device_greedy_equal"]
