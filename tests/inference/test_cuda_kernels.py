"""llmchat's CUDA decode kernels: which PrimFuncs they replace, the launches they get, and that
nvcc compiles them inside a real model library (the kernels themselves run on the H200 only:
``benchmarks/gpu_decode.py run`` checks their logits and tokens against TVM's own pipeline)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from app.inference.compile import cuda_support
from app.inference.compile.device_ops import argmax_te, has_device_argmax
from app.inference.pipelines import (
    cuda_attention,
    cuda_gemm,
    cuda_gemv,
    cuda_kernels,
    cuda_rope_append,
    gpu,
    gpu_choices,
    gpu_gemv,
)
from app.inference.pipelines.cuda_argmax import CudaArgmax
from app.inference.pipelines.cuda_rms_norm import CudaRmsNorm
from app.inference.quantization import get_format
from app.inference.quantization.base import dequant_matmul_te

CUDA_TARGET = {
    "kind": "cuda",
    "arch": "sm_90",
    "max_shared_memory_per_block": 49152,
    "max_threads_per_block": 1024,
    "thread_warp_size": 32,
    "host": {"kind": "llvm"},
}


def _gemv(in_f: int, out_f: int, epilogue: str = "f16", fmt_name: str = "q4f16_1", rows: object = 1):
    """The fused PrimFunc the engine produces for one linear layer (+ epilogue); ``rows`` 1 is
    decode, anything else (a shape variable: the prompt length) prefill."""
    from tvm import te

    fmt = get_format(fmt_name)
    specs = fmt.param_specs(out_f, in_f)
    x = te.placeholder((1, rows, in_f), fmt.model_dtype, name="x")
    params = [te.placeholder(shape, dtype, name=name) for name, (shape, dtype) in specs.items()]
    args = [x, *params]
    if epilogue == "bias":
        args.append(te.placeholder((out_f,), "float16", name="bias"))
    out_dtype = "float32" if epilogue == "f32" else fmt.model_dtype
    out = dequant_matmul_te(fmt, list(specs), in_f, out_f, out_dtype)(*args)
    if epilogue == "res":
        res = te.placeholder((1, rows, out_f), "float16", name="res")
        args.append(res)
        out = te.compute(out.shape, lambda a, b, c: res[a, b, c] + out[a, b, c], name="T_add")
    return te.create_prim_func([*args, out])


@pytest.mark.parametrize("epilogue", ["f32", "f16", "bias", "res"])
def test_gemv_rule_matches_every_decode_epilogue(epilogue):
    target = tvm.target.Target(CUDA_TARGET)
    func = _gemv(4096, 4096, epilogue)
    match = cuda_gemv.match_q4f16_gemv(func)
    assert match is not None and (match.in_features, match.out_features) == (4096, 4096)
    assert (match.bias is not None) == (epilogue == "bias")
    assert (match.residual is not None) == (epilogue == "res")
    sch = cuda_gemv.CudaQ4Gemv().apply(func, target, False)
    script = sch.mod["main"].script()
    mode = {"f32": 0, "f16": 1, "bias": 1, "res": 2}[epilogue]
    assert f"llmchat::q4f16_gemv<4096, 4096, 4, 4, {mode}, " in script
    assert 'T.launch_thread("blockIdx.x", 1024)' in script  # 4096 rows / (4 rows x 4 warps / split 4)


@pytest.mark.parametrize("epilogue", ["f16", "bias", "res"])
def test_gemm_rule_takes_prompt_matmuls(epilogue):
    from tvm import te

    target = tvm.target.Target(CUDA_TARGET)
    seq_len = te.var("seq_len", "int64")
    func = _gemv(2048, 2560, epilogue, rows=seq_len)
    match = cuda_gemm.match_q4f16_gemm(func)
    assert match is not None and (match.in_features, match.out_features) == (2048, 2560)
    assert cuda_gemv.match_q4f16_gemv(func) is None  # decode's rule leaves it alone
    script = cuda_gemm.CudaQ4Gemm().apply(func, target, False).mod["main"].script()
    mode = {"f16": 1, "bias": 1, "res": 2}[epilogue]
    bias = "true" if epilogue == "bias" else "false"
    assert f"llmchat::q4f16_gemm<2048, 2560, 64, {mode}, {bias}, half>" in script  # narrow: 64 rows
    assert 'T.launch_thread("blockIdx.x", 40)' in script  # 2560 / 64 output columns per block
    assert 'T.launch_thread("threadIdx.x", 128)' in script
    assert "seq_len" in script  # the grid's second dimension follows the prompt length
    # decode-shaped, unquantized or odd-sized matmuls are not its business
    assert cuda_gemm.match_q4f16_gemm(_gemv(2048, 2560, epilogue)) is None
    assert cuda_gemm.match_q4f16_gemm(_gemv(2048, 2560, "f16", fmt_name="q0f16", rows=seq_len)) is None
    assert cuda_gemm.match_q4f16_gemm(_gemv(2048, 2592, "f16", rows=seq_len)) is None


def test_gemm_takes_128_prompt_rows_per_block_on_wide_layers():
    from tvm import te

    seq_len = te.var("seq_len", "int64")
    func = _gemv(2048, 4096, "f16", rows=seq_len)
    script = cuda_gemm.CudaQ4Gemm().apply(func, tvm.target.Target(CUDA_TARGET), False).mod["main"].script()
    # 4 warps along the outputs: 128 of them and 256 threads a block (RECORD spelled out before WN)
    assert "llmchat::q4f16_gemm<2048, 4096, 128, 1, false, half, false, 4>" in script
    assert "+ 127) // 128" in script or "+ T.int64(127)) // T.int64(128)" in script  # row tiles of 128
    assert 'T.launch_thread("blockIdx.x", 32)' in script  # 4096 / 128 output columns per block
    assert 'T.launch_thread("threadIdx.x", 256)' in script
    assert [cuda_gemm.tile_rows(n) for n in (896, 2560, 3072, 22016)] == [64, 64, 128, 128]
    # 128-row tiles take 4 warps where 128 columns divide the outputs; 64-row tiles keep 2
    assert [cuda_gemm.tile_warps(n) for n in (896, 2560, 3072, 3136, 22016)] == [2, 2, 4, 2, 4]


def test_wide_layers_take_the_mma_kernel_from_enough_prompt_rows():
    from tvm import te

    seq_len = te.var("seq_len", "int64")
    target = tvm.target.Target(CUDA_TARGET)
    script = cuda_gemm.CudaQ4Gemm(mma=True).apply(_gemv(2048, 4096, "res", rows=seq_len), target, False)
    script = script.mod["main"].script()
    # both kernels, the host picking by the prompt's length: 32 column tiles need 16 row tiles
    assert "llmchat::q4f16_gemm_mma<2048, 4096, 2, false, half>" in script
    assert "llmchat::q4f16_gemm<2048, 4096, 128, 2, false, half, false, 4>" in script
    assert cuda_gemm.mma_min_rows(4096) == 1921
    assert ">= 1921" in script or "1921 <=" in script
    assert script.count('T.launch_thread("threadIdx.x", 128)') == 1  # the mma kernel's 4 warps
    assert script.count('T.launch_thread("threadIdx.x", 256)') == 1  # the WMMA kernel's 8
    # 151,936 outputs give 1,187 column tiles: the mma kernel at every length, no branch
    lm_head = cuda_gemm.CudaQ4Gemm(mma=True).apply(_gemv(896, 151936, "f32", rows=seq_len), target, False)
    lm_head = lm_head.mod["main"].script()
    assert "llmchat::q4f16_gemm_mma<896, 151936, 0, false, float>" in lm_head
    assert "llmchat::q4f16_gemm<" not in lm_head and 'T.launch_thread("blockIdx.x", 1187)' in lm_head
    # narrow layers, and outputs or inputs not by 128, keep the WMMA kernel alone
    shapes = [(2048, 2560), (2048, 3136), (2112, 4096), (896, 9728)]
    assert [cuda_gemm.takes_mma(k, n) for k, n in shapes] == [False, False, False, True]
    narrow = cuda_gemm.CudaQ4Gemm(mma=True).apply(_gemv(2048, 2560, "f16", rows=seq_len), target, False)
    assert "q4f16_gemm_mma" not in narrow.mod["main"].script()
    assert [cuda_gemm.mma_min_rows(n) for n in (3072, 4608, 8192, 28672, 65536)] == [2689, 1793, 897, 257, 1]


def test_the_mma_gemm_needs_ampere_and_can_be_switched_off(monkeypatch):
    monkeypatch.delenv("LLMCHAT_CUDA_GEMM", raising=False)
    took = {a: gpu_choices.use_cuda_gemm_mma(_cuda(a)) for a in ("sm_75", "sm_80", "sm_90")}
    assert took == {"sm_75": False, "sm_80": True, "sm_90": True}
    rule = next(r for r in gpu.schedule_rules(_cuda("sm_90")) if isinstance(r, cuda_gemm.CudaQ4Gemm))
    assert rule.mma
    rule = next(r for r in gpu.schedule_rules(_cuda("sm_75")) if isinstance(r, cuda_gemm.CudaQ4Gemm))
    assert not rule.mma
    monkeypatch.setenv("LLMCHAT_CUDA_GEMM", "wmma")
    assert gpu_choices.use_cuda_gemm(_cuda("sm_90")) and not gpu_choices.use_cuda_gemm_mma(_cuda("sm_90"))


@pytest.mark.skipif(cuda_support.find_nvcc() is None, reason="nvcc not installed")
def test_both_prompt_gemm_kernels_compile_in_one_library():
    """nvcc accepts a wide layer's function with both kernels (bias, recorded q/k/v output)."""
    from tvm import te

    seq_len = te.var("seq_len", "int64")
    target = _cuda("sm_90")
    func = _gemv(1024, 3072, "bias", rows=seq_len).with_attr(cuda_kernels.RECORD_QKV_ATTR, True)
    new = cuda_gemm.CudaQ4Gemm(mma=True).apply(func, target, False).mod["main"]
    mod = tvm.IRModule({"main": new.with_attr("global_symbol", "main")})
    with cuda_support.cuda_build_hooks(target, require=True) as info:
        tvm.compile(mod, target)
    assert info["compiled"] == 1
    source = info["sources"][0]
    assert "llmchat::q4f16_gemm_mma<1024, 3072, 1, true, half, true>(" in source
    assert "llmchat::q4f16_gemm<1024, 3072, 128, 1, true, half, true, 4>(" in source


