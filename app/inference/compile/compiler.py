"""Get the library of a model for a device: find its key, look in the cache, fetch or build it, install it.

``get_library(cfg, device)`` returns a ``CompiledModel`` (path of the shared library plus the
parameter list the runtime needs), compiling only when no library with the same cache key is
cached.  This module only orchestrates; each step lives in a module of its own:

- the config as compiled on the device (compute dtype, float32 twins of float16 weights for WGSL
  adapters without shader-f16) and its slot: here (``library_slot``);
- the target, CPU level and device fingerprint: ``targets.py``;
- the key (model, target, host CPU level, TVM, engine version, kernel switches, and the digest of
  the sources that end up in a library, ``sources.py``) and the on-disk cache: ``cache.py``;
- the TVM build itself: ``build.py`` (with ``rocm_toolchain.py`` and ``cuda_support.py``);
- prebuilt libraries, whose manifest carries the same key: ``prebuilt.py`` (the ``fetch`` hook).

When llmchat's kernel schedules fail, TVM's stock pipeline builds a slower library, cached under
the stock pipeline's key and remembered for these sources, so the next start does not fail again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable

from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent
from app.inference.compile import build, cache, targets
from app.inference.compile.cache import CompiledModel, LibrarySlot
from app.inference.hardware.device_spec import DeviceSpec
from app.inference.store.config import ModelConfig


def compute_dtype_for(cfg: ModelConfig, backend: str) -> str | None:
    """The activation dtype to compile ``cfg`` with on ``backend`` (None: the stored dtype).

    CPUs have no fast float16 arithmetic: float16 models compute in float32 there (weights stay
    as stored).  ``LLMCHAT_COMPUTE_DTYPE=float16|float32`` overrides (tests, experiments)."""
    forced = os.environ.get("LLMCHAT_COMPUTE_DTYPE", "").strip()
    if forced:
        if forced not in ("float16", "float32"):
            raise LlmchatError(
                f"LLMCHAT_COMPUTE_DTYPE={forced!r} is not float16 or float32.", "unset it or use one of those"
            )
        return forced
    if backend == "cpu" and cfg.model_dtype == "float16":
        return "float32"
    return None


#: float16 formats and their float32 twins (same layout, float32 where float16 was)
F32_TWINS = {"q4f16_1": "q4f32_1", "q0f16": "q0f32", "ggml_f16": "q0f32"}


def without_f16_storage(cfg: ModelConfig, fingerprint: str) -> ModelConfig:
    """``cfg`` for a WGSL adapter without shader-f16 (profile ``wgsl-f32-…``): float16 weights
    become their float32 twins (widened exactly at load) and the model computes in float32."""
    if not fingerprint.startswith("wgsl-f32"):
        return cfg
    formats = {k: F32_TWINS.get(v, v) for k, v in cfg.tensor_formats.items()}
    return dataclasses.replace(
        cfg, quantization=F32_TWINS.get(cfg.quantization, cfg.quantization), tensor_formats=formats
    )


def library_slot(
    cfg: ModelConfig, device: DeviceSpec, arch: str | None = None, plain_pipeline: bool | None = None
) -> LibrarySlot:
    """The cache slot of ``cfg`` on ``device`` (``arch``: a GPU architecture, WGSL profile or CPU
    level that is not this machine's)."""
    fingerprint = targets.device_fingerprint(device, arch)
    if device.backend == "vulkan":
        cfg = without_f16_storage(cfg, fingerprint)
    cfg = dataclasses.replace(
        cfg, compute_dtype=compute_dtype_for(cfg, device.backend), word_storage=device.backend == "vulkan"
    )
    key = cache.library_key(cfg, device.backend, fingerprint, plain_pipeline)
    base = cache.libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{key.digest()}"
    return LibrarySlot(cfg, key, base.with_suffix(".so"), base.with_suffix(".json"))


#: asked on a cache miss before compiling: a verified prebuilt library installed in the slot, or None
Fetcher = Callable[[LibrarySlot], "CompiledModel | None"]


def get_library(
    cfg: ModelConfig,
    device: DeviceSpec,
    arch: str | None = None,
    progress: ProgressCallback | None = None,
    fetch: Fetcher | None = None,
) -> CompiledModel:
    """The cached library for ``cfg`` on ``device``, compiling it first if needed (also when the
    cached one fails its size/checksum check); ``fetch`` may install a prebuilt one instead."""
    slot = library_slot(cfg, device, arch)
    found = cache.cached_library(slot, progress)
    if found is not None:
        return found
    if fetch is not None:
        fetched = fetch(slot)
        if fetched is not None:
            return fetched
    fallback_key = cache.library_key(slot.cfg, device.backend, slot.key.device, plain_pipeline=True).digest()
    known = (
        None
        if cache.stock_pipeline_forced()
        else _known_fallback(slot.cfg, device, slot.digest, fallback_key)
    )
    if known is not None:
        if progress:
            progress(
                ProgressEvent(
                    "compile",
                    f"llmchat's schedules failed for this model before: using the "
                    f"cached library of TVM's stock pipeline (slower; delete "
                    f"{known.lib_path.name} to try the schedules again)",
                    3,
                    3,
                )
            )
        return known
    try:  # a cache that cannot take the library fails now, not after minutes of compiling
        cache.libs_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=cache.libs_dir(), prefix=".write-check-"):
            pass
    except OSError as err:
        raise cache.cache_write_error(cache.libs_dir(), err) from err
    return compile_into(slot, device, arch, progress)


