"""Compiled-library cache: a second load compiles nothing; the library runs on a runtime-only TVM."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.errors import LlmchatError
from app.inference.compile import build, cache, compiler, rocm_toolchain, sources, targets
from app.inference.engine.tvm_engine import load_engine
from app.inference.hardware.device_spec import DeviceSpec
from app.inference.store.config import ModelConfig


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """A library cache of this module's own (starts empty)."""
    return tmp_path_factory.mktemp("fresh-cache")


def test_second_load_reuses_the_library(tiny_model_dir, fresh_cache, monkeypatch):
    tmp_path = fresh_cache
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model_dir("llama", "q4f32_1")
    events = []
    before = build.COMPILE_COUNT
    load_engine(model, device="cpu", progress=events.append).close()
    assert before + 1 == build.COMPILE_COUNT
    compile_events = [e for e in events if e.stage == "compile"]
    assert compile_events and compile_events[-1].fraction == 1.0
    assert compile_events[0].message.startswith("compiling for cpu:0")
    libs = list((tmp_path / "cache" / "libs").glob("*.so"))
    assert len(libs) == 1 and libs[0].with_suffix(".json").is_file()
    assert not list((tmp_path / "cache" / "libs").glob("*.tmp"))

    events.clear()
    load_engine(model, device="cpu", progress=events.append).close()
    assert before + 1 == build.COMPILE_COUNT
    assert not [e for e in events if e.stage == "compile"]
    assert [e for e in events if e.stage == "load"]


def test_cache_key_covers_what_changes_code(tiny_model_dir, monkeypatch):
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    other = ModelConfig.load(tiny_model_dir("llama", "q0f32"))
    key = cache.cache_key(cfg, "cpu", "x86_64|cpu")
    assert key == cache.cache_key(cfg, "cpu", "x86_64|cpu")
    assert key != cache.cache_key(other, "cpu", "x86_64|cpu")
    assert key != cache.cache_key(cfg, "cuda", "sm_90")
    assert cache.cache_key(cfg, "cuda", "sm_90") != cache.cache_key(cfg, "cuda", "sm_89")
    cuda_key = cache.cache_key(cfg, "cuda", "sm_90")
    monkeypatch.setenv("LLMCHAT_CUDA_GEMM", "tvm")  # a kernel switch: another library
    assert cache.cache_key(cfg, "cuda", "sm_90") != cuda_key
    monkeypatch.delenv("LLMCHAT_CUDA_GEMM")
    monkeypatch.setenv("LLMCHAT_SOMETHING_ELSE", "1")
    assert cache.cache_key(cfg, "cuda", "sm_90") == cuda_key
    monkeypatch.setattr(cache, "ENGINE_VERSION", "test-bump")
    assert key != cache.cache_key(cfg, "cpu", "x86_64|cpu")


def test_library_key_round_trips_and_names_its_differences(tiny_model_dir, monkeypatch):
    """The manifest of a prebuilt library carries the key field by field: read back, it gives the
    same digest (the cache entry's name); another TVM or CPU level is named in words."""
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    key = cache.library_key(cfg, "cpu", "x86-64-v3")
    assert key.host_cpu == "x86-64-v3" and key.target == "cpu-x86-64-v3"
    assert cache.LibraryKey.from_dict(json.loads(json.dumps(key.as_dict()))) == key
    assert key.digest() == cache.cache_key(cfg, "cpu", "x86-64-v3")
    gpu = cache.library_key(cfg, "cuda", "sm_90")
    assert gpu.host_cpu == targets.cpu_levels()[0]  # GPU libraries: host code at the baseline
    other = dataclasses.replace(key, tvm="0.26.0", device="x86-64-v4", host_cpu="x86-64-v4")
    words = other.differences(key)
    assert "TVM 0.26.0 (here " in " ".join(words) and "target x86-64-v4 (here x86-64-v3)" in words
    with pytest.raises(ValueError):
        cache.LibraryKey.from_dict({**key.as_dict(), "extra": "1"})
    with pytest.raises(ValueError):
        cache.LibraryKey.from_dict({**key.as_dict(), "tvm": 27})


def test_targets_are_dict_form_with_a_portable_cpu_level():
    import tvm

    cpu = targets.target_dict(DeviceSpec("cpu"))
    level = targets.cpu_level()
    assert level in targets.cpu_levels()
    # never the build machine's own -mcpu (rocketlake, znver2 ...): the x86-64-vN level it supports
    assert cpu["kind"] == "llvm" and cpu.get("mcpu", level) == level
    assert cpu.get("mcpu") != tvm.target.codegen.llvm_get_system_cpu()
    assert targets.target_dict(DeviceSpec("cpu"), arch=targets.cpu_levels()[0])["kind"] == "llvm"
    with pytest.raises(LlmchatError, match="not a CPU level") as err:
        targets.target_dict(DeviceSpec("cpu"), arch="rocketlake")
    assert targets.cpu_level() in err.value.fix