def test_gemv_rule_leaves_other_formats_and_prefill_alone():
    target = tvm.target.Target(CUDA_TARGET)
    rule = cuda_gemv.CudaQ4Gemv()
    assert rule.apply(_gemv(4096, 4096, "f32", fmt_name="q4f32_1"), target, False) is None
    assert rule.apply(_gemv(4096, 4096, "f16", rows=8), target, False) is None  # prefill: no annotation
    assert rule.apply(_gemv(4096, 4096, "f16", fmt_name="q0f16"), target, False) is None
    rocm = tvm.target.Target(
        {"kind": "rocm", "mcpu": "gfx1100", "mtriple": "amdgcn-amd-amdhsa-hcc", "host": {"kind": "llvm"}}
    )
    assert rule.apply(_gemv(4096, 4096), rocm, False) is None


def test_gemv_layout_splits_every_row_as_far_as_the_steps_go():
    qkv = cuda_gemv.choose_layout(out_features=12288, in_features=4096)  # Llama-2-7B qkv: 128 groups
    assert (qkv.rows_per_warp, qkv.warps_per_block, qkv.split) == (4, 4, 4)
    big = cuda_gemv.choose_layout(out_features=22016, in_features=4096)  # gate_up
    assert (big.rows_per_warp, big.warps_per_block, big.split) == (4, 4, 4)
    assert cuda_gemv.choose_layout(out_features=22016, in_features=2048).split == 2  # 64 groups
    down = cuda_gemv.choose_layout(out_features=4096, in_features=11008)  # few rows, long ones
    assert (down.rows_per_warp, down.warps_per_block, down.split) == (4, 8, 4)  # several steps per warp
    small = cuda_gemv.choose_layout(out_features=896, in_features=896)  # one step per lane only
    assert small.split == 1
    assert cuda_gemv.choose_layout(out_features=12, in_features=64).rows_per_warp == 1
    assert cuda_gemv.choose_layout(out_features=7, in_features=64) is None
    for n, k in [(12288, 4096), (4096, 4096), (2560, 2048), (1152, 896), (151936, 896)]:
        layout = cuda_gemv.choose_layout(n, k)
        assert layout.blocks(n) * layout.rows_per_warp * layout.warps_per_block // layout.split == n


