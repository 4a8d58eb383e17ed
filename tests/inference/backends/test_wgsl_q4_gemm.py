"""llmchat's hand-written q4f16_1 prompt GEMM for WGSL (``pipelines/wgsl_q4_gemm``): which prompt
matmuls it takes and which tile it picks, the WGSL it generates (vec4 tiles in workgroup memory,
the next step's loads ahead of this step's FMAs, four outputs a store), and on a real Vulkan
driver (lavapipe in CI) what numpy computes in float64, for prompts that are not a multiple of the
tile, with and without a bias and a residual, in every tile."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from app.inference.pipelines import gpu
from app.inference.pipelines.gpu_gemm import WgslGemm
from app.inference.pipelines.wgsl_q4_gemm import TILES, GemmTile, WgslQ4Gemm, choose_tile
from tests.inference.backends.test_webgpu_gemm import _target
from tests.inference.backends.vulkan_env import need_vulkan
from tests.inference.test_dequant_prefill import SPEC_MODE, _kernel_of

ROWS = (1, 7, 130, 300)  # one token, less than a tile, more than one tile and a part


def _layer(in_f: int, out_f: int, bias: bool, residual: bool, fmt_name: str = "q4f16_1"):
    """The fused prefill PrimFunc of one linear layer (+ bias) (+ residual), and its format."""
    from tvm import relax
    from tvm.relax.frontend import nn

    from app.inference.quantization import get_format

    fmt = get_format(fmt_name)
    dtype = fmt.model_dtype

    class Layer(nn.Module):
        def __init__(self) -> None:
            self.proj = fmt.linear(in_f, out_f, bias=bias, dtype=dtype)

        def prefill(self, x, r):
            y = self.proj(x)
            return y + r if residual else y

    spec = {
        "prefill": {
            "x": nn.spec.Tensor([1, "n", in_f], dtype),
            "r": nn.spec.Tensor([1, "n", out_f], dtype),
            "$": SPEC_MODE,
        }
    }
    mod, named = Layer().export_tvm(spec=spec)
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
    return fmt, _kernel_of(mod, "prefill"), named


def _gemm(func, tile: GemmTile | None = None, shared: int = 49152, half: bool = False):
    target = _target(shared)
    with target:
        sch = WgslQ4Gemm(tile, half=half).apply(func, target, False)
    return None if sch is None else sch.mod["main"]


def _compile(func, shared: int = 49152):
    from app.inference.pipelines import wgsl_vector_params

    wgsl_vector_params.install()  # as every WebGPU build of llmchat's (compile/build.py)
    return tvm.compile(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=_target(shared)
    )


def test_tile_choice_divides_the_features_fits_and_keeps_the_grid_busy():
    for tile in TILES:
        assert tile.tile_f % 64 == 0 and tile.tile_t % 64 == 0  # vec4 quads of 16 threads
    assert choose_tile(22016, 49152) == GemmTile(8, 8)  # Llama-2-7B gate_up: 688 workgroups
    assert choose_tile(12288, 49152) == GemmTile(8, 8)  # its q/k/v: 384
    assert choose_tile(4096, 49152) == GemmTile(8, 4)  # o and down: 128x128 would leave 128
    assert choose_tile(576, 49152) == GemmTile(4, 4)  # SmolLM2-135M: 576 = 9 x 64
    # 16 KiB of workgroup memory (WebGPU's default limit): fp32 tiles only of 64 x 64, fp16 ones
    # of 128 x 128
    assert GemmTile(4, 4).shared_bytes() == 16384 == GemmTile(8, 8, half=True).shared_bytes()
    assert choose_tile(22016, 16384) == GemmTile(4, 4)
    assert choose_tile(22016, 16384, half=True) == GemmTile(8, 8, half=True)
    assert choose_tile(22016, 49152, half=True) == GemmTile(8, 8, half=True)
    assert choose_tile(200, 49152) is None  # no tile divides the features
    assert choose_tile(4096, 8192) is None  # none fits
    assert choose_tile(4096, 8192, half=True) == GemmTile(4, 4, half=True)  # fp16 64 x 64
    assert choose_tile(4096, 4096, half=True) is None


@pytest.mark.parametrize("half", [True, False], ids=["fp16", "fp32"])
def test_wgsl_stages_vec4_tiles_and_loads_the_next_step_before_the_fmas(half):
    _fmt, func, _named = _layer(512, 256, bias=True, residual=True)
    gemm = _gemm(func, GemmTile(8, 8, half=half))
    assert gemm is not None and gemm.attrs["llmchat_kernel"] == "wgsl_q4_gemm"
    src = "\n".join(m.inspect_source() for m in _compile(gemm).mod.imports)
    assert "@workgroup_size(16, 16, 1)" in src
    # both tiles in workgroup memory as vec4s: 32 values of K x 128 features / tokens
    tile = "f16" if half else "f32"
    assert len(re.findall(rf"var<workgroup> \w+ : array<vec4<{tile}>, 1024>;", src)) == 2, src[:1500]
    # activations 4 values a load; output and residual 4 features a store / load
    for name in ("x_ptr", "out_ptr", "r_ptr"):
        assert re.search(rf"var<storage, read(_write)?> {name} : array<vec4<f16>>;", src), name
    loop = src[src.index("for (var st") :]
    body_fmas = loop.index("fma(") if "fma(" in loop else loop.index("acc[0i] = (acc[0i] +")
    # the next step's packed weights are read inside the loop before its first FMA
    assert "w_ptr[" in loop[:body_fmas]
    assert loop[:body_fmas].count("workgroupBarrier()") == 2
    if half:
        # 8 x 8 fp32 accumulators as 16 vec4s and a step's fp16 sums as 16 vec4<f16>: per K value
        # 4 workgroup loads and 16 vec4<f16> FMAs; the sums added to the accumulators once a step
        assert re.search(r"var acc : array<vec4<f32>, 16>;", src)
        assert re.search(r"var part : array<vec4<f16>, 16>;", src)
        fmas = re.findall(r"part\[(\d+)i\] = fma\(vec4<f16>\(", loop)
        assert len(fmas) == 16 * 32 and set(fmas) == {str(i) for i in range(16)}
        assert len(re.findall(r"acc\[\d+i\] = \(acc\[\d+i\] \+ vec4<f32>\(part\[\d+i\]\)\);", loop)) == 16
        assert "f16(((wr[0i]>>4u) & 15u))" in loop  # the weight decoded in fp16
    else:  # 8 x 8 fp32 accumulators, the weight decoded in fp32
        assert re.search(r"var acc : array<f32, 64>;", src)
        assert "part" not in src and "f32(((wr[0i]>>4u) & 15u))" in loop


@pytest.mark.parametrize(
    ("in_f", "out_f", "bias", "residual", "tile", "outliers"),
    [
        (256, 192, True, True, None, False),  # 64 x 64 tiles, Qwen's bias and the residual
        (512, 256, False, True, GemmTile(8, 8), False),
        (512, 256, True, False, GemmTile(8, 4), False),
        (512, 128, True, True, GemmTile(4, 8), False),
        (1024, 576, False, False, None, False),  # SmolLM2-135M's width
        # Llama's width, with a few activations 300 times the rest (as LLMs' massive activations)
        (4096, 256, False, True, GemmTile(8, 8), True),
        # fp16 products and a step's sums in fp16: every tile, and 128 steps of fp16 sums with
        # the outliers, none overflowing
        (256, 192, True, True, GemmTile(4, 4, half=True), False),
        (512, 256, True, True, GemmTile(8, 8, half=True), False),
        (512, 256, True, False, GemmTile(8, 4, half=True), True),
        (512, 128, False, True, GemmTile(4, 8, half=True), False),
        (4096, 256, False, True, GemmTile(8, 8, half=True), True),
    ],
    ids=[
        "64x64-bias-res",
        "128x128-res",
        "128x64-bias",
        "64x128-bias-res",
        "576-plain",
        "4096-outliers",
        "f16-64x64-bias-res",
        "f16-128x128-bias-res",
        "f16-128x64-bias-outliers",
        "f16-64x128-res",
        "f16-4096-outliers",
    ],
)
def test_gemm_matches_float64_on_vulkan(in_f, out_f, bias, residual, tile, outliers, tmp_path):
    need_vulkan()
    from app.inference.backends import webgpu

    fmt, func, named = _layer(in_f, out_f, bias, residual)
    gemm = _gemm(func, tile)
    assert gemm is not None
    dev = webgpu.device(0)  # registers the module loader
    _compile(gemm).export_library(str(tmp_path / "gemm.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "gemm.so"))
    rng = np.random.default_rng(in_f + out_f)
    enc = fmt.quantize(rng.standard_normal((out_f, in_f)) / np.sqrt(in_f))
    weight = fmt.dequantize(enc)
    b = rng.standard_normal(out_f).astype("float16")
    # the layer's parameters by the end of their names (proj.q_weight, proj.q_scale, proj.bias)
    params = {
        name.rpartition(".")[2]: (enc[name.rpartition(".")[2]] if "q_" in name else b) for name, _ in named
    }
    for rows in ROWS:
        x = rng.standard_normal((1, rows, in_f))
        if outliers:
            x[..., rng.choice(in_f, 4, replace=False)] *= 300.0
        x = x.astype("float16")
        r = rng.standard_normal((1, rows, out_f)).astype("float16")
        values = {"x": x, "r": r, **params}
        args = []
        for p in func.params[:-1]:  # the kernel's inputs in its order, then the output
            key = p.name if p.name in values else next(k for k in params if p.name.endswith(k))
            args.append(tvm.runtime.tensor(np.ascontiguousarray(values[key]).astype(str(p.dtype)), dev))
        assert len(args) == 3 + bias + residual
        # rows past the end stay untouched: the output sits in a larger buffer filled with a marker
        big = tvm.runtime.tensor(np.full((rows + 3) * out_f, 7.0, "float16"), dev)
        out = big._create_view((1, rows, out_f), "float16", 0)
        lib["main"](*args, out)
        got = out.numpy().astype(np.float64)
        ref = x.astype(np.float64) @ weight.T
        if bias:
            ref = ref + b.astype(np.float64)
        if residual:
            ref = ref.astype(np.float16).astype(np.float64) + r.astype(np.float64)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        # fp32 sums: 1.9-4.5e-4 (the fp16 output's rounding); fp16 sums of a group's 32 products:
        # 0.6-2.1e-3 here (the most at K = 4,096 with outliers), as numpy's model of them predicts
        tol = 4e-3 if tile is not None and tile.half else 2e-3
        assert err <= tol, f"{rows} rows: off by {err:.2e} (relative)"
        assert np.all(big.numpy()[rows * out_f :] == 7.0), f"{rows} rows: wrote past the output"


def test_declines_what_it_does_not_compute():
    _fmt, q4f32, _named = _layer(256, 128, bias=False, residual=False, fmt_name="q4f32_1")
    assert _gemm(q4f32) is None  # float32 activations: the scheduled GEMM's
    _fmt, narrow, _named = _layer(256, 200, bias=False, residual=False)
    assert _gemm(narrow) is None  # 200 features: no tile divides them
    _fmt, fits, _named = _layer(256, 128, bias=False, residual=False)
    assert _gemm(fits, shared=8192) is None  # no fp32 tile fits 8 KiB of workgroup memory
    assert _gemm(fits, shared=8192, half=True) is not None  # fp16 64 x 64
    assert _gemm(fits, shared=4096, half=True) is None
    assert _gemm(fits) is not None


def test_the_models_q4_prompt_matmuls_take_it_unless_switched_off(monkeypatch):
    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config
    from tests.inference.test_gpu_pipeline import _scheduled_functions

    def kernels() -> dict[str, str]:
        target = _target()
        mod, _ = export_model(preset_config("tiny-llama", "q4f16_1"), target)
        funcs = _scheduled_functions(mod, target)
        kinds = {name: f.attrs.get("llmchat_kernel", "") for name, f in funcs.items() if f.attrs is not None}
        return {name: str(kind) for name, kind in kinds.items()}

    monkeypatch.delenv("LLMCHAT_WGSL_GEMM", raising=False)
    rules = [type(r) for r in gpu.schedule_rules(_target())]
    assert rules.index(WgslQ4Gemm) < rules.index(WgslGemm)
    by_name = kernels()
    q4 = {name for name, kind in by_name.items() if kind == "wgsl_q4_gemm"}
    # q/k/v, o (+ residual), gate_up, down (+ residual)
    assert q4 == {
        "dequant_matmul",
        "dequant_matmul2",
        "fused_dequant_matmul1_add1",
        "fused_dequant_matmul3_add1",
    }
    assert [r.half for r in gpu.schedule_rules(_target()) if isinstance(r, WgslQ4Gemm)] == [False]
    monkeypatch.setenv("LLMCHAT_WGSL_GEMM", "f16")  # fp16 sums a K step (not yet measured)
    assert [r.half for r in gpu.schedule_rules(_target()) if isinstance(r, WgslQ4Gemm)] == [True]
    monkeypatch.setenv("LLMCHAT_WGSL_GEMM", "tiled")
    assert WgslQ4Gemm not in [type(r) for r in gpu.schedule_rules(_target())]
    by_name = kernels()
    assert not any(kind == "wgsl_q4_gemm" for kind in by_name.values())
    assert all(by_name[name] == "wgsl_gemm" for name in q4)