def test_cpu_level_switch(monkeypatch):
    """LLMCHAT_CPU_LEVEL=native: this CPU's own -mcpu under a key of its own; a lower level: that
    level; anything else: a clear error."""
    import tvm

    detected = targets.cpu_level()
    monkeypatch.setenv(targets.CPU_LEVEL_ENV, "native")
    native = targets.cpu_level()
    assert native.startswith("native-") and native != detected
    assert targets.device_fingerprint(DeviceSpec("cpu")) == native
    assert targets.target_dict(DeviceSpec("cpu"))["mcpu"] == tvm.target.codegen.llvm_get_system_cpu()
    monkeypatch.setenv(targets.CPU_LEVEL_ENV, targets.cpu_levels()[0])
    assert targets.cpu_level() == targets.cpu_levels()[0]
    monkeypatch.setenv(targets.CPU_LEVEL_ENV, "fastest")
    with pytest.raises(LlmchatError, match="not a CPU level"):
        targets.cpu_level()
    cuda = targets.make_target(DeviceSpec("cuda"), arch="sm_90")
    assert cuda.kind.name == "cuda" and cuda.attrs["arch"] == "sm_90"
    # GPU libraries' host code is for a portable CPU level: their key records only the GPU
    assert "mcpu" not in cuda.host.attrs or not cuda.host.attrs["mcpu"]
    assert targets.target_dict(DeviceSpec("rocm"), arch="gfx1100")["host"] == {"kind": "llvm"}
    assert targets.target_dict(DeviceSpec("rocm"), arch="gfx1100")["thread_warp_size"] == 32


def test_damaged_cache_entry_is_rebuilt(tiny_model_dir, fresh_cache, monkeypatch):
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(fresh_cache / "cache"))
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    lib = compiler.get_library(cfg, DeviceSpec("cpu"))
    lib.lib_path.with_suffix(".json").write_text("{broken")
    before = build.COMPILE_COUNT
    again = compiler.get_library(cfg, DeviceSpec("cpu"))
    assert before + 1 == build.COMPILE_COUNT
    assert json.loads(again.lib_path.with_suffix(".json").read_text())["params"] == lib.params


@pytest.mark.slow
def test_cached_library_runs_on_runtime_only_tvm(tiny_engine, tiny_model_dir):
    """With TVM_USE_RUNTIME_LIB=1 (no compiler), the cached library loads and generates."""
    model = tiny_model_dir("llama", "q4f32_1")
    # make sure the cache holds a library for the current sources (others may be editing them)
    sources.digest.cache_clear()
    compiler.get_library(ModelConfig.load(model), DeviceSpec("cpu"))
    code = textwrap.dedent(f"""
        import tvm
        try:
            import tvm.relax  # noqa
            compiler_present = True
        except Exception:
            compiler_present = False
        from app.inference.compile import build
        from app.inference.engine.tvm_engine import load_engine
        from app.inference.api import SamplingParams
        e = load_engine({str(model)!r}, device="cpu")
        stats = list(e.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=5), ignore_eos=True))[-1]
        print("RESULT", compiler_present, build.COMPILE_COUNT, stats.generated_tokens)
    """)
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    _, compiler_present, count, generated = line.split()
    assert compiler_present == "False", "TVM_USE_RUNTIME_LIB=1 still loaded the compiler"
    assert count == "0" and generated == "5"


@pytest.mark.parametrize(("backend", "arch"), [("rocm", "gfx1100"), ("cuda", "sm_90")])
def test_cross_compiles_for_a_gpu_that_is_not_here(tiny_model_dir, backend, arch):
    """Libraries for AMD (ROCm, code objects linked with ld.lld) and NVIDIA GPUs build on a CPU-only box."""
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f16_1"))
    if backend == "rocm":
        try:
            with rocm_toolchain.rocm_toolchain():
                pass
        except Exception as err:  # LlmchatError naming the missing part
            pytest.skip(f"no ROCm toolchain here: {err}")
    lib = compiler.get_library(cfg, DeviceSpec(backend), arch=arch)
    meta = json.loads(lib.lib_path.with_suffix(".json").read_text())
    assert lib.lib_path.stat().st_size > 10_000
    assert arch in meta["target"] and lib.compute_dtype == "float16"
    assert [p["name"] for p in lib.params] == [p["name"] for p in build.parameter_specs(cfg)]