def test_device_helpers_are_added_only_where_called():
    assert cuda_kernels.add_device_helpers("__global__ void f() {}") == "__global__ void f() {}"
    with_call = cuda_kernels.add_device_helpers("void g() { llmchat::argmax_f32<8>(0, 0); }")
    assert with_call.startswith(cuda_kernels.kernel_source())


def _decode_attention(num_heads: int, num_kv_heads: int, head_dim: int):
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode

    target = tvm.target.Target(CUDA_TARGET)
    return _attention_decode(num_kv_heads, num_heads, head_dim, "float16", False, {}, target)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "per_block", "chunks"),
    [(32, 32, 128, 1, 8), (16, 2, 128, 2, 32), (14, 2, 64, 1, 32)],
)
def test_decode_attention_is_split_along_the_sequence(heads, kv_heads, dim, per_block, chunks):
    func = cuda_attention.split_decode_attention(_decode_attention(heads, kv_heads, dim))
    script = func.script()
    kernel = f"llmchat::decode_attention<{heads}, {kv_heads}, {dim}, 16, {chunks}, {per_block}, 4, false>"
    assert kernel in script
    assert f'T.launch_thread("blockIdx.y", {heads // per_block})' in script
    assert "clusterCtaIdx" not in script
    assert "pages_elem_offset" in script  # the cache's views are passed with their offsets
    # sm_90: one head per block, 8 warps, chunks in a cluster: 8 for 32 heads, else 16 where allowed
    for max_cluster in (8, 16):
        func = cuda_attention.split_decode_attention(_decode_attention(heads, kv_heads, dim), max_cluster)
        script = func.script()
        nc = 8 if heads >= 32 else max_cluster
        assert f"llmchat::decode_attention<{heads}, {kv_heads}, {dim}, 16, {nc}, 1, 8, true>" in script
        assert f'T.launch_thread("clusterCtaIdx.x", {nc})' in script
        assert f'T.launch_thread("blockIdx.x", {nc})' in script
        assert f'T.launch_thread("blockIdx.y", {heads})' in script
        assert 'T.launch_thread("threadIdx.y", 8)' in script


