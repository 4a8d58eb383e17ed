"""The GPU suite's prebuilt cache (tests/gpu/prebuilt.py) without a GPU (part of ``make test``):
what is missing, damaged, stale or built for another GPU fails with the command that rebuilds it;
the engine compiles nothing when running from the cache; and the suite's collection and every step
before the GPU (tiny models from the cache's parameter lists, the kernel cases' inputs and numpy
references) work with a runtime-only TVM, as on the GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu import prebuilt

ROOT = Path(__file__).resolve().parents[2]


def _cache(root: Path, **changes) -> Path:
    """A small cache as ``make gpu-cache`` lays it out (bytes in place of libraries)."""
    (root / "kernels").mkdir(parents=True)
    (root / prebuilt.ENGINE_CACHE / "libs").mkdir(parents=True)
    lib = root / "kernels" / "small_ops.so"
    lib.write_bytes(b"\x7fELF kernels")
    manifest = {
        "format": prebuilt.FORMAT,
        "sources": prebuilt.sources_digest(),
        "commit": "abc1234",
        "facts": {"arch": "sm_90", "matmul_kernels": True, "max_cluster": 16, "prompt_attention": True},
        "kernels": {"small_ops": prebuilt._entry(root, lib, cases=["argmax_7", "rms_norm_8"])},
        "files": {},
        "models": {},
    }
    manifest.update(changes)
    (root / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    return root


def test_a_complete_current_cache_is_read(tmp_path):
    cache = prebuilt.Prebuilt(_cache(tmp_path / "c"))
    cache.check("sm_90")
    library = cache.kernel_library("small_ops", ["argmax_7", "rms_norm_8"])
    assert library == tmp_path / "c" / "kernels" / "small_ops.so"
    assert cache.engine_cache() == tmp_path / "c" / prebuilt.ENGINE_CACHE
    assert cache.facts["max_cluster"] == 16


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no manifest", "no readable GPU test cache"),
        ("other GPU", "built for sm_90, this GPU is sm_80"),
        ("other sources", "built from other sources"),
        ("group missing", "kernels 'matmul' is not in the GPU test cache"),
        ("other cases", "other cases than the suite's"),
        ("damaged library", "missing or damaged"),
        ("no engine libraries", "no engine libraries"),
    ],
)
def test_what_is_missing_or_stale_fails_with_the_rebuild_command(tmp_path, breakage, message):
    root = _cache(tmp_path / "c", **({"sources": "0" * 24} if breakage == "other sources" else {}))
    arch, group, cases = "sm_90", "small_ops", ["argmax_7", "rms_norm_8"]
    if breakage == "no manifest":
        (root / prebuilt.MANIFEST).unlink()
    elif breakage == "other GPU":
        arch = "sm_80"
    elif breakage == "group missing":
        group = "matmul"
    elif breakage == "other cases":
        cases = ["argmax_7"]
    elif breakage == "damaged library":
        (root / "kernels" / "small_ops.so").write_bytes(b"\x7fELF kernelz")
    elif breakage == "no engine libraries":
        (root / prebuilt.ENGINE_CACHE / "libs").rmdir()
    with pytest.raises(prebuilt.CacheError, match=message) as info:
        cache = prebuilt.Prebuilt(root)
        cache.check(arch)
        cache.kernel_library(group, cases)
        cache.engine_cache()
    assert "make gpu-cache GPU_ARCH=" in str(info.value)


def test_running_from_the_cache_the_engine_compiles_nothing(tmp_path, monkeypatch, tiny_model_dir):
    """A model whose library is not in the cache: an error naming the cache, not a compile."""
    from app.errors import LlmchatError
    from app.inference.compile import build, compiler, targets
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.store.config import ModelConfig

    root = _cache(tmp_path / "c")
    monkeypatch.setattr(build, "compile_library", build.compile_library)  # restored after
    monkeypatch.setattr(targets, "make_target", targets.make_target)
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(root / prebuilt.ENGINE_CACHE))
    prebuilt.forbid_compiling(root)
    before = build.COMPILE_COUNT
    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f16_1"))
    with pytest.raises(LlmchatError, match="not in the GPU test cache") as info:
        compiler.get_library(cfg, DeviceSpec("cuda"), arch="sm_90")
    assert "make gpu-cache" in info.value.fix and before == build.COMPILE_COUNT
    assert not list((root / prebuilt.ENGINE_CACHE / "libs").iterdir())


def test_collection_and_the_steps_before_the_gpu_need_no_compiler(tmp_path, tiny_model_dir):
    """Under a runtime-only TVM (TVM_USE_RUNTIME_LIB=1: no compiler library, as on the GPU machine):
    the GPU suite is collected; a tiny model is written from the cache's parameter list; the kernel
    cases' inputs and numpy references are made."""
    from app.inference.compile import build
    from app.inference.store.config import ModelConfig

    cfg = ModelConfig.load(tiny_model_dir("qwen2", "q4f16_1", hidden_size=256, intermediate_size=640))
    root = _cache(tmp_path / "c", models={prebuilt.model_key(cfg): build.parameter_specs(cfg)})
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1", prebuilt.CACHE_ENV: str(root), "PYTHONPATH": str(ROOT)}
    collect = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "tests/gpu",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert collect.returncode == 0, collect.stdout[-3000:] + collect.stderr[-3000:]
    collected = [line for line in collect.stdout.splitlines() if "::" in line]
    assert any("test_cuda_kernels.py::test_matmul_kernels" in x for x in collected)
    assert any("test_engine_cuda.py" in x for x in collected)
    assert any("test_engine_vulkan.py::test_long_prompt_over_several_chunks" in x for x in collected)
    assert any("test_cuda_twin.py" in x for x in collected)
    code = textwrap.dedent(f"""
        import json
        from pathlib import Path
        try:
            import tvm.relax  # noqa: F401
            print("COMPILER PRESENT")
        except Exception:
            pass
        from app.inference.store.config import ModelConfig
        from tests.conftest import write_tiny_model
        from tests.gpu import kernels
        from tests.gpu.test_cuda_kernels import kernel_groups, small_op_cases
        path = write_tiny_model(Path({str(tmp_path / "model")!r}), "qwen2", "q4f16_1", hidden_size=256,
                                intermediate_size=640)
        cfg = ModelConfig.load(path)
        facts = {{"matmul_kernels": True, "max_cluster": 16, "prompt_attention": True}}
        groups = sorted(kernel_groups(facts))
        cases = [*small_op_cases()[:3], kernels.decode_attention_case(4, 2, 64, [[17]]),
                 kernels.prefill_attention_case(4, 2, 16, [([5], [5], True)])]
        runs = sum(len(c.runs) for c in cases)
        shards = len(list(path.glob("params_shard_*.bin")))
        print("RESULT " + json.dumps({{"groups": groups, "runs": runs, "shards": shards}}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "COMPILER PRESENT" not in out.stdout
    got = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert got["groups"] == [
        "decode_cluster",
        "decode_global",
        "decode_gqa",
        "decode_unsplit",
        "matmul",
        "prefill",
        "prefill_paged",
        "small_ops",
    ]
    assert got["runs"] == 5 + 6 + 6 + 1 + 1 and got["shards"] >= 1  # argmax: 5 rows, 6 from 3 words
    # without the parameter list in the cache: a clear error, not TVM's exporter
    (root / prebuilt.MANIFEST).write_text(
        json.dumps({**json.loads((root / prebuilt.MANIFEST).read_text()), "models": {}})
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert out.returncode != 0 and "has no parameter list for the model" in out.stderr


LAVAPIPE = "wgsl-f16-wg32768-t256"
VULKAN_TEST = "tests/gpu/test_engine_vulkan.py"


def _wgsl_cache(root: Path, profile: str = LAVAPIPE, **changes) -> Path:
    """A cache holding the WGSL library of one tiny model for ``profile`` (bytes in its place)."""
    _cache(root)
    lib = root / prebuilt.ENGINE_CACHE / "libs" / "llama-q4f16_1-vulkan-0123.so"
    lib.write_bytes(b"\x7fELF wgsl")
    manifest = json.loads((root / prebuilt.MANIFEST).read_text())
    manifest["wgsl"] = {"profile": profile, "libraries": {"llama-d128": prebuilt._entry(root, lib)}}
    manifest.update(changes)
    (root / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    return root


def test_the_wgsl_libraries_of_the_adapters_profile_are_read(tmp_path):
    cache = prebuilt.Prebuilt(_wgsl_cache(tmp_path / "c"))
    cache.check_wgsl(LAVAPIPE)
    assert cache.wgsl_profile == LAVAPIPE
    assert cache.wgsl_library("llama-d128").name == "llama-q4f16_1-vulkan-0123.so"


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no wgsl", "has no WGSL libraries"),
        (
            "other profile",
            f"for the adapter profile {prebuilt.DEFAULT_WGSL_PROFILE}, this Vulkan adapter is {LAVAPIPE}",
        ),
        ("other sources", "built from other sources"),
        ("library missing", "WGSL library of 'qwen2-d64' is not in the GPU test cache"),
        ("damaged library", "missing or damaged"),
    ],
)
def test_a_wgsl_library_missing_stale_or_for_another_adapter_fails_with_the_rebuild_command(
    tmp_path, breakage, message
):
    profile = prebuilt.DEFAULT_WGSL_PROFILE if breakage == "other profile" else LAVAPIPE
    root = _wgsl_cache(
        tmp_path / "c", profile, **({"sources": "0" * 24} if breakage == "other sources" else {})
    )
    name = "qwen2-d64" if breakage == "library missing" else "llama-d128"
    if breakage == "no wgsl":
        manifest = json.loads((root / prebuilt.MANIFEST).read_text())
        del manifest["wgsl"]
        (root / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    elif breakage == "damaged library":
        next((root / prebuilt.ENGINE_CACHE / "libs").glob("*.so")).write_bytes(b"\x7fELF wgsL")
    with pytest.raises(prebuilt.CacheError, match=message) as info:
        cache = prebuilt.Prebuilt(root)
        cache.check_wgsl(LAVAPIPE)
        cache.wgsl_library(name)
    assert f"--wgsl-profile {LAVAPIPE}" in str(info.value)


def test_the_cache_gets_the_wgsl_libraries_of_a_profile_and_check_finds_a_damaged_one(tmp_path, monkeypatch):
    """``build --no-cuda --wgsl-profile P`` (a real compile, one small model): the engine cache holds
    its WGSL library, the manifest its entry; ``check`` passes, then fails on a damaged library; a
    profile that is not one fails before the old cache is touched."""
    switches = {"LLMCHAT_WGSL_GEMM": "f16"}  # a model built with a kernel switch (SWITCHED)
    models = {"small": ("llama", "q4f16_1", {}, {}), "small-f16": ("llama", "q4f16_1", {}, switches)}
    monkeypatch.setattr(prebuilt, "_vulkan_models", lambda: models)
    monkeypatch.delenv("LLMCHAT_WGSL_GEMM", raising=False)
    out = tmp_path / "cache"
    manifest = prebuilt.build("sm_90", out, log=lambda _: None, wgsl_profile=LAVAPIPE, cuda=False)
    assert manifest["wgsl"]["profile"] == LAVAPIPE and list(manifest["wgsl"]["libraries"]) == list(models)
    assert "LLMCHAT_WGSL_GEMM" not in os.environ  # the switch was set for its build only
    lib, switched = (out / manifest["wgsl"]["libraries"][name]["file"] for name in models)
    # the switch reached the compiler: a library of its own, whose prompt GEMM sums in fp16
    assert switched != lib and b"var part : array<vec4<f16>" in switched.read_bytes()
    assert b"var part : array<vec4<f16>" not in lib.read_bytes()
    assert lib.parent == out / prebuilt.ENGINE_CACHE / "libs" and "-vulkan-" in lib.name
    meta = json.loads(lib.with_suffix(".json").read_text())
    target = json.loads(meta["target"])  # compiled for the profile, not for this machine's adapter
    assert (target["kind"], target["max_shared_memory_per_block"], target["max_num_threads"]) == (
        "webgpu",
        32768,
        256,
    )
    assert len(manifest["models"]) == 1 and not manifest["kernels"]  # one model, two libraries
    assert prebuilt.main(["check", str(out)]) == 0
    lib.write_bytes(lib.read_bytes()[:-1])
    assert prebuilt.main(["check", str(out)]) == 1
    assert prebuilt.main(["build", "--no-cuda", "--wgsl-profile", "wgsl-x", "--out", str(out)]) == 2
    assert (out / prebuilt.MANIFEST).is_file()


def test_the_vulkan_engine_test_fails_not_skips_on_a_cache_for_another_adapter(tmp_path):
    """On this machine's Vulkan adapter (lavapipe in CI) with a cache built for the H200's profile:
    the Vulkan engine test fails, naming both profiles and the rebuild command."""
    from tests.inference.backends.vulkan_env import need_vulkan

    need_vulkan()
    root = _wgsl_cache(tmp_path / "c", prebuilt.DEFAULT_WGSL_PROFILE)
    env = {**os.environ, prebuilt.CACHE_ENV: str(root), "PYTHONPATH": str(ROOT), "LLMCHAT_NO_SKIP": "1"}
    env["LLMCHAT_CACHE_DIR"] = str(tmp_path / "llmchat-cache")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            "-k",
            "llama-d128",
            VULKAN_TEST,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert run.returncode == 1, run.stdout[-3000:]
    # the fixture fails: an error of the test, never a skip
    assert "1 error" in run.stdout and "skipped" not in run.stdout, run.stdout[-3000:]
    assert f"for the adapter profile {prebuilt.DEFAULT_WGSL_PROFILE}, this Vulkan adapter is" in run.stdout
    assert "--wgsl-profile wgsl-" in run.stdout


def test_the_digest_follows_the_engine_tests_models_not_their_files(monkeypatch):
    """The cache's digest changes with a tiny model the engine tests load (a library of its own),
    not with the rest of those test files (comments, tolerances): their bytes are not hashed."""
    from tests.gpu import test_engine_vulkan

    before = prebuilt.sources_digest()
    assert prebuilt.sources_digest() == before
    assert "test_engine_vulkan.py" not in prebuilt.HASHED_FILES
    assert "test_engine_cuda.py" not in prebuilt.HASHED_FILES
    family, overrides = test_engine_vulkan.MODELS["llama-mha-d128"]
    monkeypatch.setitem(
        test_engine_vulkan.MODELS, "llama-mha-d128", (family, {**overrides, "context_window": 2048})
    )
    assert prebuilt.sources_digest() != before