def test_vulkan_compiles_through_tvms_wgsl_code_generator():
    """PyPI's TVM has no SPIR-V code generator: --device vulkan builds for its ``webgpu`` target
    (WGSL), sized to the adapter (tests/inference/backends runs the result on a Vulkan driver)."""
    from tests.inference.backends.vulkan_env import need_vulkan

    need_vulkan()
    target = targets.make_target(DeviceSpec("vulkan"))
    assert target.kind.name == "webgpu" and target.host.kind.name == "llvm"
    assert int(target.attrs["max_shared_memory_per_block"]) >= 16384


def test_failing_schedules_fall_back_to_tvms_stock_pipeline(tiny_model_dir, tmp_path, monkeypatch):
    """A bug in llmchat's kernel schedules costs speed, not the ability to run the model."""
    from app.inference import pipelines

    def broken(target):
        raise RuntimeError("schedule bug")

    monkeypatch.setattr(pipelines, "pipeline_for", broken)
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    events = []
    build.compile_library(cfg, targets.make_target(DeviceSpec("cpu")), tmp_path / "lib.so", events.append)
    assert (tmp_path / "lib.so").stat().st_size > 0
    assert any("schedule bug" in e.message and "stock pipeline" in e.message for e in events)


#: the modules of app/inference/compile whose code decides a library's code: the orchestrator and
#: every step it imports (a new step must be imported by compiler.py to be covered)
BUILD_MODULES = (
    "compiler.py",
    "targets.py",
    "cache.py",
    "sources.py",
    "build.py",
    "rocm_toolchain.py",
    "cuda_support.py",
    "device_ops.py",
)


def test_library_sources_are_derived_from_the_imports():
    """Everything a library's code comes from is in the key (every compile step, device_ops.py,
    cuda_support.py, the .cu); what only fetches or runs a library (prebuilt bundles, tokenizer,
    generation, the UI) is not."""
    listed = sources.library_sources()
    names = {p.name for p in listed}
    compile_dir = Path(compiler.__file__).resolve().parent
    assert {compile_dir / name for name in BUILD_MODULES} <= set(listed)
    # every module of the compile package but the prebuilt bundles' is a build step
    assert {p.name for p in compile_dir.glob("*.py")} - {"prebuilt.py"} <= names
    assert {
        "config.py",
        "cuda_kernels.cu",
        "llama.py",
        "qwen2.py",
        "gpu.py",
        "gpu_choices.py",
        "gpu_gemv.py",
        "cpu.py",
        "cpu_schedule.py",
        "ggml.py",
    } <= names
    assert not names & {
        "prebuilt.py",
        "tokenizer.py",
        "generation.py",
        "chat_template.py",
        "tvm_engine.py",
        "chat_app.py",
        "cpu_threads.py",  # sizes the thread pool at run time: no part of the code
    }


def test_editing_any_library_source_changes_the_key(tmp_path):
    """The digest reads the files themselves: in a copy of the package, an edit of each module of
    the compile steps (and of device_ops.py) gives another digest."""
    import shutil

    app_copy = tmp_path / "app"
    shutil.copytree(
        Path(compiler.__file__).resolve().parents[2],
        app_copy,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    code = (
        "import sys; sys.path.insert(0, {root!r}); from app.inference.compile import sources; "
        "assert sources.__file__.startswith({root!r}); print(sources.digest())"
    )
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code.format(root=str(tmp_path))],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.strip()
    first = run()
    assert len(first) == 64 and first == run()
    seen = {first}
    for name in BUILD_MODULES:
        with open(app_copy / "inference" / "compile" / name, "a") as f:
            f.write("\n# an edit\n")
        digest = run()
        assert digest not in seen, f"an edit of {name} left the library key as it was"
        seen.add(digest)


def _truncate(path, fraction=0.5):
    os.truncate(path, int(path.stat().st_size * fraction))