def _value(expr, names: dict[str, int]) -> int:
    """An integer TIR expression of products, sums, comparisons and conjunctions, with its
    variables given by name."""
    from tvm import tirx

    ops = {
        tirx.Mul: lambda a, b: a * b,
        tirx.Add: lambda a, b: a + b,
        tirx.GE: lambda a, b: int(a >= b),
        tirx.LE: lambda a, b: int(a <= b),
        tirx.LT: lambda a, b: int(a < b),
        tirx.GT: lambda a, b: int(a > b),
        tirx.And: lambda a, b: int(bool(a) and bool(b)),
    }
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        return names[expr.name]
    return ops[type(expr)](_value(expr.a, names), _value(expr.b, names))


def _takes_groups(func, pages: int, batch: int) -> bool:
    """The host code's choice in ``func`` (a branch between two launches) for ``pages`` pages of
    the batch (``page_table_values``' length) and ``batch`` sequences: the 4-head blocks?"""
    from tvm import tirx

    assert isinstance(func.body, tirx.IfThenElse), type(func.body)
    return bool(_value(func.body.condition, {"nnz_pages": pages, "B": batch}))


def test_gqa4_decode_attention_picks_its_kernel_by_the_keys():
    """Llama-3-8B's shape on sm_90: one head per block in clusters for short sequences, the
    tensor-core kernel for the 4 query heads of a kv head (global-memory merge, 16 chunks for 8
    kv heads: 128 blocks, 8 warps) from 1,024 keys per sequence on; the choice is a branch of the
    PrimFunc's host code between the two launches. ``groups`` keeps the blocks of 4 heads on CUDA
    cores."""
    mma = "llmchat::decode_attention_mma<32, 8, 128, 16, 16, 8>"
    groups = "llmchat::decode_attention<32, 8, 128, 16, 32, 4, 8, false>"
    clusters = "llmchat::decode_attention<32, 8, 128, 16, 8, 1, 8, true>"
    func = cuda_attention.split_decode_attention(_decode_attention(32, 8, 128), 16)
    script = func.script()
    assert mma in script and clusters in script and groups not in script
    assert 'T.launch_thread("blockIdx.y", 8)' in script and 'T.launch_thread("blockIdx.y", 32)' in script
    assert script.index(mma) < script.index("else:") < script.index(clusters)
    # 1,024 keys = 64 pages of 16 per sequence; the batch counts its pages together
    assert _takes_groups(func, 64, 1) and not _takes_groups(func, 63, 1)
    assert _takes_groups(func, 4 * 64, 4) and not _takes_groups(func, 4 * 64 - 1, 4)
    assert _takes_groups(func, 16 * 500, 16)
    # 17 sequences: 17 x 32 heads x 16 chunks states overflow the scratch area (8,192): clusters
    assert not _takes_groups(func, 17 * 500, 17)
    # the groups kernel keeps its own threshold (3,072 keys) and its 32 chunks
    grp = cuda_attention.split_decode_attention(_decode_attention(16, 4, 64), 16)
    assert _takes_groups(grp, 192, 1) and not _takes_groups(grp, 191, 1)
    # another threshold
    low = cuda_attention.split_decode_attention(_decode_attention(32, 8, 128), 16, gqa_min_keys=256)
    assert _takes_groups(low, 16, 1) and not _takes_groups(low, 15, 1)
    # forced: one launch, no branch
    for mode, kernel in (("groups", groups), ("mma", mma)):
        only = cuda_attention.split_decode_attention(_decode_attention(32, 8, 128), 16, mode).script()
        assert kernel in only and clusters not in only and "clusterCtaIdx" not in only and "if " not in only
    only = cuda_attention.split_decode_attention(_decode_attention(32, 8, 128), 8, "cluster").script()
    assert mma not in only and groups not in only and clusters in only and "if " not in only
    # the fused RoPE/append goes with every kernel
    fused = _decode_attention(32, 8, 128).with_attr(cuda_rope_append.FUSED_ATTR, True)
    script = cuda_attention.split_decode_attention(fused, 16).script()
    assert mma.replace(">", ", true>") in script and clusters.replace(">", ", true>") in script
    script = cuda_attention.split_decode_attention(fused, 16, "groups").script()
    assert groups.replace(">", ", true>") in script
    with pytest.raises(ValueError, match="gqa must be one of"):
        cuda_attention.split_decode_attention(_decode_attention(32, 8, 128), 16, "heads")


