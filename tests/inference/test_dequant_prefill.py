"""Dequantizing linear layers: decode keeps the dequantization inside the reduction, prefill
materialises the weight in its own ``dequantize`` stage of the same kernel (so schedules decode it
once per call, not once per activation row), and both compute what numpy computes.

Real TVM on tiny shapes; the GPU schedule is inspected without a GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from app.inference.pipelines.cpu import cpu_pipeline, scheduled_module
from app.inference.pipelines.cpu_attention import KERNEL_KIND_ATTR
from app.inference.quantization import get_format
from app.inference.quantization.base import DEQUANTIZE_STAGE

IN_F, OUT_F = 256, 64
FORMATS = ["q4f16_1", "q4f32_1", "ggml_q4_0"]
SPEC_MODE = {"param_mode": "packed", "effect_mode": "none"}
CUDA_TARGET = {
    "kind": "cuda",
    "arch": "sm_90",
    "max_shared_memory_per_block": 49152,
    "max_threads_per_block": 1024,
    "thread_warp_size": 32,
    "host": {"kind": "llvm"},
}


def _module(fmt_name: str, bias: bool = False, in_f: int = IN_F, out_f: int = OUT_F):
    """One linear layer exported as ``prefill`` ([1, n, in]) and ``decode`` ([1, 1, in])."""
    from tvm.relax.frontend import nn

    fmt = get_format(fmt_name)
    dtype = fmt.model_dtype

    class Proj(nn.Module):
        def __init__(self) -> None:
            self.proj = fmt.linear(in_f, out_f, bias=bias, dtype=dtype)

        def prefill(self, x):
            return self.proj(x)

        def decode(self, x):
            return self.proj(x)

    spec = {
        "prefill": {"x": nn.spec.Tensor([1, "n", in_f], dtype), "$": SPEC_MODE},
        "decode": {"x": nn.spec.Tensor([1, 1, in_f], dtype), "$": SPEC_MODE},
    }
    mod, named = Proj().export_tvm(spec=spec)
    return fmt, dtype, mod, named


def _kernel_of(mod, relax_name: str):
    """The PrimFunc that relax function ``relax_name`` calls (the layer's kernel)."""
    called = {str(gv.name_hint) for gv in _called_globals(mod[relax_name])}
    funcs = [
        f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint in called
    ]
    assert len(funcs) == 1, called
    return funcs[0]


def _called_globals(func):
    from tvm import relax

    found = []

    def visit(expr):
        if (
            isinstance(expr, relax.Call)
            and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name == "relax.call_tir"
        ):
            found.append(expr.args[0])

    relax.analysis.post_order_visit(func, visit)
    return found


def _block_names(func) -> set[str]:
    return set(re.findall(r'T\.sblock\("([^"]+)"', func.script()))


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_prefill_has_dequantize_stage_decode_stays_fused(fmt_name):
    _fmt, _dtype, mod, _named = _module(fmt_name)
    prefill, decode = _kernel_of(mod, "prefill"), _kernel_of(mod, "decode")
    assert DEQUANTIZE_STAGE in _block_names(prefill)
    assert DEQUANTIZE_STAGE not in _block_names(decode)
    # decode's reduction reads the stored (packed) params directly
    assert "dequant_matmul" in _block_names(decode)


@pytest.fixture(scope="module")
def cpu_target():
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


@pytest.mark.parametrize("prefill_gemm", [True, False], ids=["cpu_gemm", "generic"])
def test_cpu_schedule_decodes_weight_tiles_for_prefill_only(cpu_target, prefill_gemm):
    """Prompts run llmchat's prefill GEMM (or, with ``LLMCHAT_CPU_GEMM=tvm``, the generic schedule
    that decodes 8-row weight tiles); decode keeps its GEMV either way."""
    from app.inference.pipelines.cpu_schedule import CPUScheduleConfig

    _fmt, _dtype, mod, _named = _module("q4f16_1")
    scheduled = scheduled_module(mod, cpu_target, CPUScheduleConfig(prefill_gemm=prefill_gemm))
    kinds, texts = {}, {}
    for relax_name in ("prefill", "decode"):
        func = _kernel_of(scheduled, relax_name)
        assert func.attrs is not None and KERNEL_KIND_ATTR in func.attrs, relax_name
        kinds[relax_name] = str(func.attrs[KERNEL_KIND_ATTR])
        texts[relax_name] = func.script()
    assert kinds["decode"] == "block_gemv"
    if prefill_gemm:
        assert kinds["prefill"] == "prefill_gemm"
    else:
        assert kinds["prefill"] == "gemv" and "llmchat.dequantize_tile" in texts["prefill"]
    assert "llmchat.dequantize_tile" not in texts["decode"]


@pytest.mark.parametrize(
    ("fmt_name", "bias"),
    [("q4f16_1", False), ("q4f16_1", True), ("q4f32_1", False), ("q4f32_1", True), ("ggml_q4_0", False)],
)
def test_prefill_and_decode_match_numpy(cpu_target, fmt_name, bias):
    fmt, dtype, mod, named = _module(fmt_name, bias)
    ex = tvm.compile(mod, cpu_target, relax_pipeline=cpu_pipeline(cpu_target))
    vm = tvm.runtime.vm.VirtualMachine(ex, tvm.cpu())
    rng = np.random.default_rng(7)
    encoded = fmt.quantize(rng.standard_normal((OUT_F, IN_F)) / np.sqrt(IN_F))
    bias_values = rng.standard_normal(OUT_F).astype(dtype)
    arrays = {**encoded, "bias": bias_values}
    packed = [
        tvm.runtime.tensor(np.ascontiguousarray(arrays[n.rpartition(".")[2]]).astype(str(p.dtype)))
        for n, p in named
    ]
    weight = fmt.dequantize(encoded)
    tol = 1e-5 if dtype == "float32" else 5e-3
    for fn, rows in (("decode", 1), ("prefill", 1), ("prefill", 9), ("prefill", 33)):
        x = rng.standard_normal((1, rows, IN_F)).astype(dtype)
        out = vm[fn](tvm.runtime.tensor(x), packed).numpy().astype(np.float64)
        ref = x.astype(np.float64) @ weight.T + (bias_values.astype(np.float64) if bias else 0.0)
        assert np.abs(out - ref).max() <= tol * np.abs(ref).max(), (fn, rows)


def _gpu_kernels(monkeypatch, cuda_gemm: str) -> tuple[str, str]:
    """(prefill, decode) matmul kernels of the tiny module after the GPU schedule rules."""
    from tvm import relax
    from tvm.s_tir import dlight as dl

    from app.inference.pipelines import gpu

    monkeypatch.setenv("LLMCHAT_CUDA_GEMM", cuda_gemm)
    target = tvm.target.Target(CUDA_TARGET)
    _fmt, _dtype, mod, _named = _module("q4f16_1")
    with gpu._simt_matmul_only(), target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                gpu.fast_decode_pass(),
                dl.ApplyDefaultSchedule(*gpu.schedule_rules(target)),
            ]
        )(mod)
    return _kernel_of(mod, "prefill").script(), _kernel_of(mod, "decode").script()