def compile_into(
    slot: LibrarySlot, device: DeviceSpec, arch: str | None = None, progress: ProgressCallback | None = None
) -> CompiledModel:
    """Compile the slot's library here and cache it."""
    cfg, lib, meta_path = slot.cfg, slot.lib, slot.meta
    key = slot.digest
    target = targets.make_target(device, arch)
    t0 = time.monotonic()
    fallback_key = cache.library_key(cfg, device.backend, slot.key.device, plain_pipeline=True).digest()
    params, stock = build.compile_library(
        cfg, target, lib, progress, device_label=str(device), report_pipeline=True
    )
    normal_key = key
    if stock and not cache.stock_pipeline_forced():
        # TVM's stock pipeline stood in for llmchat's schedules: that slower library is cached under
        # the stock pipeline's key, never under this one; its metadata names this key, so a later
        # start with the same sources takes it at once, and changed sources try the schedules again
        fallback = cache.libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{fallback_key}"
        os.replace(lib, fallback.with_suffix(".so"))
        lib, meta_path, key = fallback.with_suffix(".so"), fallback.with_suffix(".json"), fallback_key
    meta = {
        "params": params,
        "target": str(target),
        "compute_dtype": cfg.activation_dtype,
        "key": key,
        "compile_s": round(time.monotonic() - t0, 2),
        "model": cfg.code_key(),
        "pipeline": "tvm-default" if stock else "llmchat",
        "origin": "compiled",
        # the schedules failed for these sources: later starts take this library at once
        **({"schedules_failed_for": normal_key} if stock and not cache.stock_pipeline_forced() else {}),
        "size": lib.stat().st_size,
        "sha256": cache.file_digest(lib),
    }
    try:
        cache.write_json_atomic(meta_path, meta)
    except OSError as err:
        raise cache.cache_write_error(cache.libs_dir(), err) from err
    return CompiledModel(lib, params, meta["target"], cfg.activation_dtype)


def _known_fallback(
    cfg: ModelConfig, device: DeviceSpec, key: str, fallback_key: str
) -> CompiledModel | None:
    """The stock-pipeline library cached when llmchat's schedules failed for exactly these sources
    (``key``): the failure would repeat, so a start does not pay for it again."""
    base = cache.libs_dir() / f"{cfg.model_type}-{cfg.quantization}-{device.backend}-{fallback_key}"
    meta_path = base.with_suffix(".json")
    try:
        if json.loads(meta_path.read_text(encoding="utf-8")).get("schedules_failed_for") != key:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    from app.debug_log import log

    log.info("llmchat's schedules failed before for key %s: using the stock library %s", key, base.name)
    return cache.verified_entry(base.with_suffix(".so"), meta_path)