def test_fewer_kv_heads_take_the_tensor_core_kernel_later():
    """Qwen2.5-3B's shape (8 query heads per kv head, 2 kv heads): the tensor-core kernel from
    3,072 keys (fewer blocks: the cluster kernel stays ahead longer), 32 chunks (the most the
    merge takes); a set threshold wins."""
    func = cuda_attention.split_decode_attention(_decode_attention(16, 2, 128), 16)
    script = func.script()
    assert "llmchat::decode_attention_mma<16, 2, 128, 16, 32, 8>" in script
    assert _takes_groups(func, 192, 1) and not _takes_groups(func, 191, 1)
    assert [cuda_attention.mma_chunks(h) for h in (1, 2, 4, 8, 16, 256)] == [32, 32, 32, 16, 8, 1]
    set_ = cuda_attention.split_decode_attention(_decode_attention(16, 2, 128), 16, gqa_min_keys=1024)
    assert _takes_groups(set_, 64, 1) and not _takes_groups(set_, 63, 1)
    assert cuda_attention.long_context_kernel(28, 4, 128, 16, "auto") == "mma"  # 7 heads: padded to 8
    assert cuda_attention.long_context_kernel(16, 4, 64, 16, "auto") == "groups"  # head dim 64
    assert cuda_attention.long_context_kernel(16, 4, 64, 16, "mma") is None
    assert cuda_attention.long_context_kernel(32, 8, 128, 16, "groups") == "groups"
    assert cuda_attention.long_context_kernel(32, 8, 128, 8, "auto") == "groups"  # pages of 8 keys
    assert cuda_attention.long_context_kernel(32, 32, 128, 16, "mma") is None  # no groups
    assert cuda_attention.long_context_kernel(64, 4, 128, 16, "auto") is None  # 16 heads a kv head


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 32, 128), (14, 2, 64), (16, 8, 64)])
def test_other_group_sizes_keep_one_kernel(heads, kv_heads, dim):
    """Shapes neither long-context kernel takes keep one launch whatever the switch says, and so
    does every shape before sm_90."""
    for gqa in cuda_attention.GQA_MODES:
        script = cuda_attention.split_decode_attention(
            _decode_attention(heads, kv_heads, dim), 16, gqa
        ).script()
        assert script.count("llmchat::decode_attention") == 1 and ", 1, 8, true>" in script
    for gqa in cuda_attention.GQA_MODES:
        script = cuda_attention.split_decode_attention(_decode_attention(32, 8, 128), 0, gqa).script()
        assert script.count("llmchat::decode_attention") == 1
        assert "llmchat::decode_attention<32, 8, 128, 16, 16, 2, 4, false>" in script


def test_the_gqa_decode_switches(monkeypatch):
    """``LLMCHAT_CUDA_GQA_DECODE`` / ``LLMCHAT_CUDA_GQA_MIN_KEYS`` reach the decode attention
    pass and the library's cache key; a value that is none of the choices stops the build."""
    from app.errors import LlmchatError
    from app.inference.compile import cache

    monkeypatch.delenv("LLMCHAT_CUDA_GQA_DECODE", raising=False)
    monkeypatch.delenv("LLMCHAT_CUDA_GQA_MIN_KEYS", raising=False)
    assert gpu_choices.cuda_gqa_decode() == ("auto", 0)  # 0: the shape's threshold
    monkeypatch.setenv("LLMCHAT_CUDA_GQA_DECODE", " Groups ")
    monkeypatch.setenv("LLMCHAT_CUDA_GQA_MIN_KEYS", "1024")
    assert gpu_choices.cuda_gqa_decode() == ("groups", 1024)
    switches = cache._kernel_switches()
    assert switches["LLMCHAT_CUDA_GQA_DECODE"] == "groups" and switches["LLMCHAT_CUDA_GQA_MIN_KEYS"] == "1024"
    monkeypatch.setenv("LLMCHAT_CUDA_GQA_DECODE", "cluster")
    mod = tvm.IRModule({"batch_decode_paged_kv": _decode_attention(32, 8, 128)})
    mod = gpu.attention_passes(_cuda("sm_90"))[0](mod)
    script = mod["batch_decode_paged_kv"].script()
    assert script.count("llmchat::decode_attention") == 1 and "clusterCtaIdx" in script
    monkeypatch.setenv("LLMCHAT_CUDA_GQA_DECODE", "auto")
    mod = gpu.attention_passes(_cuda("sm_90"))[0](
        tvm.IRModule({"batch_decode_paged_kv": _decode_attention(32, 8, 128)})
    )
    assert "nnz_pages * 16 >= B * 1024" in mod["batch_decode_paged_kv"].script()
    monkeypatch.setenv("LLMCHAT_CUDA_GQA_DECODE", "heads")
    with pytest.raises(LlmchatError, match="LLMCHAT_CUDA_GQA_DECODE"):
        gpu_choices.cuda_gqa_decode()
    monkeypatch.setenv("LLMCHAT_CUDA_GQA_DECODE", "auto")
    for bad in ("0", "3k", "-5"):
        monkeypatch.setenv("LLMCHAT_CUDA_GQA_MIN_KEYS", bad)
        with pytest.raises(LlmchatError, match="LLMCHAT_CUDA_GQA_MIN_KEYS"):
            gpu_choices.cuda_gqa_decode()


