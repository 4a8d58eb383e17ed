"""llmchat's CPU prefill GEMM (pipelines/cpu_gemm.py) against numpy, compiled by the real CPU
pipeline: every weight format the rule takes, every epilogue, prompt lengths that are and are not
multiples of the register block (1, odd, 31/32/33, several blocks), both tile shapes (AVX-512 and
the portable one). Also: every PrimFunc of a CPU library is ``noalias`` (MarkNoAlias), which is what
lets LLVM keep the GEMM's accumulators in registers."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from app.inference.pipelines.cpu import cpu_pipeline, scheduled_module
from app.inference.pipelines.cpu_attention import KERNEL_KIND_ATTR
from app.inference.pipelines.cpu_gemm import KERNEL_KIND, k_slice, tile_shape
from app.inference.pipelines.cpu_schedule import CPUScheduleConfig
from app.inference.quantization import get_format

SPEC_MODE = {"param_mode": "packed", "effect_mode": "none"}
ROWS = (1, 2, 7, 31, 32, 33, 77)


def _native():
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def _module(
    fmt_name: str, in_f: int, out_f: int, epilogue: str, dtype: str | None = None, tied: bool = False
):
    """A layer exported as ``prefill(x[, r])`` over ``[1, n, in_f]`` activations."""
    from tvm.relax.frontend import nn

    fmt = get_format(fmt_name)
    dtype = dtype or fmt.model_dtype

    class Layer(nn.Module):
        def __init__(self) -> None:
            if tied:
                self.emb = fmt.embedding(out_f, in_f, dtype)
            else:
                self.proj = fmt.linear(in_f, out_f, bias=epilogue == "bias", dtype=dtype)

        def prefill(self, x, r):
            y = self.emb.lm_head_forward(x) if tied else self.proj(x)
            return y + r if epilogue == "residual" else y

    out_dtype = "float32" if tied else dtype
    spec = {
        "prefill": {
            "x": nn.spec.Tensor([1, "n", in_f], dtype),
            "r": nn.spec.Tensor([1, "n", out_f], out_dtype),
            "$": SPEC_MODE,
        }
    }
    mod, named = Layer().export_tvm(spec=spec)
    return fmt, dtype, out_dtype, mod, named


def _prefill_kernel(mod, target, config=None):
    scheduled = scheduled_module(mod, target, config)
    kinds = [
        str(f.attrs[KERNEL_KIND_ATTR])
        for _gv, f in scheduled.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and KERNEL_KIND_ATTR in f.attrs
    ]
    return kinds


def _check(fmt_name, in_f, out_f, epilogue, target, dtype=None, tied=False, rows=ROWS):
    fmt, dtype, out_dtype, mod, named = _module(fmt_name, in_f, out_f, epilogue, dtype, tied)
    assert KERNEL_KIND in _prefill_kernel(mod, target), "the prefill GEMM rule did not take the layer"
    ex = tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target))
    vm = tvm.runtime.vm.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(11)
    encoded = fmt.quantize(rng.standard_normal((out_f, in_f)) / np.sqrt(in_f))
    bias = rng.standard_normal(out_f).astype(dtype)
    arrays = {**encoded, "bias": bias}
    params = [
        tvm.runtime.tensor(np.ascontiguousarray(arrays[n.rpartition(".")[2]]).astype(str(p.dtype)))
        for n, p in named
    ]
    weight = fmt.dequantize(encoded)
    tol = 1e-5 if dtype == "float32" and out_dtype == "float32" else 5e-3
    for m in rows:
        x = rng.standard_normal((1, m, in_f)).astype(dtype)
        r = rng.standard_normal((1, m, out_f)).astype(out_dtype)
        out = vm["prefill"](tvm.runtime.tensor(x), tvm.runtime.tensor(r), params).numpy().astype(np.float64)
        ref = x.astype(np.float64)[0] @ weight.T
        if epilogue == "bias":
            ref = ref + bias.astype(np.float64)
        if epilogue == "residual":
            ref = ref + r.astype(np.float64)[0]
        assert out.shape == (1, m, out_f)
        err = np.abs(out[0] - ref).max() / np.abs(ref).max()
        assert err <= tol, (fmt_name, epilogue, m, err)


@pytest.mark.parametrize(
    ("fmt_name", "epilogue"),
    [
        ("ggml_q4_1", "none"),  # the default model's layers
        ("ggml_q4_1", "residual"),  # o_proj / down_proj with the residual add fused
        ("ggml_q4_0", "none"),
        ("ggml_q8_0", "residual"),
        ("q4f32_1", "none"),
        ("q4f16_1", "bias"),  # float16 activations, a float16 bias, a float16 output
        ("q4f16_1", "residual"),
    ],
)
def test_prefill_gemm_matches_numpy(fmt_name, epilogue):
    _check(fmt_name, 256, 96, epilogue, _native())


def test_prefill_gemm_odd_shapes_and_long_reduction():
    """40 output columns (tasks of 8 columns), a reduction of 1,536 (several L1 slices), and a
    q4f16_1 layer computed in float32 as llmchat's CPU engine does."""
    _check("ggml_q4_1", 1536, 40, "none", _native(), rows=(1, 33, 70))
    _check("q4f16_1", 1536, 40, "none", _native(), dtype="float32", rows=(5, 64))


