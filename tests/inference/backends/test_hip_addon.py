"""llmchat's ROCm runtime for TVM (its HIP add-on) on a machine without an AMD GPU: it builds
with the system compiler and loads; it parses real ROCm libraries that TVM compiled here for
gfx1100 and gfx1030 (function table, kernel names, wave32, no unresolved symbols); and every
missing piece (no HIP library, HIP without a GPU) is a clear message with a fix, never a crash.

Running it is tested on NVIDIA GPUs through its CUDA twin: tests/gpu/test_cuda_twin.py."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
NO_HIP = "/nonexistent/libamdhip64.so.6"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLMCHAT_GPU_RUNTIME", "LLMCHAT_HIP_LIBRARY")}
    env.update(extra)
    return env


def _child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Python code in a fresh process (a crash in native code shows as a signal, and the add-on
    is loaded in the mode and with the HIP library given here)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=_env(**env),
    )


def _need_rocm_toolchain() -> None:
    from app.inference.compile import rocm_toolchain

    try:
        with rocm_toolchain.rocm_toolchain():
            pass
    except Exception as err:  # LlmchatError naming the missing part
        pytest.skip(f"no ROCm toolchain here: {err} (Debian: apt install lld-19 rocm-device-libs)")


def _scale_library(tmp_path: Path, arch: str) -> Path:
    """TVM compiles B[i] = A[i] * s + 1 for a gfx target and exports it (the wheel's code
    generator, ld.lld, AMD's device bitcode)."""
    import tvm
    from tvm import s_tir, te

    from app.inference.compile.rocm_toolchain import rocm_toolchain

    n = te.var("n")
    s = te.var("s", dtype="float32")
    a = te.placeholder((n,), name="A", dtype="float32")
    b = te.compute((n,), lambda i: a[i] * s + 1.0, name="B")
    mod = tvm.IRModule({"scale": te.create_prim_func([a, b, s]).with_attr("global_symbol", "scale")})
    sch = s_tir.Schedule(mod)
    sch.work_on("scale")
    (i,) = sch.get_loops(sch.get_sblock("B"))
    bx, tx = sch.split(i, [None, 64])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    wave = 32 if arch.startswith(("gfx10", "gfx11", "gfx12")) else 64
    target = tvm.target.Target(
        {"kind": "rocm", "mcpu": arch, "mtriple": "amdgcn-amd-amdhsa-hcc", "thread_warp_size": wave},
        host="llvm",
    )
    with rocm_toolchain():
        lib = tvm.compile(sch.mod, target=target)
    path = tmp_path / f"scale-{arch}.so"
    lib.export_library(str(path))
    return path


@pytest.fixture(scope="module")
def addon():
    """The add-on built by the system compiler and loaded (ROCm mode) into this process."""
    from app.inference.backends.hip import addon

    if os.environ.get("LLMCHAT_GPU_RUNTIME"):
        pytest.fail("LLMCHAT_GPU_RUNTIME is set; these tests are for the ROCm mode")
    path = addon.build()
    assert path.is_file() and path.stat().st_size > 10_000
    assert addon.load() == path
    return addon


def test_the_addon_builds_and_registers_the_rocm_runtime(addon):
    import tvm

    for name in ("device_api.rocm", "ffi.Module.load_from_bytes.hip", "llmchat.gpu.status"):
        assert tvm.get_global_func(name, allow_missing=True) is not None, name
    # the CUDA twin's names stay TVM's own in ROCm mode
    st = addon.status()
    assert st["runtime"] == "hip" and st["device_type"] == 10
    # no ROCm headers or libraries at build time: HIP is opened at run time, not linked
    needed = subprocess.run(
        ["readelf", "-d", str(addon.library_path())], capture_output=True, text=True
    ).stdout
    assert "libtvm_runtime" in needed and "amdhip" not in needed


def test_the_addon_is_rebuilt_when_its_cache_entry_is_damaged(addon, tmp_path, monkeypatch):
    """A truncated cached build is replaced, not loaded (the shared builder's contract)."""
    from app.inference.backends.native_build import AddOn

    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "tiny.cc"
    src.write_text(
        textwrap.dedent("""
        #include <tvm/ffi/reflection/registry.h>
        TVM_FFI_STATIC_INIT_BLOCK() {
          tvm::ffi::reflection::GlobalDef().def("llmchat.test_wt16.tiny", []() -> int64_t { return 7; });
        }
    """)
    )
    import threading

    import tvm

    tiny = AddOn(
        source=src, lib_name="libllmchat_test_tiny", what="test", registered="llmchat.test_wt16.tiny"
    )
    built = tiny.build()
    built.write_bytes(b"\x7fELF broken")
    assert tiny.load(threading.Lock()) == built
    assert tvm.get_global_func("llmchat.test_wt16.tiny")() == 7


@pytest.mark.parametrize("arch", ["gfx1100", "gfx1030"])
def test_the_loader_reads_a_real_rocm_library(addon, tmp_path, arch):
    """TVM's exported ROCm module ("hip", format "hsaco") parsed by llmchat's loader: the function
    table, the kernel in the code object, its wave size from the kernel descriptor."""
    _need_rocm_toolchain()
    import tvm

    lib = tvm.runtime.load_module(str(_scale_library(tmp_path, arch)))
    (gpu,) = lib.imports
    assert gpu.kind == "hip"
    info = addon.describe(gpu)
    assert info["format"] == "hsaco" and info["elf"] and info["target"] == arch
    assert info["undefined_symbols"] == 0
    (fn,) = info["functions"]
    assert fn["name"] == "scale_kernel" and fn["in_code_object"]
    assert fn["args"] == ["handle", "handle", "int32", "float32"]
    assert fn["arg_bytes"] == 24  # two pointers, two 4-byte scalars: TVM's packing
    assert fn["launch_tags"] == ["blockIdx.x", "threadIdx.x"]
    assert fn["wave_size"] == 32  # RDNA: wave32


def test_wave64_is_told_apart(addon, tmp_path):
    """A CDNA/GCN target (gfx90a) builds wave64 kernels: the wave size is read, not assumed."""
    _need_rocm_toolchain()
    import tvm

    lib = tvm.runtime.load_module(str(_scale_library(tmp_path, "gfx90a")))
    info = addon.describe(lib.imports[0])
    assert info["target"] == "gfx90a" and info["functions"][0]["wave_size"] == 64


def test_a_tiny_model_library_for_rdna_is_complete(addon, tiny_model_dir, monkeypatch, tmp_path):
    """The tiny Llama (q4f16_1) built by llmchat for gfx1100: every kernel the host code calls is
    in the code object, wave32, with no unresolved symbols."""
    _need_rocm_toolchain()
    import tvm

    from app.inference.compile import compiler
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.store.config import ModelConfig

    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f16_1"))
    lib = compiler.get_library(cfg, DeviceSpec("rocm"), arch="gfx1100")
    mod = tvm.runtime.load_module(str(lib.lib_path))
    hip_modules = [m for m in _all_modules(mod) if m.kind == "hip"]  # VM executable > library > hip
    assert len(hip_modules) == 1
    info = addon.describe(hip_modules[0])
    assert info["target"] == "gfx1100" and info["undefined_symbols"] == 0
    names = [f["name"] for f in info["functions"]]
    assert len(names) >= 10, names
    missing = [f["name"] for f in info["functions"] if not f["in_code_object"]]
    assert not missing
    assert {f["wave_size"] for f in info["functions"]} == {32}


#: Llama-2-7B's shapes (4096 hidden, 11008 MLP, 32 heads, 32,000 words) with one layer: every layer
#: runs the same kernels, so one compiles every kernel of the 7B library in a fraction of the time
SEVEN_B_ONE_LAYER = {"num_hidden_layers": 1}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx1100", "gfx1030"])
def test_the_7b_shape_compiles_for_rdna(addon, monkeypatch, tmp_path, arch):
    """The Llama-2-7B shape in q4f16_1, compiled by llmchat for an RDNA GPU (gfx1100: RX 7900 XTX,
    gfx1030: RX 6800/6900 XT): the code object is for that gfx target, every kernel the host code
    calls is in it (the 7B matmuls among them), wave32, no unresolved symbols."""
    _need_rocm_toolchain()
    import dataclasses

    import tvm

    from app.inference.compile import compiler
    from app.inference.engine.random_model import preset_config
    from app.inference.hardware.device_spec import DeviceSpec

    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = dataclasses.replace(
        preset_config("llama2-7b", "q4f16_1", context_window=512, prefill_chunk=512), **SEVEN_B_ONE_LAYER
    )
    lib = compiler.get_library(cfg, DeviceSpec("rocm"), arch=arch)
    meta = json.loads(lib.lib_path.with_suffix(".json").read_text())
    assert meta["pipeline"] == "llmchat" and arch in meta["target"]  # llmchat's schedules, no fall-back
    shapes = {p["name"]: p["shape"] for p in lib.params}
    assert shapes["model.embed_tokens.q_weight"] == [32000, 512]  # 4096 / 8 nibbles per word
    assert shapes["model.layers.0.mlp.down_proj.q_weight"] == [4096, 1376]  # 11008 / 8
    mod = tvm.runtime.load_module(str(lib.lib_path))
    (hip,) = [m for m in _all_modules(mod) if m.kind == "hip"]
    info = addon.describe(hip)
    assert info["format"] == "hsaco" and info["target"] == arch and info["undefined_symbols"] == 0
    functions = info["functions"]
    missing = [f["name"] for f in functions if not f["in_code_object"]]
    assert not missing, missing
    assert {f["wave_size"] for f in functions} == {32}
    names = " ".join(f["name"] for f in functions)
    for kernel in (
        "dequant_matmul",
        "rms_norm",
        "rope",
        "silu",
        "batch_decode_paged_kv",
        "batch_prefill_ragged_kv",
    ):
        assert kernel in names, f"no {kernel} kernel in {sorted(f['name'] for f in functions)}"


def _all_modules(mod):
    yield mod
    for m in mod.imports:
        yield from _all_modules(m)


def test_running_without_hip_is_a_clear_error_not_a_crash(tmp_path):
    """A library loads without HIP (parsing only); a launch, an allocation, `exist` then say
    what is missing."""
    _need_rocm_toolchain()
    path = _scale_library(tmp_path, "gfx1100")
    out = _child(
        f"""
        from app.inference.backends.hip import addon
        addon.load()
        import tvm
        lib = tvm.runtime.load_module({str(path)!r})
        print("EXIST", tvm.device("rocm", 0).exist)
        for what, call in [("launch", lambda: lib.imports[0]["scale_kernel"](None, None, 4, 2.0, 1, 64)),
                           ("alloc", lambda: tvm.runtime.empty((4,), "float32", tvm.device("rocm", 0)))]:
            try:
                call()
            except Exception as err:
                print("ERR", what, type(err).__name__, err)
    """,
        LLMCHAT_HIP_LIBRARY=NO_HIP,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EXIST False" in out.stdout
    for what in ("launch", "alloc"):
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"ERR {what}"))
        assert "RuntimeError ROCm: the HIP runtime was not found" in line and NO_HIP in line