def test_the_scratch_area_sizes_match_the_kernels():
    """The host code's check that a batch's states fit the global-memory merge uses the sizes
    cuda_kernels.cu declares."""
    source = cuda_kernels.kernel_source()
    assert f"constexpr int ATTN_SCRATCH_ROWS = {cuda_attention.ATTN_SCRATCH_ROWS};" in source
    assert "constexpr int ATTN_SCRATCH_FLOATS = 8192 * 128;" in source
    assert cuda_attention.ATTN_SCRATCH_FLOATS == 8192 * 128


def _prefill_attention(num_heads: int, num_kv_heads: int, head_dim: int):
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_prefill_ragged

    target = tvm.target.Target(CUDA_TARGET)
    return _attention_prefill_ragged(num_kv_heads, num_heads, head_dim, head_dim, "float16", {}, target)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 32, 128), (14, 2, 64)])
def test_prompt_attention_runs_on_tensor_cores(heads, kv_heads, dim):
    func = cuda_attention.prefill_attention(_prefill_attention(heads, kv_heads, dim))
    script = func.script()
    assert f"llmchat::prefill_attention<{heads}, {kv_heads}, {dim}>" in script
    assert f'T.launch_thread("blockIdx.y", {heads})' in script
    assert "T.address_of(q_indptr[0])" in script  # a view: lowered with its element offset
    assert "(qo_len + 63) // 64 + (batch_size + 1 - 1)" in script  # 64-row tiles, a spare per sequence
    # a PrimFunc that is not TVM's prompt attention is left alone, and so are heads too wide for
    # the kernel's shared-memory tiles
    assert cuda_attention.prefill_attention(_decode_attention(heads, kv_heads, dim)) is None
    assert cuda_attention.prefill_attention(_prefill_attention(heads, kv_heads, 256)) is None


def _paged_prefill_attention(num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: bool = False):
    from tvm.relax.frontend.nn.llm.kv_cache import _attention_prefill

    target = tvm.target.Target(CUDA_TARGET)
    return _attention_prefill(num_kv_heads, num_heads, head_dim, "float16", sliding_window, {}, target)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 32, 128), (32, 8, 128), (14, 2, 64)])
def test_prompt_attention_to_the_cached_pages_runs_on_tensor_cores(heads, kv_heads, dim):
    func = cuda_attention.prefill_paged_attention(_paged_prefill_attention(heads, kv_heads, dim))
    script = func.script()
    assert f"llmchat::prefill_paged_attention<{heads}, {kv_heads}, {dim}, 16>" in script
    assert f'T.launch_thread("blockIdx.y", {heads})' in script
    assert 'T.launch_thread("threadIdx.y", 4)' in script
    # the cache's views are passed with their element offsets
    for view in ("q_indptr", "pages", "page_indptr", "page_values", "length_info"):
        assert f"T.address_of({view}[0" in script, view
    assert "(total_len + 63) // 64 + (batch_size + 1 - 1)" in script  # 64-row tiles, a spare per sequence
    # the arguments in the kernel's order: q, q_indptr, pages, page_indptr, page_values, last page
    # lengths, output, lse, then batch, causal, rotary_mode, sm_scale
    call = script[script.index("llmchat::prefill_paged_attention<") :]
    order = [call.index(f"T.address_of({b}[") for b in ("q", "q_indptr", "pages", "page_indptr")]
    order += [call.index(f"T.address_of({b}[") for b in ("page_values", "length_info", "output", "lse")]
    assert order == sorted(order)
    assert call.index("causal") < call.index("rotary_mode") < call.index("sm_scale")
    # left alone: the sliding-window variant (length_info of 3 rows), other PrimFuncs, heads too
    # wide for the kernel's shared-memory tiles
    assert (
        cuda_attention.prefill_paged_attention(_paged_prefill_attention(heads, kv_heads, dim, True)) is None
    )
    assert cuda_attention.prefill_paged_attention(_prefill_attention(heads, kv_heads, dim)) is None
    assert cuda_attention.prefill_attention(_paged_prefill_attention(heads, kv_heads, dim)) is None
    assert cuda_attention.prefill_paged_attention(_paged_prefill_attention(heads, kv_heads, 256)) is None