def test_gpu_prefill_kernel_gets_a_tiled_matmul_schedule(monkeypatch):
    """With llmchat's tensor-core kernel switched off (``LLMCHAT_CUDA_GEMM=tvm``), the weight in
    its own stage lets dlight's Matmul rule tile the prefill kernel through shared memory (the
    dequantization moves into the tile loads); decode keeps the GEMV."""
    prefill, decode = _gpu_kernels(monkeypatch, "tvm")
    # a 2-D grid over (rows, columns) tiles, the dequantized weight tile staged in shared memory
    assert "blockIdx.y" in prefill and "dequantize_reindex_shared" in prefill
    assert "dequantize" not in decode and "blockIdx.y" not in decode


def test_gpu_prefill_kernel_is_llmchats_tensor_core_gemm_by_default(monkeypatch):
    prefill, decode = _gpu_kernels(monkeypatch, "")
    assert "llmchat::q4f16_gemm<" in prefill and "blockIdx.y" in prefill  # (columns, row tiles)
    assert "llmchat::q4f16_gemm<" not in decode


_STOCK_MATMUL_SCRIPT = """
import tvm
from tvm import relax
from tvm.s_tir import dlight as dl
from tests.inference.test_dequant_prefill import CUDA_TARGET, _kernel_of, _module

target = tvm.target.Target(CUDA_TARGET)
# every static dim over 64: the shapes that reach dlight's tensor-core path
_fmt, _dtype, mod, _named = _module("q4f16_1", bias=True, in_f=256, out_f=128)
with target, tvm.transform.PassContext(opt_level=3):
    mod = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(), relax.transform.FuseTIR(),
        dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Fallback()),
    ])(mod)
print("blockIdx.y" in _kernel_of(mod, "prefill").script())
"""


def test_stock_dlight_matmul_schedules_prefill_without_crashing():
    """TVM's stock pipeline (LLMCHAT_TVM_PIPELINE=default, and the fallback when llmchat's schedules
    fail) runs dlight's Matmul with its tensor-core path enabled; that path segfaults in TVM 0.27 on
    an fp16 first operand, so the prefill kernel must reach the SIMT path. Run in a subprocess: a
    segfault would otherwise take pytest down with it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _STOCK_MATMUL_SCRIPT], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
