"""llmchat's prompt GEMM for WGSL (``pipelines/gpu_gemm.WgslGemm``): it schedules the prefill's
(dequantizing) matmuls of the model, the WGSL it generates stages the tiles in workgroup memory
with one packed-word load per 8 weights, and on a real Vulkan driver (lavapipe in CI) it computes
what numpy computes in float64 for odd row counts, feature counts that are not a multiple of the
tile, q4f16_1, q4f32_1 and unquantized float16 weights."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from app.inference.pipelines import gpu
from app.inference.pipelines.gpu_gemm import CANDIDATES, WgslGemm, choose_gemm_config
from tests.inference.backends.vulkan_env import need_vulkan

WEBGPU = {
    "kind": "webgpu",
    "max_num_threads": 256,
    "max_shared_memory_per_block": 32768,
    "thread_warp_size": 1,
    "supports_subgroups": False,
    "host": {"kind": "llvm"},
}
ROWS = (1, 7, 33, 512)


def _target(shared: int = 32768):
    return tvm.target.Target({**WEBGPU, "max_shared_memory_per_block": shared})


def _prefill_kernel(fmt_name: str, in_f: int, out_f: int):
    """The fused prefill PrimFunc of one linear layer (``dequantize`` stage + matmul + cast)."""
    from tvm import relax

    from tests.inference.test_dequant_prefill import _kernel_of, _module

    fmt, dtype, mod, named = _module(fmt_name, in_f=in_f, out_f=out_f)
    with _target(), tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                gpu.fast_decode_pass(),
            ]
        )(mod)
    return fmt, dtype, _kernel_of(mod, "prefill"), named


def _f16_matmul(in_f: int, out_f: int):
    """``x[1, n, K] @ W[N, K].T`` with float16 operands and output, accumulated in float32."""
    from tvm import te

    n = te.var("n", "int64")
    one, in_f, out_f = (tvm.tirx.const(v, "int64") for v in (1, in_f, out_f))
    x = te.placeholder((one, n, in_f), "float16", name="x")
    w = te.placeholder((out_f, in_f), "float16", name="w")
    k = te.reduce_axis((tvm.tirx.const(0, "int64"), in_f), name="k")
    acc = te.compute(
        (one, n, out_f),
        lambda b, i, j: te.sum(w[j, k].astype("float32") * x[b, i, k].astype("float32"), axis=k),
        name="matmul",
    )
    out = te.compute((one, n, out_f), lambda b, i, j: acc[b, i, j].astype("float16"), name="out")
    return te.create_prim_func([x, w, out])


def _schedule(func, shared: int = 32768):
    target = _target(shared)
    with target:
        sch = WgslGemm().apply(func, target, False)
    assert sch is not None, "WgslGemm declined the prompt matmul"
    return sch.mod["main"]


def _wgsl(func) -> str:
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=_target())
    return "\n".join(m.inspect_source() for m in lib.mod.imports)


def test_config_fits_workgroup_memory_and_keeps_the_grid_busy():
    for cfg in CANDIDATES:  # whole runs of 8 (one q4 word) per K step, 16x16 threads
        assert cfg.bk % 8 == 0 and cfg.tile_f % 16 == 0 and cfg.tile_t % 16 == 0
    # Llama-2-7B q/o projection: 128x128 tiles would leave 128 workgroups for 512 rows
    seven_b = choose_gemm_config(4096, 4096, 49152)
    assert (seven_b.tile_f, seven_b.tile_t) == (128, 64)
    gate_up = choose_gemm_config(22016, 4096, 49152)
    assert (gate_up.tile_f, gate_up.tile_t) == (128, 128)
    small = choose_gemm_config(896, 896, 32768)
    assert small.tile_f * small.tile_t < seven_b.tile_f * seven_b.tile_t
    assert choose_gemm_config(4096, 4096, 1024) is None  # no tile fits
    for shared in (16384, 32768, 49152):
        cfg = choose_gemm_config(4096, 4096, shared)
        assert cfg.shared_bytes() <= shared


def test_schedule_tiles_in_workgroup_memory_with_one_word_load_per_eight_weights():
    _fmt, _dtype, func, _named = _prefill_kernel("q4f16_1", 4096, 4096)
    scheduled = _schedule(func, 49152)
    assert scheduled.attrs["llmchat_kernel"] == "wgsl_gemm"
    src = _wgsl(scheduled)
    assert "@workgroup_size(16, 16, 1)" in src
    # both tiles staged in workgroup memory as float32 (rows padded by one word)
    shared = dict(re.findall(r"var<workgroup> (\w+) : array<(f32), \d+>", src))
    assert len(shared) == 2, src[:2000]
    # the packed weights: one load of a word per thread and K step (not one per 4-bit value)
    assert len(re.findall(r"proj_q_weight_ptr\[", src)) == 1
    assert len(re.findall(r"proj_q_scale_ptr\[", src)) == 1
    # 8x4 accumulators per thread, FMAs from registers
    assert re.search(r"var \w+_local : array<f32, 32>;", src)
    assert src.count("fma(") >= 8 * 4 * 16


def test_the_models_prefill_matmuls_get_the_rule_and_decode_keeps_the_gemv(monkeypatch):
    # the q4f16_1 ones go to wgsl_q4_gemm by default (test_wgsl_q4_gemm.py); "tiled" gives them here
    monkeypatch.setenv("LLMCHAT_WGSL_GEMM", "tiled")
    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config
    from tests.inference.test_gpu_pipeline import _scheduled_functions

    target = _target()
    mod, _ = export_model(preset_config("tiny-llama", "q4f16_1"), target)
    funcs = _scheduled_functions(mod, target)
    gemm = {
        name
        for name, f in funcs.items()
        if f.attrs is not None and str(f.attrs.get("llmchat_kernel", "")) == "wgsl_gemm"
    }
    with_stage = {name for name, f in funcs.items() if "dequantize" in f.script() and "n" in f.script()}
    assert len(gemm) >= 4, sorted(funcs)  # qkv, o, gate_up, down (at least)
    assert all("dequant_matmul" in name for name in gemm), gemm
    assert gemm <= with_stage
    # decode GEMVs (one static row) are not the GEMM's
    single_row = r"x: T\.Buffer\(\(T\.int64\(1\), T\.int64\(1\),"
    assert not any(re.search(single_row, funcs[n].script()) for n in gemm)


def test_rule_is_off_with_the_switch(monkeypatch):
    monkeypatch.setenv("LLMCHAT_WGSL_GEMM", "tvm")
    assert not any(isinstance(r, WgslGemm) for r in gpu.schedule_rules(_target()))
    monkeypatch.delenv("LLMCHAT_WGSL_GEMM")
    rules = gpu.schedule_rules(_target())
    from tvm.s_tir import dlight as dl

    kinds = [type(r) for r in rules]
    assert kinds.index(WgslGemm) < kinds.index(dl.gpu.Matmul)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}})
    assert not any(isinstance(r, WgslGemm) for r in gpu.schedule_rules(cuda))


CASES = [
    # weights, in features, out features (200: not a multiple of any tile; 72 < a 128 tile)
    ("q4f16_1", 256, 200),
    ("q4f32_1", 512, 72),
    ("float16", 200, 200),  # K = 200: not a multiple of the K step either
    ("q4f16_1", 1024, 1000),
]


@pytest.mark.parametrize(("weights", "in_f", "out_f"), CASES, ids=[f"{w}-{i}x{o}" for w, i, o in CASES])
def test_gemm_matches_float64_on_vulkan(weights, in_f, out_f, tmp_path):
    need_vulkan()
    from app.inference.backends import webgpu

    rng = np.random.default_rng(in_f + out_f)
    w = rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)
    if weights == "float16":
        func = _f16_matmul(in_f, out_f)
        dtype = "float16"
        params = [w.astype("float16")]
        weight = params[0].astype(np.float64)
    else:
        fmt, dtype, func, named = _prefill_kernel(weights, in_f, out_f)
        enc = fmt.quantize(w)
        params = [np.ascontiguousarray(enc[n.rpartition(".")[2]]).astype(str(p.dtype)) for n, p in named]
        weight = fmt.dequantize(enc)
    scheduled = _schedule(func)
    lib = tvm.compile(tvm.IRModule({"main": scheduled.with_attr("global_symbol", "main")}), target=_target())
    lib.export_library(str(tmp_path / "gemm.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "gemm.so"))
    dev = webgpu.device(0)
    dparams = [tvm.runtime.tensor(p, dev) for p in params]
    tol = 2e-5 if dtype == "float32" else 2e-3
    for rows in ROWS:
        x = rng.standard_normal((1, rows, in_f)).astype(dtype)
        # rows past the end stay untouched: the output sits in a larger buffer filled with a marker
        big = tvm.runtime.tensor(np.full((rows + 3) * out_f, 7.0, dtype), dev)
        out = big._create_view((1, rows, out_f), dtype, 0)
        lib["main"](tvm.runtime.tensor(x, dev), *dparams, out)
        got = out.numpy().astype(np.float64)
        ref = x.astype(np.float64) @ weight.T
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= tol, f"{rows} rows: off by {err:.2e} (relative)"
        assert np.all(big.numpy()[rows * out_f :] == 7.0), f"{rows} rows: wrote past the output"
