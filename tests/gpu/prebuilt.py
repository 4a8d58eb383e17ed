"""The GPU suite's prebuilt cache: everything tests/gpu would compile, compiled ahead of time.

The GPU machine has nvcc and a GPU but only TVM's runtime (``libtvm_compiler.so`` is too large to
carry there), so the suite runs in two steps:

1. here, on a machine with TVM's compiler and nvcc, no GPU needed::

       make gpu-cache                      # python -m tests.gpu.prebuilt build --arch sm_90 --out DIR

   compiles into DIR the kernel libraries of tests/gpu/test_cuda_kernels.py (fatbins: no compiler
   needed to load them), the twin's scale kernel, the engine libraries of the tiny models (llmchat's
   pipeline and TVM's plain one, under ``DIR/llmchat-cache``, the engine's own cache layout) and the
   parameter lists of the tiny models (which TVM's model exporter, a compiler part, gives);
2. on the GPU machine, ``LLMCHAT_GPU_TEST_CACHE=DIR`` (``make test-gpu-prebuilt``): the suite loads
   only from DIR. Nothing is compiled there: a library that is missing, built for another GPU
   architecture or from other sources fails its test with the command that rebuilds the cache,
   never a skip and never a silent compile.

Expected values need no compiler: the numpy float64 references are computed on the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
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


class CacheError(Exception):
    """The prebuilt cache lacks something the suite needs (or holds something stale)."""


def cache_root() -> Path | None:
    """The prebuilt cache the suite runs from (``LLMCHAT_GPU_TEST_CACHE``), or None: compile."""
    value = os.environ.get(CACHE_ENV, "").strip()
    return Path(value).resolve() if value else None


def sources_digest() -> str:
    """What the cache's contents are made from: the engine's compile sources (the digest in the
    engine's own library key) and the suite's kernel cases. Another digest: the cache is stale."""
    from app.inference.compile import sources

    h = hashlib.sha256(sources.digest().encode())
    for name in (
        "kernels.py",
        "test_cuda_kernels.py",
        "test_cuda_twin.py",
        "test_engine_cuda.py",
        "prebuilt.py",
    ):
        h.update(name.encode())
        h.update((Path(__file__).parent / name).read_bytes())
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
        here = sources_digest()
        if self.manifest.get("sources") != here:
            raise CacheError(
                f"the GPU test cache {self.root} was built from other sources (commit "
                f"{self.manifest.get('commit')}, digest {self.manifest.get('sources')}; "
                f"this checkout: {here}); " + REBUILD.format(arch=self.arch)
            )

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


def build(arch: str, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Compile everything the GPU suite needs for ``arch`` into ``out`` (made anew)."""
    from app.inference.compile import build, compiler
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.store.config import ModelConfig
    from tests.conftest import write_tiny_model
    from tests.gpu import kernels
    from tests.gpu.test_cuda_kernels import kernel_groups
    from tests.gpu.test_cuda_twin import compile_scale_kernel

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    target = cuda_target(arch)
    facts = target_facts(target)
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
    for group, make_cases in kernel_groups(facts).items():
        t0 = time.time()
        cases = make_cases()
        path = kernels.compile_cuda(cases, target, out / "kernels" / f"{group}.so")
        manifest["kernels"][group] = _entry(out, path, cases=[c.name for c in cases])
        log(f"kernels {group}: {len(cases)} cases, {path.stat().st_size:,} bytes, {time.time() - t0:.0f} s")
    scale = compile_scale_kernel(target, out / "twin" / "scale.so")
    manifest["files"]["twin-scale"] = _entry(out, scale)
    old_cache = os.environ.get("LLMCHAT_CACHE_DIR")
    old_pipeline = os.environ.pop("LLMCHAT_TVM_PIPELINE", None)
    os.environ["LLMCHAT_CACHE_DIR"] = str(out / ENGINE_CACHE)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-cache-models-") as tmp:
            for name, (family, quant, overrides, plain) in _tiny_models().items():
                cfg = ModelConfig.load(write_tiny_model(Path(tmp) / name, family, quant, **overrides))
                manifest["models"][model_key(cfg)] = build.parameter_specs(cfg)
                for use_plain in (False, True) if plain else (False,):
                    if use_plain:
                        os.environ["LLMCHAT_TVM_PIPELINE"] = "default"
                    t0 = time.time()
                    lib = compiler.get_library(cfg, DeviceSpec("cuda", 0), arch=arch)
                    os.environ.pop("LLMCHAT_TVM_PIPELINE", None)
                    log(
                        f"engine {name}{' (plain pipeline)' if use_plain else ''}: {lib.lib_path.name}, "
                        f"{lib.lib_path.stat().st_size:,} bytes, {time.time() - t0:.0f} s"
                    )
    finally:
        os.environ.pop("LLMCHAT_CACHE_DIR", None)
        if old_cache is not None:
            os.environ["LLMCHAT_CACHE_DIR"] = old_cache
        if old_pipeline is not None:
            os.environ["LLMCHAT_TVM_PIPELINE"] = old_pipeline
    shutil.rmtree(out / ENGINE_CACHE / "tmp", ignore_errors=True)  # the compiler's scratch
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest


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
    c = sub.add_parser("check", help="is the cache complete and current for this checkout? (no GPU)")
    c.add_argument("cache", type=Path)
    c.add_argument("--arch", default=None, help="the GPU's architecture (default: the cache's)")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        t0 = time.time()
        build(args.arch, args.out.resolve())
        print(
            f"GPU test cache: {args.out} ({_size(args.out):,} bytes, {time.time() - t0:.0f} s); "
            f"run the suite from it with {CACHE_ENV}={args.out}"
        )
        return 0
    try:
        cache = Prebuilt(args.cache.resolve())
        cache.check(args.arch or cache.arch)
        for group, entry in cache.manifest["kernels"].items():
            cache.kernel_library(group, entry["cases"])
        for name in cache.manifest["files"]:
            cache.file("files", name)
        cache.engine_cache()
    except CacheError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"GPU test cache {args.cache}: complete and current ({cache.arch}, {_size(args.cache):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