def test_truncated_library_is_rebuilt_not_loaded(tiny_model_dir, fresh_cache, monkeypatch):
    """`truncate -s 50%` on a cached library: verified before loading, rebuilt; a fresh process then
    generates with it (before: SIGBUS, and the broken entry reused forever)."""
    cache_dir = fresh_cache / "cache"
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(cache_dir))
    model = tiny_model_dir("llama", "q4f32_1")
    cfg = ModelConfig.load(model)
    lib = compiler.get_library(cfg, DeviceSpec("cpu"))
    meta = json.loads(lib.lib_path.with_suffix(".json").read_text())
    assert meta["size"] == lib.lib_path.stat().st_size and len(meta["sha256"]) == 64
    _truncate(lib.lib_path)
    code = textwrap.dedent(f"""
        from app.inference.compile import build
        from app.inference.engine.tvm_engine import load_engine
        from app.inference.api import SamplingParams
        e = load_engine({str(model)!r}, device="cpu")
        stats = list(e.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3), ignore_eos=True))[-1]
        print("RESULT", build.COMPILE_COUNT, stats.generated_tokens)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, LLMCHAT_CACHE_DIR=str(cache_dir)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["1", "3"]
    again = json.loads(lib.lib_path.with_suffix(".json").read_text())
    assert again["sha256"] == cache.file_digest(lib.lib_path)


def test_same_size_corruption_is_rebuilt(tiny_model_dir, fresh_cache, monkeypatch):
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(fresh_cache / "cache"))
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    lib = compiler.get_library(cfg, DeviceSpec("cpu"))
    with open(lib.lib_path, "r+b") as f:
        f.seek(lib.lib_path.stat().st_size // 2)
        f.write(b"\xde\xad\xbe\xef" * 8)
    before = build.COMPILE_COUNT
    events = []
    compiler.get_library(cfg, DeviceSpec("cpu"), progress=events.append)
    assert before + 1 == build.COMPILE_COUNT
    assert any("damaged" in e.message for e in events)
    before = build.COMPILE_COUNT
    compiler.get_library(cfg, DeviceSpec("cpu"))
    assert before == build.COMPILE_COUNT  # the rebuilt entry verifies


def test_unwritable_cache_is_a_cache_error_not_a_schedule_failure(tiny_model_dir, tmp_path, monkeypatch):
    """A cache that cannot be written (here `libs` is a file; also root cannot write there): one
    compile, a message about the cache (no `--device cpu`, no retry with the stock pipeline)."""
    from app.errors import LlmchatError

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / "libs").write_text("not a directory")
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(cache_dir))
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    events = []
    before = build.COMPILE_COUNT
    with pytest.raises(LlmchatError, match="Cannot write the compiled model library") as err:
        compiler.get_library(cfg, DeviceSpec("cpu"), progress=events.append)
    assert "LLMCHAT_CACHE_DIR" in err.value.fix and "--device cpu" not in str(err.value)
    assert not any("stock pipeline" in e.message for e in events)
    assert before == build.COMPILE_COUNT
    assert not any("generating kernels" in e.message for e in events)  # failed before compiling


def test_stock_fallback_is_never_cached_under_the_normal_key(tiny_model_dir, fresh_cache, monkeypatch):
    from app.inference import pipelines

    def broken(target):
        raise RuntimeError("schedule bug")

    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(fresh_cache / "fallback-cache"))
    monkeypatch.setattr(pipelines, "pipeline_for", broken)
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f32_1"))
    lib = compiler.get_library(cfg, DeviceSpec("cpu"))
    normal = cache.cache_key(
        dataclasses.replace(cfg, compute_dtype=lib.compute_dtype),
        "cpu",
        targets.device_fingerprint(DeviceSpec("cpu")),
    )
    assert normal not in lib.lib_path.name
    assert json.loads(lib.lib_path.with_suffix(".json").read_text())["pipeline"] == "tvm-default"
    assert not list(lib.lib_path.parent.glob(f"*{normal}*"))
    # the next start does not pay for the failing schedules again: the stock library, no compile
    before, events = build.COMPILE_COUNT, []
    again = compiler.get_library(cfg, DeviceSpec("cpu"), progress=events.append)
    assert again.lib_path == lib.lib_path and before == build.COMPILE_COUNT
    assert any("schedules failed for this model before" in e.message for e in events)
    assert not list(lib.lib_path.parent.glob(f"*{normal}*"))


def test_every_kernel_switch_the_pipelines_read_is_part_of_the_cache_key():
    """An ``LLMCHAT_*`` variable named in the pipelines' code changes the kernels it builds: a
    library built under one value must not be taken from the cache under another."""
    import ast

    from app.inference.compile import cache

    root = Path(__file__).resolve().parents[2] / "app" / "inference" / "pipelines"
    named = set()
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and value.startswith("LLMCHAT_") and value.replace("_", "").isalnum():
                named.add(value)
    assert "LLMCHAT_TENSOR_CORE_MATMUL" in named and "LLMCHAT_WGSL_GEMV" in named  # the scan sees them
    assert named <= set(cache.KERNEL_SWITCHES), sorted(named - set(cache.KERNEL_SWITCHES))
