"""Fixtures of the GPU suite (marker ``gpu``; ``make test-gpu`` on a machine with an NVIDIA GPU,
nvcc and the CUDA 13 runtime). Without a GPU its tests skip with the reason, and ``make test-gpu``
sets ``LLMCHAT_NO_SKIP=1``, so that a run on the GPU machine cannot pass by not running.

Two ways to get the code the tests run (tests/gpu/prebuilt.py):
* compiled here, on the fly (TVM's compiler and nvcc installed: ``make test-gpu``);
* loaded from a prebuilt cache (``LLMCHAT_GPU_TEST_CACHE=DIR``, ``make test-gpu-prebuilt``), where
  nothing is compiled and anything missing or stale fails the test."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import prebuilt


@dataclass
class Gpu:
    """CUDA GPU 0 as the suite sees it: the TVM device, its architecture (``sm_90``), what the
    suite asks of its target (:func:`prebuilt.target_facts`), and where compiled code comes from:
    ``target`` (compile here) or ``cache`` (a prebuilt cache; ``target`` is None)."""

    device: Any
    arch: str
    facts: dict[str, Any]
    target: Any = None
    cache: prebuilt.Prebuilt | None = None

    def kernels(self, group: str, cases: list[Any], workdir: Path) -> Any:
        """The library of the suite's kernel ``group`` (its ``cases``), loaded."""
        from app.inference.compile import cuda_support
        from tests.gpu import kernels

        if self.cache is None:
            return kernels.build(cases, self.target, workdir)
        try:
            path = self.cache.kernel_library(group, [c.name for c in cases])
        except prebuilt.CacheError as err:
            pytest.fail(str(err))
        return cuda_support.load_cuda_library(path)

    def file(self, name: str) -> Path:
        assert self.cache is not None
        try:
            return self.cache.file("files", name)
        except prebuilt.CacheError as err:
            pytest.fail(str(err))


@pytest.fixture(scope="session")
def cuda() -> Gpu:
    """CUDA GPU 0 and how the suite gets its code (see :class:`Gpu`)."""
    from app.errors import LlmchatError
    from app.inference.compile import cuda_support

    root = prebuilt.cache_root()
    cache = None
    if root is not None:
        try:
            cache = prebuilt.Prebuilt(root)
        except prebuilt.CacheError as err:
            pytest.fail(str(err))
    elif cuda_support.find_nvcc() is None:
        pytest.skip(
            "nvcc (the CUDA toolkit) is needed to build the kernels "
            f"(or a prebuilt cache: {prebuilt.CACHE_ENV}, tests/gpu/prebuilt.py)"
        )
    try:
        cuda_support.prepare_cuda_runtime()
    except LlmchatError as err:
        pytest.skip(f"no CUDA runtime: {err}")
    import tvm

    device = tvm.cuda(0)
    if not device.exist:
        pytest.skip("no CUDA GPU")
    arch = prebuilt.arch_of(device)
    if cache is not None:
        try:
            cache.check(arch)
        except prebuilt.CacheError as err:
            pytest.fail(str(err))
        prebuilt.forbid_compiling(cache.root)
        return Gpu(device, arch, cache.facts, cache=cache)
    target = prebuilt.cuda_target(arch)
    return Gpu(device, arch, prebuilt.target_facts(target), target=target)


@pytest.fixture(autouse=True)
def _engine_cache_from_the_prebuilt_cache(_isolated_dirs: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Running from a prebuilt cache, the engine finds its libraries there (LLMCHAT_CACHE_DIR)."""
    root = prebuilt.cache_root()
    if root is None:
        return
    try:
        path = prebuilt.Prebuilt(root).engine_cache()
    except prebuilt.CacheError as err:
        pytest.fail(str(err))
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(path))


@dataclass
class VulkanAdapter:
    """Vulkan adapter 0 (llmchat's WebGPU device API on wgpu-native) as the suite sees it: its
    name, its WGSL profile (what the engine's libraries are compiled for) and the prebuilt cache
    its libraries come from (None: compiled here)."""

    name: str
    profile: str
    cache: prebuilt.Prebuilt | None = None

    def check_library(self, model: str) -> None:
        """Running from a prebuilt cache: the WGSL library of the tiny model ``model`` is there,
        intact (the engine then loads it from the cache's engine libraries, compiling nothing)."""
        if self.cache is None:
            return
        try:
            self.cache.wgsl_library(model)
        except prebuilt.CacheError as err:
            pytest.fail(str(err))


@pytest.fixture(scope="session")
def vulkan() -> VulkanAdapter:
    """Vulkan adapter 0 and where its engine libraries come from (see :class:`VulkanAdapter`).
    Without an adapter the test skips with the reason (a failure under LLMCHAT_NO_SKIP=1); from a
    prebuilt cache built for another adapter profile it fails with the command that rebuilds it."""
    import os

    from app.inference.backends import webgpu

    root = prebuilt.cache_root()
    cache = None
    if root is not None:
        try:
            cache = prebuilt.Prebuilt(root)
            engine_cache = cache.engine_cache()
        except prebuilt.CacheError as err:
            pytest.fail(str(err))
    # the add-on (built for this machine's TVM and wgpu-native) is looked up in the engine cache,
    # where `make test-gpu-prebuilt` builds it first; built there now if missing
    old = os.environ.get("LLMCHAT_CACHE_DIR")
    if cache is not None:
        os.environ["LLMCHAT_CACHE_DIR"] = str(engine_cache)
    try:
        why = webgpu.problem(0)
    finally:
        if old is None:
            os.environ.pop("LLMCHAT_CACHE_DIR", None)
        else:
            os.environ["LLMCHAT_CACHE_DIR"] = old
    if why:
        pytest.skip(f"no Vulkan adapter: {why} (fix: {webgpu.fix_for(why)})")
    adapter = webgpu.adapter(0)
    profile = webgpu.fingerprint(0)
    if cache is not None:
        try:
            cache.check_wgsl(profile)
        except prebuilt.CacheError as err:
            pytest.fail(f"{err} (adapter: {adapter.name})")
        prebuilt.forbid_compiling(cache.root)
    return VulkanAdapter(adapter.name, profile, cache)
