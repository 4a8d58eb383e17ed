"""The group-factored 4-bit decode GEMV for CPUs (cpu_gemv.py): numpy's results for every format
and epilogue, compiled with the real TVM for this machine; which PrimFuncs the rule takes."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from app.inference.pipelines import cpu_gemv
from app.inference.quantization import get_format
from app.inference.quantization.base import dequant_matmul_te

K, N = 96, 40  # three q4 groups; 40 rows = ten tasks of four


def _te_gemv(
    k: int,
    n: int,
    epilogue: str,
    out_dtype: str = "float16",
    rows: int = 1,
    fmt_name: str = "q4f16_1",
    x_dtype: str = "float16",
):
    """The PrimFunc the model builds for one linear layer (the rule's input); ``x_dtype`` float32
    is what llmchat's CPU models compute in."""
    from tvm import te

    fmt = get_format(fmt_name)
    specs = fmt.param_specs(n, k)
    x = te.placeholder((1, rows, k), x_dtype, name="x")
    params = [te.placeholder(shape, dt, name=name) for name, (shape, dt) in specs.items()]
    args = [x, *params]
    if epilogue == "bias":
        args.append(te.placeholder((n,), "float16", name="bias"))
    out = dequant_matmul_te(fmt, list(specs), k, n, out_dtype)(*args)
    if epilogue == "residual":
        res = te.placeholder((1, rows, n), out_dtype, name="residual")
        args.append(res)
        out = te.compute(out.shape, lambda a, b, c: res[a, b, c] + out[a, b, c], name="T_add")
    return te.create_prim_func([*args, out])


def _run(func, arrays: list[np.ndarray], out_shape: tuple[int, ...], out_dtype: str) -> np.ndarray:
    target = tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(out_shape, out_dtype), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in arrays], out)
    return out.numpy()


@pytest.mark.parametrize(
    ("fmt_name", "x_dtype", "epilogue", "out_dtype"),
    [
        ("q4f16_1", "float16", "none", "float16"),
        ("q4f16_1", "float16", "none", "float32"),
        ("q4f16_1", "float16", "bias", "float16"),
        ("q4f16_1", "float16", "residual", "float16"),
        ("q4f16_1", "float32", "none", "float32"),
        ("q4f16_1", "float32", "bias", "float32"),
        ("q4f16_1", "float32", "residual", "float32"),
        ("ggml_q4_1", "float32", "none", "float32"),
        ("ggml_q4_1", "float32", "residual", "float32"),
        ("ggml_q4_1", "float32", "bias", "float32"),
        ("ggml_q4_0", "float32", "residual", "float32"),
        ("ggml_q8_0", "float32", "none", "float32"),
        ("ggml_q8_0", "float32", "residual", "float32"),
    ],
)
def test_factored_gemv_computes_the_layer(fmt_name, x_dtype, epilogue, out_dtype):
    fmt = get_format(fmt_name)
    rng = np.random.default_rng(3)
    encoded = fmt.quantize(rng.standard_normal((N, K)) / np.sqrt(K))
    x = rng.standard_normal((1, 1, K)).astype(x_dtype)
    arrays = [x, *(encoded[name] for name in fmt.param_specs(N, K))]
    ref = (x.reshape(1, K).astype(np.float64) @ fmt.dequantize(encoded).T).reshape(1, 1, N)
    if epilogue == "bias":
        bias = rng.standard_normal(N).astype(np.float16)
        arrays.append(bias)
        ref = ref + bias
    if epilogue == "residual":
        residual = rng.standard_normal((1, 1, N)).astype(out_dtype)
        arrays.append(residual)
        ref = ref + residual
    kernel = cpu_gemv.replace_block_gemv(
        _te_gemv(K, N, epilogue, out_dtype, fmt_name=fmt_name, x_dtype=x_dtype)
    )
    assert kernel is not None
    got = _run(kernel, arrays, (1, 1, N), out_dtype).astype(np.float64)
    tol = 1e-5 if out_dtype == "float32" else 2e-3
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()


def test_factored_gemv_takes_only_single_row_q4f16_1_layers():
    assert cpu_gemv.replace_block_gemv(_te_gemv(K, N, "none")) is not None
    assert cpu_gemv.replace_block_gemv(_te_gemv(K, N, "residual", "float32", x_dtype="float32")) is not None
    assert cpu_gemv.replace_block_gemv(_te_gemv(K, N, "none", rows=3)) is None  # prefill: the generic one
    assert cpu_gemv.replace_block_gemv(_te_gemv(K, N, "none", fmt_name="q4f32_1")) is None
    assert (
        cpu_gemv.replace_block_gemv(
            _te_gemv(K, N, "none", fmt_name="ggml_q8_0", x_dtype="float32", out_dtype="float32")
        )
        is not None
    )  # int8 values
    assert (
        cpu_gemv.replace_block_gemv(
            _te_gemv(256, N, "none", fmt_name="ggml_q4_k", x_dtype="float32", out_dtype="float32")
        )
        is None
    )  # K-quants: the generic one
    assert cpu_gemv.replace_block_gemv(_te_gemv(K, 42, "none")) is None  # rows not in fours
    kernel = cpu_gemv.replace_block_gemv(_te_gemv(K, N, "residual"))
    assert str(kernel.attrs["llmchat.cpu_kernel"]) == cpu_gemv.KERNEL_KIND
    text = kernel.script()
    assert "T.parallel" in text and "T.vectorized" in text and "llvm.prefetch" in text
