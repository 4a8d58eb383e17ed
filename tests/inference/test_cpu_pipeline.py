"""The CPU compiler pipeline: its kernels compute what numpy computes, and the schedules are really applied.

Tiny shapes compiled with the real TVM; no timing assertions (speed is measured by
benchmarks/cpu_decode.py)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from app.inference.pipelines.cpu import cpu_pipeline, scheduled_module
from app.inference.pipelines.cpu_attention import KERNEL_KIND_ATTR, decode_attention_kernel
from app.inference.pipelines.cpu_schedule import CPUScheduleConfig


@pytest.fixture(scope="module")
def target():
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def _kind(func) -> str | None:
    attrs = func.attrs
    return str(attrs[KERNEL_KIND_ATTR]) if attrs is not None and KERNEL_KIND_ATTR in attrs else None


# ------------------------------------------------------------------------------------------
# Linear layers (dequantize-in-reduction GEMV and plain matmul) through the whole pipeline
# ------------------------------------------------------------------------------------------
IN_F, OUT_F = 256, 40  # 40 rows: not a multiple of 32; 256 = one k-quant super-block


def _linear_module(fmt_name: str):
    from tvm.relax.frontend import nn

    from app.inference.quantization import get_format

    fmt = get_format(fmt_name)
    dtype = fmt.model_dtype

    class Proj(nn.Module):
        def __init__(self) -> None:
            self.proj = fmt.linear(IN_F, OUT_F, bias=False, dtype=dtype)

        def forward(self, x):
            return self.proj(x)

    spec = {
        "forward": {
            "x": nn.spec.Tensor([1, "n", IN_F], dtype),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    mod, named = Proj().export_tvm(spec=spec)
    return fmt, dtype, mod, named


#: formats with a numpy encoder (k-quants come only from GGUF files: their schedule is still checked)
ENCODABLE = ["q4f32_1", "q4f16_1", "q0f32", "q0f16", "ggml_q4_0", "ggml_q4_1", "ggml_q8_0", "ggml_f16"]
FORMATS = [*ENCODABLE, "ggml_q4_k", "ggml_q6_k"]


@pytest.fixture(scope="module", params=ENCODABLE)
def compiled_linear(request, target):
    fmt, dtype, mod, named = _linear_module(request.param)
    ex = tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target))
    rng = np.random.default_rng(0)
    encoded = fmt.quantize(rng.standard_normal((OUT_F, IN_F)) / np.sqrt(IN_F))
    params = {}
    for name, p in named:
        suffix = name.rpartition(".")[2]
        params[suffix] = np.ascontiguousarray(encoded[suffix]).astype(str(p.dtype))
    weight = fmt.dequantize(params)
    dev = tvm.cpu()
    vm = tvm.runtime.vm.VirtualMachine(ex, dev)
    packed = [tvm.runtime.tensor(params[name.rpartition(".")[2]], device=dev) for name, _ in named]
    return request.param, dtype, vm, packed, weight


@pytest.mark.parametrize("rows", [1, 7])
def test_linear_matches_numpy(compiled_linear, rows):
    name, dtype, vm, packed, weight = compiled_linear
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((1, rows, IN_F)).astype(dtype)
    out = vm["forward"](tvm.runtime.tensor(x, device=tvm.cpu()), packed).numpy()
    ref = x.astype(np.float64) @ weight.T
    tol = 1e-5 if dtype == "float32" else 5e-3
    assert out.shape == (1, rows, OUT_F)
    assert np.abs(out - ref).max() <= tol * np.abs(ref).max(), name


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_gemv_schedule_is_parallel_and_vectorized(target, fmt_name):
    # the generic schedule (prompt matmuls of block formats go to cpu_gemm unless LLMCHAT_CPU_GEMM=tvm)
    mod = scheduled_module(_linear_module(fmt_name)[2], target, CPUScheduleConfig(prefill_gemm=False))
    gemvs = [f for _gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and _kind(f) == "gemv"]
    assert gemvs, "no matmul kernel was scheduled as a GEMV"
    for func in gemvs:
        text = func.script()
        assert "T.parallel" in text and "T.vectorized" in text and "_rf" in text


def _dequantize_then_matmul_module(fmt_name: str):
    """A linear layer whose dequantization is its own compute (MLC's form): the CPU schedule
    decodes a tile of weight rows once per call when there are several activation rows."""
    from tvm import te
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    from app.inference.quantization import get_format

    fmt = get_format(fmt_name)
    dtype = fmt.model_dtype
    specs = fmt.param_specs(OUT_F, IN_F)
    names = list(specs)

    class Proj(nn.Module):
        def __init__(self) -> None:
            for pname, (shape, pdtype) in specs.items():
                setattr(self, pname, nn.Parameter(shape, pdtype))

        def forward(self, x):
            def compute(x, *tensors):
                params = dict(zip(names, tensors, strict=True))
                w = te.compute((OUT_F, IN_F), lambda n, k: fmt.dequant(params, n, k), name="dequantize")
                k = te.reduce_axis((0, IN_F), name="k")
                acc = te.compute(
                    [*x.shape[:-1], OUT_F],
                    lambda *i: te.sum(x(*i[:-1], k).astype("float32") * w[i[-1], k], axis=k),
                    name="matmul",
                )
                return te.compute(acc.shape, lambda *i: acc(*i).astype(dtype), name="out")

            return op.tensor_expr_op(compute, "dequantize_matmul", [x, *[getattr(self, n) for n in names]])

    spec = {
        "forward": {
            "x": nn.spec.Tensor([1, "n", IN_F], dtype),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    mod, named = Proj().export_tvm(spec=spec)
    return fmt, dtype, mod, named


@pytest.mark.parametrize("fmt_name", ["q4f32_1", "q4f16_1"])
def test_dequantize_tile_gemm(target, fmt_name):
    fmt, dtype, mod, named = _dequantize_then_matmul_module(fmt_name)
    scheduled = scheduled_module(mod, target)
    texts = [
        f.script()
        for _gv, f in scheduled.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and _kind(f) == "gemv"
    ]
    assert texts and all("llmchat.dequantize_tile" in t and "T.parallel" in t for t in texts)
    ex = tvm.compile(mod, target, relax_pipeline=cpu_pipeline(target))
    rng = np.random.default_rng(1)
    encoded = fmt.quantize(rng.standard_normal((OUT_F, IN_F)) / np.sqrt(IN_F))
    dev = tvm.cpu()
    vm = tvm.runtime.vm.VirtualMachine(ex, dev)
    packed = [
        tvm.runtime.tensor(
            np.ascontiguousarray(encoded[n.rpartition(".")[2]]).astype(str(p.dtype)), device=dev
        )
        for n, p in named
    ]
    weight = fmt.dequantize(encoded)
    for rows in (1, 7, 33):
        x = rng.standard_normal((1, rows, IN_F)).astype(dtype)
        out = vm["forward"](tvm.runtime.tensor(x, device=dev), packed).numpy()
        ref = x.astype(np.float64) @ weight.T
        tol = 1e-5 if dtype == "float32" else 5e-3
        assert np.abs(out - ref).max() <= tol * np.abs(ref).max(), rows


# ------------------------------------------------------------------------------------------
# Decode attention over a paged KV cache
# ------------------------------------------------------------------------------------------
H_KV, H_Q, HEAD_DIM, PAGE = 2, 6, 32, 16


def _paged_case(dtype: str, lengths: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    pages_per_seq = [-(-n // PAGE) for n in lengths]
    total = sum(pages_per_seq) + 2
    pages = rng.standard_normal((total, 2, H_KV, PAGE, HEAD_DIM)).astype(dtype)
    order = rng.permutation(total).astype("int32")  # pages scattered over the pool
    indptr = np.concatenate([[0], np.cumsum(pages_per_seq)]).astype("int32")
    values = order[: indptr[-1]]
    last_len = np.array([n - (p - 1) * PAGE for n, p in zip(lengths, pages_per_seq, strict=True)], "int32")
    q = rng.standard_normal((len(lengths), H_Q, HEAD_DIM)).astype(dtype)
    return q, pages, indptr, values, last_len


def _reference(q, pages, indptr, values, lengths):
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    for b, n in enumerate(lengths):
        seq_pages = values[indptr[b] : indptr[b + 1]]
        k = pages[seq_pages, 0].transpose(1, 0, 2, 3).reshape(H_KV, -1, HEAD_DIM)[:, :n].astype(np.float64)
        v = pages[seq_pages, 1].transpose(1, 0, 2, 3).reshape(H_KV, -1, HEAD_DIM)[:, :n].astype(np.float64)
        for h in range(H_Q):
            s = k[h // (H_Q // H_KV)] @ q[b, h].astype(np.float64) / np.sqrt(HEAD_DIM)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[h // (H_Q // H_KV)]
            lse[b, h] = (s.max() + np.log(p.sum())) / np.log(2)
    return out, lse


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_decode_attention_matches_numpy(target, dtype):
    lengths = [37, 1, 16]  # a partial last page, a single position, exactly one page
    q, pages, indptr, values, last_len = _paged_case(dtype, lengths)
    func = decode_attention_kernel(H_KV, H_Q, HEAD_DIM, dtype, False, PAGE)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros(q.shape, dtype), device=dev)
    lse = tvm.runtime.tensor(np.zeros(q.shape[:2], "float32"), device=dev)
    zeros = np.zeros(len(lengths), "int32")
    args = [tvm.runtime.tensor(a, device=dev) for a in (q, pages, indptr, values, last_len, zeros, zeros)]
    lib["main"](*args, out, lse, 0, 1.0, 10000.0, HEAD_DIM**-0.5)
    ref, ref_lse = _reference(q, pages, indptr, values, lengths)
    tol = 1e-5 if dtype == "float32" else 2e-3
    assert np.abs(out.numpy() - ref).max() <= tol * max(1.0, np.abs(ref).max())
    assert np.abs(lse.numpy() - ref_lse).max() <= 1e-3


def test_model_gets_our_kernels(target):
    """The model's matmuls are scheduled and TVM's scalar attention kernels are replaced."""
    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config

    cfg = preset_config("smollm2-135m", "q4f16_1", context_window=256)
    mod = scheduled_module(export_model(cfg, target)[0], target)
    kinds: dict[str, str | None] = {
        gv.name_hint: _kind(f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    }
    for symbol in (
        "batch_decode_paged_kv_cpu",
        "batch_prefill_paged_kv_cpu",
        "batch_prefill_ragged_kv",
        "merge_state_inplace_cpu",
    ):
        assert kinds[symbol] == "attention", symbol
    matmuls = {name: kind for name, kind in kinds.items() if "matmul" in name}
    allowed = ("gemv", "block_gemv", "prefill_gemm")
    assert matmuls and all(kind in allowed for kind in matmuls.values()), matmuls
    # the four decode projections take the group-factored q4f16_1 kernel (cpu_gemv.py), the four
    # prompt projections the register-blocked GEMM (cpu_gemm.py)
    assert sum(kind == "block_gemv" for kind in matmuls.values()) == 4, matmuls
    assert sum(kind == "prefill_gemm" for kind in matmuls.values()) == 4, matmuls


def test_model_builds_with_our_pipeline(tiny_model_dir, target, tmp_path):
    """The whole model compiles with llmchat's CPU pipeline: no kernel of it makes the compiler
    fall back to TVM's stock pipeline (which would still give right answers, slowly)."""
    from app.inference.compile.build import compile_library
    from app.inference.store.config import ModelConfig

    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    _params, stock = compile_library(cfg, target, tmp_path / "lib.so", report_pipeline=True)
    assert stock is False and (tmp_path / "lib.so").is_file()
