"""Keep compiled libraries in the user cache: the key that names a library, the slot it lives in,
and verified reads and atomic writes of cache entries.

The key (``LibraryKey``) holds everything that changes the generated code: the model's architecture
fields and weight formats (hashed), the target (GPU architecture, WGSL adapter profile or portable
CPU level), the host code's CPU level, the TVM version, ``ENGINE_VERSION``, the kernel switches that
are set and the digest of the sources that end up in a library (``sources.py``).  Its digest names
the cache entry; a prebuilt library's manifest carries the same key, so one comparison decides both
"cached already" and "this bundle fits" (app/inference/compile/prebuilt.py).

Libraries are written atomically (temp file, then rename); the ``.json`` beside the ``.so`` is
written last and marks a complete entry: it records the library's size and sha256, checked before
every load, so a truncated or damaged library is rebuilt instead of crashing the process.  A library
runs with a runtime-only TVM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent
from app.inference.compile import sources, targets
from app.inference.store.config import ModelConfig

#: bump when the engine's calling convention or model code changes incompatibly
ENGINE_VERSION = "1"


@dataclass(frozen=True)
class CompiledModel:
    """A cached model library and the parameters its functions take (in order)."""

    lib_path: Path
    params: list[dict[str, Any]]  # [{"name", "shape", "dtype"}] in the VM's packed order
    target: str
    compute_dtype: str  # activations and KV cache
    origin: str = "compiled"  # "compiled" here or "prebuilt" (downloaded, verified)

    @property
    def kv_itemsize(self) -> int:
        return 2 if self.compute_dtype in ("float16", "bfloat16") else 4


def libs_dir() -> Path:
    """Where compiled libraries live."""
    return paths.cache_dir() / "libs"


# ------------------------------------------------------------------------------------------
# The key
# ------------------------------------------------------------------------------------------
#: environment switches that change the generated kernels (pipelines/gpu.py and cpu.py read them)
KERNEL_SWITCHES = (
    "LLMCHAT_GPU_GEMV",
    "LLMCHAT_CUDA_GEMM",
    "LLMCHAT_CUDA_ATTENTION",
    "LLMCHAT_CUDA_PAGED_PREFILL",
    "LLMCHAT_CUDA_GQA_DECODE",
    "LLMCHAT_CUDA_GQA_MIN_KEYS",
    "LLMCHAT_WGSL_GEMM",
    "LLMCHAT_WGSL_ATTENTION",
    "LLMCHAT_WGSL_PREFILL_ATTENTION",
    "LLMCHAT_WGSL_ROPE_APPEND",
    "LLMCHAT_WGSL_GEMV",
    "LLMCHAT_WGSL_SUBGROUPS",
    "LLMCHAT_WGSL_FUSION",
    "LLMCHAT_WGSL_Q4_PRELOAD",
    "LLMCHAT_WGSL_GATE_LAYOUT",
    "LLMCHAT_WGSL_NORM_OUT_LAYOUT",
    "LLMCHAT_WGSL_MIN_WORKGROUPS",
    "LLMCHAT_CPU_GEMM",
    "LLMCHAT_TENSOR_CORE_MATMUL",
)


def _kernel_switches() -> dict[str, str]:
    """The kernel switches that are set, normalised: part of the cache key, so that setting one
    rebuilds the library instead of reusing one built without it."""
    values = {name: os.environ.get(name, "").strip().lower() for name in KERNEL_SWITCHES}
    return {name: value for name, value in values.items() if value}


def stock_pipeline_forced() -> bool:
    """``LLMCHAT_TVM_PIPELINE=default`` compiles with TVM's stock pipeline (a fallback when a
    schedule misbehaves; slower code)."""
    return os.environ.get("LLMCHAT_TVM_PIPELINE", "").strip().lower() == "default"


@dataclass(frozen=True)
class LibraryKey:
    """Everything that decides a library's code.  Its digest names the entry in the local compile
    cache, and a prebuilt bundle's manifest carries it field by field: a bundle fits this machine
    exactly when its key is the one this machine would compile (app/inference/compile/prebuilt.py)."""

    model: str  # sha256 of the model's code-relevant config (ModelConfig.code_key)
    quantization: str
    backend: str  # cpu, cuda, rocm, vulkan, metal
    device: str  # the CPU level, GPU architecture (sm_90, gfx1100) or WGSL adapter profile
    host_cpu: str  # the portable CPU level of the host code
    tvm: str
    engine: str  # ENGINE_VERSION
    source: str  # digest of llmchat's sources that end up in a library (library_sources)
    pipeline: str  # "llmchat" or "tvm-default" (TVM's stock pipeline)
    switches: tuple[tuple[str, str], ...] = ()  # kernel switches that are set

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["switches"] = dict(self.switches)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> LibraryKey:
        """The key a manifest records (ValueError when a field is missing or of the wrong type)."""
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(names):
            raise ValueError(f"a library key has exactly the fields {', '.join(names)}")
        switches = data["switches"]
        if not isinstance(switches, dict) or not all(isinstance(v, str) for v in switches.values()):
            raise ValueError("switches must map names to strings")
        if not all(isinstance(data[n], str) for n in names if n != "switches"):
            raise ValueError("every field but switches must be a string")
        return cls(**{**data, "switches": tuple(sorted(switches.items()))})

    def digest(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    @property
    def target(self) -> str:
        """``cpu-x86-64-v3``, ``cuda-sm_90``, ``vulkan-wgsl-f16-wg32768-t256``: the label a catalog's
        prebuilt library names."""
        return f"{self.backend}-{self.device}"

    def differences(self, other: LibraryKey) -> list[str]:
        """What differs from ``other`` (this machine's key), in words: ``TVM 0.26.0 (here 0.27.0)``."""
        words = {
            "model": "model config",
            "device": "target",
            "host_cpu": "host CPU level",
            "tvm": "TVM",
            "engine": "engine version",
            "source": "llmchat library sources",
            "pipeline": "pipeline",
            "switches": "kernel switches",
        }
        mine, theirs = self.as_dict(), other.as_dict()
        return [
            f"{words.get(n, n)} {mine[n] or '-'} (here {theirs[n] or '-'})"
            for n in mine
            if mine[n] != theirs[n]
        ]


def library_key(
    cfg: ModelConfig, backend: str, fingerprint: str, plain_pipeline: bool | None = None
) -> LibraryKey:
    """The key of ``cfg`` compiled for ``backend`` / ``fingerprint`` (``plain_pipeline``: with TVM's
    stock pipeline; default: as LLMCHAT_TVM_PIPELINE says)."""
    import tvm

    model = hashlib.sha256(json.dumps(cfg.code_key(), sort_keys=True, default=str).encode()).hexdigest()
    plain = stock_pipeline_forced() if plain_pipeline is None else plain_pipeline
    return LibraryKey(
        model=model[:32],
        quantization=cfg.quantization,
        backend=backend,
        device=fingerprint,
        host_cpu=targets.host_level(backend, fingerprint),
        tvm=str(tvm.__version__),
        engine=ENGINE_VERSION,
        source=sources.digest()[:32],
        pipeline="tvm-default" if plain else "llmchat",
        switches=tuple(sorted(_kernel_switches().items())),
    )


def cache_key(cfg: ModelConfig, backend: str, fingerprint: str, plain_pipeline: bool | None = None) -> str:
    """Hex digest naming the library of ``cfg`` compiled for ``backend`` / ``fingerprint``."""
    return library_key(cfg, backend, fingerprint, plain_pipeline).digest()


# ------------------------------------------------------------------------------------------
# Entries on disk
# ------------------------------------------------------------------------------------------
def file_digest(path: Path) -> str:
    """sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified_entry(lib: Path, meta_path: Path) -> CompiledModel | None:
    """The cache entry at ``lib``/``meta_path`` when it is complete and the library is exactly the
    one written (size and sha256 recorded in the metadata); None otherwise.  Loading a truncated
    library maps past its end and dies of SIGBUS, so nothing unverified is ever loaded."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if lib.stat().st_size != int(meta["size"]) or file_digest(lib) != meta["sha256"]:
            return None
        return CompiledModel(
            lib, meta["params"], meta["target"], meta["compute_dtype"], meta.get("origin", "compiled")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temp file and a rename (never half-written)."""
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".json.tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _drop_entry(lib: Path, meta_path: Path) -> None:
    for path in (meta_path, lib):  # metadata first: a half-removed entry is never "complete"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@dataclass(frozen=True)
class LibrarySlot:
    """Where the library of a model on a device lives in the cache, under which key, and the
    model config as it is compiled there (compute dtype, storage)."""

    cfg: ModelConfig
    key: LibraryKey
    lib: Path
    meta: Path

    @property
    def digest(self) -> str:
        return self.lib.stem.rsplit("-", 1)[-1]


def cached_library(slot: LibrarySlot, progress: ProgressCallback | None = None) -> CompiledModel | None:
    """The slot's verified cache entry; a damaged or incomplete one is removed (and None)."""
    if not (slot.meta.exists() or slot.lib.exists()):
        return None
    found = verified_entry(slot.lib, slot.meta)
    if found is not None:
        return found
    if progress:
        progress(
            ProgressEvent(
                "compile", f"the cached library {slot.lib.name} is damaged or incomplete: rebuilding it", 0, 3
            )
        )
    drop_library(slot)
    return None


def drop_library(slot: LibrarySlot) -> None:
    """Remove the slot's entry (metadata first: a half-removed entry is never "complete")."""
    _drop_entry(slot.lib, slot.meta)


def install_library(slot: LibrarySlot, built: Path, meta: dict[str, Any]) -> CompiledModel:
    """Move ``built`` (a verified library on the cache's file system) into the slot and write its
    metadata last, with the size and sha256 every later load checks."""
    try:
        os.replace(built, slot.lib)
        meta = {**meta, "key": slot.digest, "size": slot.lib.stat().st_size, "sha256": file_digest(slot.lib)}
        write_json_atomic(slot.meta, meta)
    except OSError as err:
        raise cache_write_error(libs_dir(), err) from err
    return CompiledModel(
        slot.lib, meta["params"], meta["target"], meta["compute_dtype"], meta.get("origin", "compiled")
    )


def compile_seconds(backend: str) -> float | None:
    """How long compiling a library for ``backend`` took on this machine (the mean of the cached
    libraries' recorded times), or None when none was compiled here yet."""
    times = []
    with contextlib.suppress(OSError):
        for meta_path in libs_dir().glob(f"*-{backend}-*.json"):
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                if meta.get("origin", "compiled") == "compiled" and float(meta.get("compile_s", 0)) > 0:
                    times.append(float(meta["compile_s"]))
    return sum(times) / len(times) if times else None


def cache_write_error(where: Path, err: OSError) -> LlmchatError:
    """The message for a compile cache that cannot be written (full, read-only, not a directory)."""
    from app.errors import os_error

    return os_error(
        err,
        f"Cannot write the compiled model library to {where}",
        "free some disk space, or point LLMCHAT_CACHE_DIR at a writable directory",
    )