def test_device_rocm_without_hip_fails_fast_with_the_fix():
    """`llmchat ask --device rocm` where there is no HIP library: exit 1 with the message and the
    fix, before any model is touched."""
    out = subprocess.run(
        [sys.executable, "-m", "app", "ask", "--device", "rocm:0", "hello"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=_env(LLMCHAT_HIP_LIBRARY=NO_HIP),
    )
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "Cannot use --device rocm:0: the HIP runtime was not found" in out.stderr
    assert "rocm-hip-runtime" in out.stderr and "--device cpu" in out.stderr
    assert "Traceback" not in out.stderr


def _system_hip() -> str | None:
    for name in ("libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"):
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return name
    return None


def test_hip_without_a_gpu_says_so():
    """A real HIP runtime (Debian's libamdhip64-5 in CI) on a machine without an AMD GPU: HIP is
    found, no device is, and the fix names /dev/kfd and HSA_OVERRIDE_GFX_VERSION's risk."""
    lib = _system_hip()
    if lib is None:
        pytest.skip("no HIP runtime installed (Debian: apt install libamdhip64-5)")
    out = _child("""
        import json
        from app.inference.backends import hip
        st = hip.status()
        why = hip.problem(0)
        print(json.dumps({"st": st, "why": why, "fix": hip.fix_for(why)}))
        import tvm
        print("EXIST", tvm.device("rocm", 0).exist)
        try:
            tvm.runtime.empty((4,), "float32", tvm.device("rocm", 0))
        except Exception as err:
            print("ERR", err)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.splitlines()[0])
    assert got["st"]["driver_found"] and got["st"]["library"] == lib and got["st"]["devices"] == []
    assert got["why"].startswith("HIP found no GPU it can use")
    assert "HSA_OVERRIDE_GFX_VERSION" in got["fix"] and "wrong results" in got["fix"]
    assert "EXIST False" in out.stdout
    assert "ERR ROCm: no GPU was found" in out.stdout


def test_the_twin_mode_registers_cuda_names_instead(tmp_path):
    """LLMCHAT_GPU_RUNTIME=twin: the same add-on serves TVM's CUDA device, module kind and CUDA-graph
    builtins (over libcuda.so.1); where there is no NVIDIA driver it says so."""
    out = _child(
        """
        import json
        from app.inference.backends.hip import addon
        addon.load()
        import tvm
        print(json.dumps({"st": addon.status(),
                          "cuda": tvm.get_global_func("device_api.cuda", allow_missing=True) is not None,
                          "rocm": tvm.get_global_func("device_api.rocm", allow_missing=True) is not None,
                          "loader": tvm.get_global_func("ffi.Module.load_from_bytes.cuda",
                                                        allow_missing=True) is not None,
                          "graphs": tvm.get_global_func("vm.builtin.cuda_graph.run_or_capture",
                                                        allow_missing=True) is not None}))
    """,
        LLMCHAT_GPU_RUNTIME="twin",
        LLMCHAT_CUDA_DRIVER_LIBRARY="/nonexistent/libcuda.so.1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.splitlines()[-1])
    assert got["cuda"] and got["loader"] and not got["rocm"]
    assert got["graphs"]  # llmchat's CUDA libraries run their decode step as a captured graph
    assert got["st"]["runtime"] == "cuda-twin" and got["st"]["device_type"] == 2
    assert not got["st"]["driver_found"] and "NVIDIA driver library was not found" in got["st"]["error"]


def test_the_probe_counts_the_rocm_route_and_doctor_explains_it(addon):
    """The probe lists rocm among TVM's runtimes once the add-on is built (the ``addon``
    fixture: alone, this test used to find it unbuilt); with no GPU the device does not exist, and
    `doctor` says what is missing and how to fix it."""
    out = _child(
        """
        import json
        import tvm  # the live check asks the TVM in this process
        from app.inference.hardware.runtimes import tvm_runtimes_live
        r = tvm_runtimes_live()
        print(json.dumps({"available": sorted(r.available), "exists": r.devices_exist, "details": r.details}))
    """,
        LLMCHAT_HIP_LIBRARY=NO_HIP,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.splitlines()[-1])
    assert "rocm" in got["available"] and got["exists"].get("rocm") is False
    assert any("HIP runtime was not found" in d for d in got["details"])
    doc = subprocess.run(
        [sys.executable, "-m", "app", "doctor"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=_env(LLMCHAT_HIP_LIBRARY=NO_HIP),
    )
    assert doc.returncode == 0, doc.stderr[-2000:]
    assert "ROCm devices (llmchat's HIP runtime" in doc.stdout
    assert "rocm cannot run here: the HIP runtime was not found" in doc.stdout


def test_kernel_arguments_are_checked_before_any_launch(addon, tmp_path):
    """A wrong argument count is a clear error naming the kernel (before HIP is needed)."""
    _need_rocm_toolchain()
    import tvm

    lib = tvm.runtime.load_module(str(_scale_library(tmp_path, "gfx1100")))
    with pytest.raises(Exception, match="kernel scale_kernel got 2 arguments, expected 6"):
        lib.imports[0]["scale_kernel"](np.int64(1), np.int64(2))
