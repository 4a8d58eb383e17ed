"""The GPU suite's prebuilt cache: everything tests/gpu would compile, compiled ahead of time.

The GPU machine has nvcc and a GPU but only TVM's runtime (``libtvm_compiler.so`` is too large to
carry there), so the suite runs in two steps:

1. here, on a machine with TVM's compiler and nvcc, no GPU needed::

       make gpu-cache                      # python -m tests.gpu.prebuilt build --arch sm_90 --out DIR

   compiles into DIR the kernel libraries of tests/gpu/test_cuda_kernels.py (fatbins: no compiler
   needed to load them), the twin's scale kernel, the engine libraries of the tiny models (llmchat's
   pipeline and TVM's plain one, under ``DIR/llmchat-cache``, the engine's own cache layout), the
   WGSL libraries of the tiny models for one Vulkan adapter profile (``--wgsl-profile``, default
   the H200's NVIDIA driver: ``wgsl-f16-wg49152-t256``; tests/gpu/test_engine_vulkan.py) in the same
   engine cache, and the parameter lists of the tiny models (which TVM's model exporter, a compiler
   part, gives);
2. on the GPU machine, ``LLMCHAT_GPU_TEST_CACHE=DIR`` (``make test-gpu-prebuilt``): the suite loads
   only from DIR. Nothing is compiled there: a library that is missing, built for another GPU
   architecture or from other sources fails its test with the command that rebuilds the cache,
   never a skip and never a silent compile.

Expected values need no compiler: the numpy float64 references are computed on the GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: environment switch: run the GPU suite from this prebuilt cache
CACHE_ENV = "LLMCHAT_GPU_TEST_CACHE"
FORMAT = 1
MANIFEST = "manifest.json"
#: the engine's cache directory (LLMCHAT_CACHE_DIR) inside the prebuilt cache
ENGINE_CACHE = "llmchat-cache"
REBUILD = (
    "fix: on a machine with TVM's compiler and nvcc, `make gpu-cache GPU_ARCH={arch}` "
    "(python -m tests.gpu.prebuilt build --arch {arch} --out DIR), then carry DIR here"
)
#: the WGSL adapter profile of the H200's Vulkan driver (NVIDIA 580, wgpu-native 29: BENCHMARKS.md)
DEFAULT_WGSL_PROFILE = "wgsl-f16-wg49152-t256"
REBUILD_WGSL = (
    "fix: on a machine with TVM's compiler, `make gpu-cache GPU_WGSL_PROFILE={profile}` "
    "(python -m tests.gpu.prebuilt build --wgsl-profile {profile} --out DIR), then carry DIR here"
)


class CacheError(Exception):
    """The prebuilt cache lacks something the suite needs (or holds something stale)."""


def cache_root() -> Path | None:
    """The prebuilt cache the suite runs from (``LLMCHAT_GPU_TEST_CACHE``), or None: compile."""
    value = os.environ.get(CACHE_ENV, "").strip()
    return Path(value).resolve() if value else None


#: files next to this one whose bytes are part of :func:`sources_digest` (the kernel cases and
#: this builder); the engine tests count by their model tables only
HASHED_FILES = ("kernels.py", "test_cuda_kernels.py", "test_cuda_twin.py", "prebuilt.py")


def sources_digest() -> str:
    """What the cache's contents are made from: the engine's compile sources (the digest in the
    engine's own library key), the suite's kernel cases and the tiny models the engine tests
    load (their tables, not their files: a comment or a tolerance there changes no library, and
    session 20 lost a GPU call to a cache made stale by a comment). Another digest: the cache is
    stale."""
    from app.inference.compile import sources

    h = hashlib.sha256(sources.digest().encode())
    for name in HASHED_FILES:
        h.update(name.encode())
        h.update((Path(__file__).parent / name).read_bytes())
    models = {"cuda": _tiny_models(), "vulkan": _vulkan_models()}
    h.update(json.dumps(models, sort_keys=True).encode())
    return h.hexdigest()[:24]


def arch_of(device: Any) -> str:
    """``sm_90`` of a TVM CUDA device (its compute capability), as the engine names it."""
    return "sm_" + str(device.compute_version).replace(".", "")


def target_facts(target: Any) -> dict[str, Any]:
    """What the suite asks of the target (which of llmchat's kernels it uses), recorded at build
    time: a runtime-only TVM cannot make a ``Target``."""
    from app.inference.pipelines import gpu, gpu_choices

    return {
        "arch": str(target.attrs["arch"]),
        "matmul_kernels": bool(
            gpu_choices.use_cuda_kernel_gemv(target) and gpu_choices.use_cuda_gemm(target)
        ),
        "max_cluster": int(gpu_choices.max_cluster_size(target)),
        "prompt_attention": bool(gpu.attention_passes(target)[1:]),
    }


def cuda_target(arch: str) -> Any:
    from app.inference.compile.targets import make_target
    from app.inference.hardware.device_spec import DeviceSpec

    return make_target(DeviceSpec("cuda", 0), arch=arch)


def _digest(path: Path) -> str:
    from app.inference.compile.cache import file_digest

    return file_digest(path)


# ------------------------------------------------------------------------------------------------
# reading the cache (GPU machine: runtime-only TVM)
# ------------------------------------------------------------------------------------------------
class Prebuilt:
    """A prebuilt cache, checked against this checkout and this GPU."""

    def __init__(self, root: Path) -> None:
        self.root = root
        path = root / MANIFEST
        try:
            self.manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CacheError(
                f"no readable GPU test cache at {path} ({err}); " + REBUILD.format(arch="sm_90")
            ) from err
        if self.manifest.get("format") != FORMAT:
            raise CacheError(
                f"{path} is of format {self.manifest.get('format')}, this suite reads "
                f"{FORMAT}; " + REBUILD.format(arch=self.arch)
            )

    @property
    def arch(self) -> str:
        return str(self.manifest.get("facts", {}).get("arch", "sm_90"))

    @property
    def facts(self) -> dict[str, Any]:
        return dict(self.manifest["facts"])

    def check(self, device_arch: str) -> None:
        """The cache fits this checkout's sources and this GPU."""
        if device_arch != self.arch:
            raise CacheError(
                f"the GPU test cache {self.root} was built for {self.arch}, this GPU is "
                f"{device_arch}; " + REBUILD.format(arch=device_arch)
            )
        self._check_sources(REBUILD.format(arch=self.arch))

    def _check_sources(self, rebuild: str) -> None:
        here = sources_digest()
        if self.manifest.get("sources") != here:
            raise CacheError(
                f"the GPU test cache {self.root} was built from other sources (commit "
                f"{self.manifest.get('commit')}, digest {self.manifest.get('sources')}; "
                f"this checkout: {here}); " + rebuild
            )

    @property
    def wgsl_profile(self) -> str | None:
        """The Vulkan adapter profile the cache's WGSL libraries were built for (None: none)."""
        return self.manifest.get("wgsl", {}).get("profile")

    def check_wgsl(self, adapter_profile: str) -> None:
        """The cache holds WGSL libraries for this adapter's profile, from this checkout's sources."""
        rebuild = REBUILD_WGSL.format(profile=adapter_profile)
        if self.wgsl_profile is None:
            raise CacheError(f"the GPU test cache {self.root} has no WGSL libraries; " + rebuild)
        if adapter_profile != self.wgsl_profile:
            raise CacheError(
                f"the GPU test cache {self.root} holds WGSL libraries for the adapter profile "
                f"{self.wgsl_profile}, this Vulkan adapter is {adapter_profile}; " + rebuild
            )
        self._check_sources(rebuild)

    def wgsl_library(self, name: str) -> Path:
        """The verified WGSL engine library of the tiny model ``name`` (in the engine cache)."""
        rebuild = REBUILD_WGSL.format(profile=self.wgsl_profile or DEFAULT_WGSL_PROFILE)
        entry = self.manifest.get("wgsl", {}).get("libraries", {}).get(name)
        if entry is None:
            raise CacheError(
                f"the WGSL library of '{name}' is not in the GPU test cache {self.root}; " + rebuild
            )
        path = self.root / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["size"] or _digest(path) != entry["sha256"]:
            raise CacheError(
                f"{path} is missing or damaged (size/sha256 differ from the manifest); " + rebuild
            )
        return path

    def file(self, section: str, name: str) -> Path:
        """The verified file of entry ``name`` in ``section`` (size and sha256 as recorded)."""
        entry = self.manifest.get(section, {}).get(name)
        if entry is None:
            raise CacheError(
                f"{section} '{name}' is not in the GPU test cache {self.root}; "
                + REBUILD.format(arch=self.arch)
            )
        path = self.root / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["size"] or _digest(path) != entry["sha256"]:
            raise CacheError(
                f"{path} is missing or damaged (size/sha256 differ from the manifest); "
                + REBUILD.format(arch=self.arch)
            )
        return path

    def kernel_library(self, group: str, case_names: list[str]) -> Path:
        entry = self.manifest.get("kernels", {}).get(group)
        if entry is not None and entry["cases"] != case_names:
            raise CacheError(
                f"the GPU test cache's '{group}' kernels are other cases than the suite's "
                f"({len(entry['cases'])} vs {len(case_names)}); " + REBUILD.format(arch=self.arch)
            )
        return self.file("kernels", group)

    def engine_cache(self) -> Path:
        path = self.root / ENGINE_CACHE
        if not (path / "libs").is_dir():
            raise CacheError(
                f"no engine libraries in the GPU test cache ({path / 'libs'}); "
                + REBUILD.format(arch=self.arch)
            )
        return path

    def parameter_specs(self, cfg: Any) -> list[dict[str, Any]]:
        key = model_key(cfg)
        specs = self.manifest.get("models", {}).get(key)
        if specs is None:
            raise CacheError(
                f"the GPU test cache has no parameter list for the model {key}; "
                + REBUILD.format(arch=self.arch)
            )
        return specs


def model_key(cfg: Any) -> str:
    return json.dumps(cfg.code_key(), sort_keys=True, default=str)


def parameter_specs(cfg: Any) -> list[dict[str, Any]]:
    """The parameter list of ``cfg``: TVM's model exporter, or, running from a prebuilt cache,
    the list recorded there (the exporter is a compiler part)."""
    root = cache_root()
    if root is None:
        from app.inference.compile.build import parameter_specs as exported

        return exported(cfg)
    return Prebuilt(root).parameter_specs(cfg)


def forbid_compiling(root: Path) -> None:
    """In this process, a library the engine does not find in the cache is an error naming the
    cache, not a compile (``build.compile_library`` refuses)."""
    from app.errors import LlmchatError
    from app.inference.compile import build, targets

    def refuse(cfg: Any, target: Any, out_path: Path, *_a: Any, **_k: Any) -> Any:
        raise LlmchatError(
            f"the engine library {out_path.name} ({cfg.model_type}, {cfg.quantization}) "
            f"is not in the GPU test cache {root} (built from other sources, or never built)",
            REBUILD.format(arch="sm_90").removeprefix("fix: "),
        )

    build.compile_library = refuse
    targets.make_target = lambda device, arch=None: None  # never asks the compiler for a Target


# ------------------------------------------------------------------------------------------------
# building the cache (a machine with TVM's compiler and nvcc; no GPU)
# ------------------------------------------------------------------------------------------------
def _entry(root: Path, path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "file": str(path.relative_to(root)),
        "size": path.stat().st_size,
        "sha256": _digest(path),
        **extra,
    }


def _tiny_models() -> dict[str, tuple[str, str, dict[str, Any], bool]]:
    """Every tiny model the GPU suite loads: name -> (family, quantization, overrides, plain
    pipeline too)."""
    from benchmarks import twin_check
    from tests.gpu.test_engine_cuda import LONG_MODELS, MODELS

    models = {
        name: (family, quant, overrides, False)
        for name, (family, quant, overrides) in twin_check.TINY.items()
    }
    for name, (family, overrides) in {**MODELS, **LONG_MODELS}.items():
        models[f"engine-{name}"] = (family, "q4f16_1", overrides, True)
    return models


def _vulkan_models() -> dict[str, tuple[str, str, dict[str, Any], dict[str, str]]]:
    """The tiny models of tests/gpu/test_engine_vulkan.py: name -> (family, quantization,
    overrides, kernel switches the library is built with)."""
    from tests.gpu.test_engine_vulkan import LONG_MODELS, MODELS, SWITCHED

    models = {
        name: (family, "q4f16_1", overrides, {})
        for name, (family, overrides) in {**MODELS, **LONG_MODELS}.items()
    }
    for name, (model, switches) in SWITCHED.items():
        family, quant, overrides, _ = models[model]
        models[name] = (family, quant, overrides, switches)
    return models


def build(
    arch: str,
    out: Path,
    log: Callable[[str], None] = print,
    wgsl_profile: str | None = DEFAULT_WGSL_PROFILE,
    cuda: bool = True,
) -> dict[str, Any]:
    """Compile everything the GPU suite needs for ``arch`` and the Vulkan adapter profile
    ``wgsl_profile`` (None: no WGSL) into ``out`` (made anew); ``cuda=False``: only the WGSL part
    (no nvcc needed)."""
    if wgsl_profile is not None:
        from app.inference.backends import webgpu

        wgsl_profile = str(webgpu.Profile.parse(wgsl_profile))  # a bad one fails before anything is removed
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    target = cuda_target(arch) if cuda else None
    facts = target_facts(target) if cuda else {}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "facts": facts,
        "sources": sources_digest(),
        "commit": _commit(),
        "built": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        "kernels": {},
        "files": {},
        "models": {},
    }
    if cuda:
        _build_cuda(arch, out, manifest, target, log)
    if wgsl_profile is not None:
        _build_wgsl(wgsl_profile, out, manifest, log)
    shutil.rmtree(out / ENGINE_CACHE / "tmp", ignore_errors=True)  # the compiler's scratch
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest


@contextlib.contextmanager
def _environ(values: dict[str, str | None]) -> Iterator[None]:
    """``values`` in the environment while inside (None: unset); the caller's come back after."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def _engine_cache_env(out: Path) -> contextlib.AbstractContextManager[None]:
    """The engine compiles into ``out``'s engine cache with llmchat's pipeline while inside; the
    caller's ``LLMCHAT_CACHE_DIR`` and ``LLMCHAT_TVM_PIPELINE`` come back after."""
    return _environ({"LLMCHAT_CACHE_DIR": str(out / ENGINE_CACHE), "LLMCHAT_TVM_PIPELINE": None})


def _build_cuda(
    arch: str, out: Path, manifest: dict[str, Any], target: Any, log: Callable[[str], None]
) -> None:
    from app.inference.compile import build as library_build
    from app.inference.compile import compiler
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.store.config import ModelConfig
    from tests.conftest import write_tiny_model
    from tests.gpu import kernels
    from tests.gpu.test_cuda_kernels import kernel_groups
    from tests.gpu.test_cuda_twin import compile_scale_kernel

    facts = manifest["facts"]
    for group, make_cases in kernel_groups(facts).items():
        t0 = time.time()
        cases = make_cases()
        path = kernels.compile_cuda(cases, target, out / "kernels" / f"{group}.so")
        manifest["kernels"][group] = _entry(out, path, cases=[c.name for c in cases])
        log(f"kernels {group}: {len(cases)} cases, {path.stat().st_size:,} bytes, {time.time() - t0:.0f} s")
    scale = compile_scale_kernel(target, out / "twin" / "scale.so")
    manifest["files"]["twin-scale"] = _entry(out, scale)
    with _engine_cache_env(out), tempfile.TemporaryDirectory(prefix="gpu-cache-models-") as tmp:
        for name, (family, quant, overrides, plain) in _tiny_models().items():
            cfg = ModelConfig.load(write_tiny_model(Path(tmp) / name, family, quant, **overrides))
            manifest["models"][model_key(cfg)] = library_build.parameter_specs(cfg)
            for use_plain in (False, True) if plain else (False,):
                t0 = time.time()
                with _environ({"LLMCHAT_TVM_PIPELINE": "default" if use_plain else None}):
                    lib = compiler.get_library(cfg, DeviceSpec("cuda", 0), arch=arch)
                log(
                    f"engine {name}{' (plain pipeline)' if use_plain else ''}: {lib.lib_path.name}, "
                    f"{lib.lib_path.stat().st_size:,} bytes, {time.time() - t0:.0f} s"
                )


def _build_wgsl(profile: str, out: Path, manifest: dict[str, Any], log: Callable[[str], None]) -> None:
    """The WGSL libraries of the Vulkan test's tiny models for ``profile``, in the engine cache
    (llmchat's pipeline, as ``llmchat build --device vulkan --arch PROFILE`` builds them)."""
    from app.inference.compile.build import parameter_specs
    from app.inference.compile.compiler import get_library
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.store.config import ModelConfig
    from tests.conftest import write_tiny_model

    libraries: dict[str, Any] = {}
    with _engine_cache_env(out), tempfile.TemporaryDirectory(prefix="gpu-cache-wgsl-") as tmp:
        for name, (family, quant, overrides, switches) in _vulkan_models().items():
            cfg = ModelConfig.load(write_tiny_model(Path(tmp) / name, family, quant, **overrides))
            manifest["models"].setdefault(model_key(cfg), parameter_specs(cfg))
            t0 = time.time()
            with _environ(dict(switches)):
                lib = get_library(cfg, DeviceSpec("vulkan", 0), arch=profile)
            libraries[name] = _entry(out, lib.lib_path)
            size = lib.lib_path.stat().st_size
            log(f"wgsl {name} ({profile}): {lib.lib_path.name}, {size:,} bytes, {time.time() - t0:.0f} s")
    manifest["wgsl"] = {"profile": profile, "libraries": libraries}


def _commit() -> str | None:
    import subprocess

    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.gpu.prebuilt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile what the GPU suite needs (TVM's compiler, nvcc; no GPU)")
    b.add_argument("--arch", default="sm_90", help="the GPU's architecture (default sm_90: an H100/H200)")
    b.add_argument("--out", required=True, type=Path, help="the cache directory (replaced)")
    b.add_argument(
        "--wgsl-profile",
        default=DEFAULT_WGSL_PROFILE,
        help=f"the Vulkan adapter profile of the WGSL libraries (default {DEFAULT_WGSL_PROFILE}: the H200's "
        "NVIDIA driver; `llmchat doctor` names an adapter's; 'none': no WGSL)",
    )
    b.add_argument("--no-cuda", action="store_true", help="only the WGSL libraries (no nvcc needed)")
    c = sub.add_parser("check", help="is the cache complete and current for this checkout? (no GPU)")
    c.add_argument("cache", type=Path)
    c.add_argument("--arch", default=None, help="the GPU's architecture (default: the cache's)")
    args = ap.parse_args(argv)
    from app.errors import LlmchatError

    if args.cmd == "build":
        t0 = time.time()
        profile = None if args.wgsl_profile.strip().lower() == "none" else args.wgsl_profile
        try:
            build(args.arch, args.out.resolve(), wgsl_profile=profile, cuda=not args.no_cuda)
        except LlmchatError as err:
            print(f"error: {err.problem}\nfix: {err.fix}", file=sys.stderr)
            return 2
        print(
            f"GPU test cache: {args.out} ({_size(args.out):,} bytes, {time.time() - t0:.0f} s); "
            f"run the suite from it with {CACHE_ENV}={args.out}"
        )
        return 0
    try:
        cache = Prebuilt(args.cache.resolve())
        if cache.manifest.get("facts"):
            cache.check(args.arch or cache.arch)
        if cache.wgsl_profile is not None:
            cache.check_wgsl(cache.wgsl_profile)
            for name in cache.manifest["wgsl"]["libraries"]:
                cache.wgsl_library(name)
        for group, entry in cache.manifest["kernels"].items():
            cache.kernel_library(group, entry["cases"])
        for name in cache.manifest["files"]:
            cache.file("files", name)
        cache.engine_cache()
    except CacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    what = ", ".join(
        x for x in (cache.arch if cache.manifest.get("facts") else "", cache.wgsl_profile or "") if x
    )
    print(f"GPU test cache {args.cache}: complete and current ({what}, {_size(args.cache):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
