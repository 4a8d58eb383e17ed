"""The GPU pipeline and the CUDA build/run support, checked without a GPU.

The tiny model is compiled for CUDA sm_90 (and ROCm gfx1100 where ld.lld and ROCm's device
libraries are installed) with ``gpu_pipeline``; the generated code is inspected and, where nvcc
exists, compiled. Running the kernels needs a GPU: benchmarks/run_h200.sh does that.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import tvm

from app.errors import LlmchatError
from app.inference.compile import cuda_support
from app.inference.pipelines import gpu, gpu_choices, gpu_gemv

CUDA_TARGET = {
    "kind": "cuda",
    "arch": "sm_90",
    "max_shared_memory_per_block": 49152,
    "max_threads_per_block": 1024,
    "thread_warp_size": 32,
    "host": {"kind": "llvm"},
}


def _tiny_module(target):
    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config

    cfg = preset_config("tiny-llama", "q4f16_1")
    mod, _ = export_model(cfg, target)
    return mod


def _scheduled_functions(mod, target):
    """Run the pipeline up to the schedules (``gpu.schedule_rules``); return {name: PrimFunc}."""
    from tvm import relax
    from tvm.s_tir import dlight as dl

    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                gpu.fast_decode_pass(),
                dl.ApplyDefaultSchedule(*gpu.schedule_rules(target)),
            ]
        )(mod)
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


@pytest.fixture(scope="session")
def cuda_build(tmp_path_factory):
    """The tiny model compiled for sm_90 with the llmchat GPU pipeline (once per session)."""
    target = tvm.target.Target(CUDA_TARGET)
    mod = _tiny_module(target)
    with cuda_support.cuda_build_hooks(target) as info, tvm.transform.PassContext(opt_level=3):
        ex = tvm.compile(mod, target, relax_pipeline=gpu.gpu_pipeline(target))
    path = tmp_path_factory.mktemp("cuda") / "tiny_sm90.so"
    ex.export_library(str(path))
    return ex, info, path


def test_choose_gemv_config_tiles_rows_exactly():
    # Llama-2-7B shapes: 4096 inputs = 512 words; 11008 inputs = 1376 words (= 43 * 32)
    cfg = gpu_gemv.choose_gemv_config(out_features=22016, words_per_row=512, words_per_thread=4)
    assert cfg.threads_per_row == 32 and 512 % (cfg.threads_per_row * 4) == 0
    assert 22016 % cfg.rows_per_block == 0 and 22016 // cfg.rows_per_block >= 512
    down = gpu_gemv.choose_gemv_config(out_features=4096, words_per_row=1376, words_per_thread=4)
    assert 1376 % (down.threads_per_row * 4) == 0 and down.threads_per_row == 8
    assert down.rows_per_block * down.threads_per_row <= 256
    assert gpu_gemv.choose_gemv_config(out_features=7, words_per_row=3, words_per_thread=4) is None


def test_fast_uint_to_float_rewrite_is_exact():
    """float32(u & 15) - 7 rewritten to bit tricks computes the same values (run on the CPU)."""
    from tvm.script import tirx as T

    @T.prim_func(s_tir=True)
    def decode(w: T.Buffer((64,), "uint32"), out: T.Buffer((512,), "float32")):
        for i in range(512):
            with T.sblock("d"):
                v = T.axis.spatial(512, i)
                out[v] = T.Cast(
                    "float32", (w[v // 8] >> T.Cast("uint32", v % 8) * T.uint32(4)) & T.uint32(15)
                ) - T.float32(7.0)

    rewritten = gpu_gemv.fast_small_uint_to_float(decode)
    assert "reinterpret" in rewritten.script() and "reinterpret" not in decode.script()
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=64, dtype=np.uint32)
    results = []
    for func in (decode, rewritten):
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
        out = tvm.runtime.tensor(np.zeros(512, np.float32))
        lib["main"](tvm.runtime.tensor(words), out)
        results.append(out.numpy())
    expected = ((words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).reshape(-1) - 7.0
    np.testing.assert_array_equal(results[0], expected)
    np.testing.assert_array_equal(results[1], expected)


def _q4_gemv(in_f: int, out_f: int):
    """A batch-1 q4f16_1 GEMV as the engine writes it (dequantization inside the reduction)."""
    from tvm import te

    from app.inference.quantization import get_format

    fmt = get_format("q4f16_1")
    x = te.placeholder((1, 1, in_f), "float16", name="x")
    qw = te.placeholder((out_f, in_f // 8), "uint32", name="q_weight")
    qs = te.placeholder((out_f, in_f // 32), "float16", name="q_scale")
    k = te.reduce_axis((0, in_f), name="k")
    acc = te.compute(
        (1, 1, out_f),
        lambda b, s, n: te.sum(
            x[b, s, k].astype("float32") * fmt.dequant({"q_weight": qw, "q_scale": qs}, n, k), axis=k
        ),
        name="dequant_matmul",
    )
    out = te.compute((1, 1, out_f), lambda b, s, n: acc[b, s, n].astype("float16"), name="out")
    return te.create_prim_func([x, qw, qs, out])


def test_decode_gemv_rule_schedule():
    target = tvm.target.Target(CUDA_TARGET)
    with target:
        sch = gpu_gemv.DecodeGEMV().apply(_q4_gemv(1024, 4096), target, False)
    assert sch is not None
    script = sch.mod.script()
    assert 'thread="threadIdx.x"' in script and 'thread="blockIdx.x"' in script
    assert "reinterpret" in script  # 4-bit decode without I2F
    assert 'scope="shared"' in script and "T.vectorized(4)" in script  # staged vector, 16-byte loads
    with target:  # rows too short to tile with 16-byte chunks: left to the next rule
        assert gpu_gemv.DecodeGEMV().apply(_q4_gemv(64, 256), target, False) is None
        # Qwen2.5-0.5B's down projection: one row per block would stage the vector per row
        assert gpu_gemv.DecodeGEMV().apply(_q4_gemv(4864, 896), target, False) is None


def test_decode_gemv_rule_cuda_source_compiles():
    target = tvm.target.Target(CUDA_TARGET)
    with target:
        sch = gpu_gemv.DecodeGEMV().apply(_q4_gemv(1024, 4096), target, False)
    mod = tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "gemv")})
    with cuda_support.cuda_build_hooks(target) as info:
        tvm.tirx.build(mod, target=target)
    source = info["sources"][0]
    assert "uint4" in source and "__shfl_down_sync" in source
    assert "float4" in source  # fp32 vector chunk read from shared memory 16 bytes at a time


def test_cuda_build_decodes_without_i2f_and_uses_cuda_graphs(cuda_build):
    ex, info, _path = cuda_build
    source = info["sources"][0]
    assert str(0x4B000000) in source  # 4-bit values decoded through the float bit pattern
    assert "__shfl_down_sync" in source  # warp-shuffle reductions in the GEMVs
    assert "vm.builtin.cuda_graph.run_or_capture" in ex.as_text()  # static regions are captured


def test_llmchat_gemv_rules_on_cuda_only_unless_overridden(monkeypatch):
    cuda = tvm.target.Target(CUDA_TARGET)
    rocm = tvm.target.Target(
        {
            "kind": "rocm",
            "mcpu": "gfx1100",
            "mtriple": "amdgcn-amd-amdhsa-hcc",
            "thread_warp_size": 32,
            "host": {"kind": "llvm"},
        }
    )
    monkeypatch.delenv("LLMCHAT_GPU_GEMV", raising=False)
    assert any(isinstance(r, gpu_gemv.DecodeGEMV) for r in gpu.schedule_rules(cuda))  # after CUDA's own
    assert not any(isinstance(r, gpu_gemv.DecodeGEMV) for r in gpu.schedule_rules(rocm))
    monkeypatch.setenv("LLMCHAT_GPU_GEMV", "tvm")
    assert not any(isinstance(r, gpu_gemv.DecodeGEMV) for r in gpu.schedule_rules(cuda))
    monkeypatch.setenv("LLMCHAT_GPU_GEMV", "llmchat")
    assert isinstance(gpu.schedule_rules(rocm)[0], gpu_gemv.DecodeGEMV)


@pytest.mark.skipif(cuda_support.find_nvcc() is None, reason="nvcc not installed")
def test_kernels_are_prebuilt_fatbins(cuda_build):
    _ex, info, path = cuda_build
    assert info["compiled"] == 1
    data = path.read_bytes()
    assert cuda_support.FATBIN_MARKER.encode() in data  # the .so carries binary kernels
    start = data.index(cuda_support.FATBIN_MARKER.encode())
    end = data.index(b"\n", data.index(b"\n", start) + 1)
    fatbin = cuda_support.decode_fatbin(data[start : end + 1].decode())
    assert fatbin[:4] == bytes.fromhex("50ed55ba")  # fatbin magic 0xBA55ED50 (little endian)


def test_runtime_callback_decodes_payload_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cuda_support, "find_nvcc", lambda: None)
    payload = cuda_support.encode_fatbin(b"\x50\xed\x55\xbaBINARY", "__global__ void k() {}")
    assert cuda_support._runtime_compile(payload) == b"\x50\xed\x55\xbaBINARY"
    with pytest.raises(RuntimeError, match="no CUDA compiler"):
        cuda_support._runtime_compile('extern "C" __global__ void k() {}')
    assert isinstance(cuda_support._runtime_state["error"], LlmchatError)


def test_build_hooks_keep_source_without_nvcc(monkeypatch):
    target = tvm.target.Target(CUDA_TARGET)
    monkeypatch.setattr(cuda_support, "find_nvcc", lambda: None)
    with cuda_support.cuda_build_hooks(target) as info:
        assert info["nvcc"] is None
    with pytest.raises(LlmchatError, match="nvcc"), cuda_support.cuda_build_hooks(target, require=True):
        pass


def _find_lld() -> str | None:
    for name in ("ld.lld", "ld.lld-22", "ld.lld-21", "ld.lld-20", "ld.lld-19"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _find_bitcode() -> str | None:
    roots = [os.environ.get("ROCM_PATH", ""), "/opt/rocm", "/usr/lib/x86_64-linux-gnu", "/usr/lib"]
    for root in filter(None, roots):
        path = os.path.join(root, "amdgcn", "bitcode")
        if os.path.exists(os.path.join(path, "ockl.bc")):
            return path
    return None


@pytest.mark.skipif(
    _find_lld() is None or _find_bitcode() is None,
    reason="ld.lld (Debian: lld-19) or ROCm device bitcode (rocm-device-libs) missing",
)
def test_rocm_rdna_build(tmp_path, monkeypatch):
    # TVM looks for `ld.lld` on PATH and for $ROCM_PATH/amdgcn/bitcode: point both at what exists
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ld.lld").symlink_to(_find_lld())
    (tmp_path / "rocm" / "amdgcn").mkdir(parents=True)
    (tmp_path / "rocm" / "amdgcn" / "bitcode").symlink_to(_find_bitcode())
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "rocm"))
    target = tvm.target.Target(
        {
            "kind": "rocm",
            "mcpu": "gfx1100",
            "mtriple": "amdgcn-amd-amdhsa-hcc",
            "max_shared_memory_per_block": 65536,
            "max_threads_per_block": 1024,
            "thread_warp_size": 32,
            "host": {"kind": "llvm"},
        }
    )
    mod = _tiny_module(target)
    funcs = _scheduled_functions(mod, target)
    assert any("dequant" in n and f.attrs and f.attrs.get("tirx.is_scheduled") for n, f in funcs.items())
    with tvm.transform.PassContext(opt_level=3):
        ex = tvm.compile(mod, target, relax_pipeline=gpu.gpu_pipeline(target))
    path = tmp_path / "tiny_gfx1100.so"
    ex.export_library(str(path))
    assert b"amdgcn-amd-amdhsa" in path.read_bytes()  # the code object for the GPU is inside
    assert not gpu_choices.uses_cuda_graph(target)