def test_the_paged_prompt_kernel_can_be_switched_off(monkeypatch):
    """``LLMCHAT_CUDA_PAGED_PREFILL=tvm`` keeps TVM's kernel for the cached pages (comparisons)
    and is part of the library's cache key."""
    from app.inference.compile import cache

    sm90 = _cuda("sm_90")
    monkeypatch.delenv("LLMCHAT_CUDA_ATTENTION", raising=False)
    monkeypatch.delenv("LLMCHAT_CUDA_PAGED_PREFILL", raising=False)
    names = [p.info.name for p in gpu.attention_passes(sm90)]
    assert names[1:] == ["llmchat_prefill_attention", "llmchat_prefill_paged_attention"]
    monkeypatch.setenv("LLMCHAT_CUDA_PAGED_PREFILL", "tvm")
    assert [p.info.name for p in gpu.attention_passes(sm90)][1:] == ["llmchat_prefill_attention"]
    assert cache._kernel_switches()["LLMCHAT_CUDA_PAGED_PREFILL"] == "tvm"  # part of the cache key
    assert gpu_choices.cuda_paged_prefill() == "tvm"
    monkeypatch.setenv("LLMCHAT_CUDA_PAGED_PREFILL", "sync")
    assert gpu_choices.cuda_paged_prefill() == "sync" and len(gpu.attention_passes(sm90)) == 3
    monkeypatch.delenv("LLMCHAT_CUDA_PAGED_PREFILL")
    assert gpu_choices.cuda_paged_prefill() == "async"  # the default: cp.async, measured the faster
    func = cuda_attention.prefill_paged_attention(_paged_prefill_attention(32, 8, 128), pipelined=True)
    assert "llmchat::prefill_paged_attention<32, 8, 128, 16, true>" in func.script()


def test_argmax_te_picks_the_first_maximum_on_cpu():
    """The exported argmax's TE (what every target compiles before CUDA swaps in its kernel)."""
    from tvm import te

    x = te.placeholder((1, 1, 1000), "float32", name="x")
    func = te.create_prim_func([x, argmax_te(x)]).with_attr("global_symbol", "main")
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    rng = np.random.default_rng(0)
    for logits in (rng.standard_normal(1000), np.r_[np.zeros(500), 3.0, np.zeros(498), 3.0]):
        out = tvm.runtime.tensor(np.zeros(1, np.int32))
        lib["main"](tvm.runtime.tensor(logits.astype(np.float32).reshape(1, 1, -1)), out)
        assert int(out.numpy()[0]) == int(np.argmax(logits))
    cuda = tvm.target.Target(CUDA_TARGET)
    sch = CudaArgmax().apply(func, cuda, False)
    assert "llmchat::argmax_f32<1000>" in sch.mod["main"].script()
    assert has_device_argmax(cuda) and not has_device_argmax(tvm.target.Target("llvm"))


def test_cuda_rules_come_first_on_cuda_only(monkeypatch):
    cuda = tvm.target.Target(CUDA_TARGET)
    monkeypatch.delenv("LLMCHAT_GPU_GEMV", raising=False)
    monkeypatch.delenv("LLMCHAT_CUDA_ATTENTION", raising=False)
    kinds = [type(r) for r in gpu.schedule_rules(cuda)]
    assert kinds[:5] == [
        CudaArgmax,
        CudaRmsNorm,
        cuda_gemm.CudaQ4Gemm,
        cuda_gemv.CudaQ4Gemv,
        gpu_gemv.DecodeGEMV,
    ]
    assert gpu_choices.use_cuda_attention(cuda)
    monkeypatch.setenv("LLMCHAT_GPU_GEMV", "llmchat")
    assert cuda_gemv.CudaQ4Gemv not in [type(r) for r in gpu.schedule_rules(cuda)]
    monkeypatch.setenv("LLMCHAT_CUDA_ATTENTION", "tvm")
    assert not gpu_choices.use_cuda_attention(cuda)
    assert gpu.attention_passes(cuda) == []


def _cuda(arch: str):
    return tvm.target.Target({**CUDA_TARGET, "arch": arch})