def test_prefill_gemm_tied_lm_head():
    """The tied output layer over several rows (an embedding table in Q8_0, float32 logits)."""
    _check("ggml_q8_0", 128, 64, "none", _native(), tied=True, rows=(1, 3, 40))


def test_portable_tile_without_avx512():
    """Without AVX-512 the kernel uses 4 x 16 blocks of 16 prompt rows (8 ymm accumulators); the
    code still computes the same values (x86-64 with AVX2 runs on this machine)."""
    haswell = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
    assert tile_shape(haswell) == (4, 16, 16)
    _check("ggml_q4_1", 256, 48, "residual", haswell, rows=(1, 15, 16, 17, 50))


def test_avx512_tile_where_the_cpu_has_it():
    feats = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(_native())}
    assert tile_shape(_native()) == ((8, 32, 32) if "avx512f" in feats else (4, 16, 16))


def test_k_slice_divides_the_reduction():
    assert k_slice(576) == 192 and k_slice(1536) == 256 and k_slice(960) == 240 and k_slice(100) == 100
    for k in (32, 64, 96, 576, 960, 1536, 4096, 11008, 14336):
        c = k_slice(k)
        assert k % c == 0 and c <= 256


def test_switch_keeps_the_generic_schedule():
    """``prefill_gemm=False`` (``LLMCHAT_CPU_GEMM=tvm``) leaves the layer to the generic schedule."""
    _fmt, _dtype, _odt, mod, _named = _module("ggml_q4_1", 256, 96, "none")
    assert KERNEL_KIND not in _prefill_kernel(mod, _native(), CPUScheduleConfig(prefill_gemm=False))


def test_switch_from_environment(monkeypatch):
    monkeypatch.setenv("LLMCHAT_CPU_GEMM", "tvm")
    assert CPUScheduleConfig().prefill_gemm is False
    monkeypatch.setenv("LLMCHAT_CPU_GEMM", "")
    assert CPUScheduleConfig().prefill_gemm is True


def test_every_kernel_is_noalias_and_keeps_buffer_alias_tags():
    """relax adds a ``shape_func`` without ``noalias``; once MarkNoAlias has run, no buffer of the
    library falls back to TVM's generic "tvm-alias" tag (which kept the accumulators in memory)."""
    target = _native()
    _fmt, _dtype, _odt, mod, _named = _module("ggml_q4_1", 256, 96, "none")
    ex = tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target))
    llvm_ir = "".join(m.inspect_source("ll") for m in ex.mod.imports)
    assert "shape_func" in llvm_ir  # the function that used to poison the others is there
    assert '"tvm-alias"' not in llvm_ir