def test_kernels_are_chosen_by_the_gpu_architecture(monkeypatch):
    for name in ("LLMCHAT_GPU_GEMV", "LLMCHAT_CUDA_GEMM", "LLMCHAT_CUDA_ATTENTION"):
        monkeypatch.delenv(name, raising=False)
    assert [gpu_choices.cuda_arch(_cuda(a)) for a in ("sm_90", "sm_90a", "sm_75")] == [90, 90, 75]
    assert gpu_choices.cuda_arch(tvm.target.Target({"kind": "llvm"})) is None
    # Ampere and newer: every kernel; Turing: no prompt attention (mma.sync m16n8k16 needs sm_80);
    # Pascal: TVM's GEMV and GEMM (no L1::no_allocate loads, no WMMA), llmchat's decode attention
    assert len(gpu.attention_passes(_cuda("sm_80"))) == 3  # decode, prompt, prompt over cached pages
    turing = _cuda("sm_75")
    assert gpu_choices.use_cuda_kernel_gemv(turing) and gpu_choices.use_cuda_gemm(turing)
    assert len(gpu.attention_passes(turing)) == 1
    pascal = _cuda("sm_61")
    assert not gpu_choices.use_cuda_kernel_gemv(pascal) and not gpu_choices.use_cuda_gemm(pascal)
    assert len(gpu.attention_passes(pascal)) == 1
    kinds = [type(r) for r in gpu.schedule_rules(pascal)]
    assert cuda_gemv.CudaQ4Gemv not in kinds and cuda_gemm.CudaQ4Gemm not in kinds
    # thread-block clusters from Hopper on; 16-block ones only where they were run (the H200)
    sizes = [
        gpu_choices.max_cluster_size(_cuda(a))
        for a in ("sm_75", "sm_80", "sm_89", "sm_90", "sm_90a", "sm_100")
    ]
    assert sizes == [0, 0, 0, 16, 16, 8]


@pytest.mark.skipif(cuda_support.find_nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_90", "sm_75"])
def test_kernels_compile_inside_a_model_library(tmp_path, arch):
    """A Llama-shaped model (head_dim 64, hidden 256) built for sm_90: every decode GEMV, the
    decode attention and the argmax are llmchat's kernels, and nvcc accepts the module; for
    sm_75 (Turing) too, with TVM's prompt attention (llmchat's needs sm_80)."""
    from app.inference.compile.build import export_model
    from app.inference.store.config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "quantization": "q4f16_1",
            "context_window_size": 256,
            "prefill_chunk_size": 64,
            "model_config": {
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 320,
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
            },
        }
    )
    target = _cuda(arch)
    mod, _ = export_model(cfg, target)
    with cuda_support.cuda_build_hooks(target) as info, tvm.transform.PassContext(opt_level=3):
        tvm.compile(mod, target, relax_pipeline=gpu.gpu_pipeline(target))
    assert info["compiled"] == 1  # one fatbin
    source = info["sources"][0]
    calls = [
        line
        for line in source.splitlines()
        if "llmchat::q4f16_gemv<" in line and "(" in line and "template" not in line
    ]
    assert len(calls) == 5  # qkv, o (+residual), gate_up (+SiLU·mul), down (+residual), lm_head
    assert any("llmchat::q4f16_gemv<256, 1024, 4, 1, 3, false, half>(" in c for c in calls)
    assert "fused_split_silu_multiply_kernel" not in source  # the SiLU·mul runs inside the GEMV
    prompt_calls = [
        line
        for line in source.splitlines()
        if "llmchat::q4f16_gemm<" in line and "template" not in line and "(" in line
    ]
    assert len(prompt_calls) == 4  # the same layers for a prompt (lm_head sees only the last row)
    if arch == "sm_75":  # chunks merged through global memory
        assert "llmchat::decode_attention<4, 2, 64, 16, 32, 2, 4, false>(" in source
    else:  # 16 chunks of 8 warps in a cluster (4 heads), doing a decoded token's RoPE and append
        assert "llmchat::decode_attention<4, 2, 64, 16, 16, 1, 8, true, true>(" in source
    if arch == "sm_75":
        assert "llmchat::prefill_attention<" not in source  # TVM's prompt attention instead
        assert "llmchat::prefill_paged_attention<" not in source
    else:
        assert "llmchat::prefill_attention<4, 2, 64>(" in source
        assert "llmchat::prefill_paged_attention<4, 2, 64, 16, true>(" in source
        assert "(&(q_indptr_ptr[q_indptr_elem_offset]))" in source  # the view's offset reaches it
    assert "llmchat::argmax_f32<320>(" in source
    assert "llmchat::rms_norm_row<256>(" in source  # the decode RMSNorm
