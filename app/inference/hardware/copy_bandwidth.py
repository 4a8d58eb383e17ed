"""A device's memory bandwidth as a copy measures it: the roofline's denominator of ``llmchat bench``.

A datasheet's figure is a promise (4.8 TB/s for an H200), a copy is what the device really moves
(4.25 TB/s on that H200). :func:`measure` times a copy — on a GPU a device-to-device copy of ~1 GiB
through TVM's runtime (the backend's own copy: CUDA's, llmchat's HIP runtime's, the Vulkan add-on's
buffer-to-buffer copy), on the CPU numpy copying 256 MiB between two arrays, one thread per CPU — and
reports the bytes read and written per second of the best of a few repeats after a warm-up copy.
:func:`cached` measures once per device and keeps the figure in ``<cache dir>/copy_bandwidth.json``,
keyed by the device's name and driver (a new driver or another GPU is measured anew); a damaged
file is measured again and rewritten, never a crash. Needs TVM's runtime only, not its compiler.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.errors import LlmchatError
from app.jsonfile import read_json, write_json_atomic
from app.paths import cache_dir

FILE_NAME = "copy_bandwidth.json"
#: bytes copied per repeat on a GPU (less where the device has less memory free)
COPY_BYTES = 1 << 30
#: on the CPU: far beyond any last-level cache (a Steam Deck's is 4 MiB, big desktops' 128 MiB), and
#: quicker to set up than a GiB (a fresh array's pages are faulted in first)
CPU_COPY_BYTES = 256 << 20
REPEATS = 5
#: below this a copy measures caches and launch latency, not memory
MIN_COPY_BYTES = 16 << 20
#: at most this share of the free memory is taken by the two buffers together
FREE_SHARE = 0.5
#: DLPack device types → llmchat's backend names
_BACKENDS = {1: "cpu", 2: "cuda", 10: "rocm", 15: "vulkan"}


@dataclass(frozen=True)
class CopyBandwidth:
    """A measured copy bandwidth: bytes read + written per second on ``device`` (the cache key)."""

    device: str
    bytes_per_s: float
    measured_at: float  # seconds since the epoch
    copy_bytes: int
    runs: tuple[float, ...] = ()  # bytes/s of each repeat
    cached: bool = field(default=False, compare=False)

    @property
    def date(self) -> str:
        """The day it was measured (UTC), e.g. 2026-12-02."""
        return time.strftime("%Y-%m-%d", time.gmtime(self.measured_at))

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_s": self.bytes_per_s,
            "measured_at": self.measured_at,
            "copy_bytes": self.copy_bytes,
            "runs": list(self.runs),
        }


def path() -> Path:
    return cache_dir() / FILE_NAME


def _is_cpu(dev: Any) -> bool:
    return dev is None or int(dev.dlpack_device_type()) == 1


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def _meminfo(field_name: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return None


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def device_key(dev: Any) -> str:
    """What a measurement is kept under: the backend, the device's name and its driver (the CPU: its
    model, the threads it may use and the RAM installed, which decide what a copy reaches)."""
    if _is_cpu(dev):
        total = _meminfo("MemTotal")
        ram = f", {total / 2**30:.0f} GiB RAM" if total else ""
        return f"cpu: {_cpu_name()} ({_threads()} threads{ram})"
    backend = _BACKENDS.get(int(dev.dlpack_device_type()), f"device type {int(dev.dlpack_device_type())}")
    name = driver = None
    with contextlib.suppress(Exception):
        name = dev.device_name
    with contextlib.suppress(Exception):
        driver = dev.driver_version
    return f"{backend}: {name or 'unknown device'} (driver {driver or 'unknown'})"


def _free_bytes(dev: Any) -> int | None:
    if _is_cpu(dev):
        return _meminfo("MemAvailable")
    with contextlib.suppress(Exception):
        free = int(dev.available_global_memory)
        if free > 0:
            return free
    return None


def _max_buffer_bytes(dev: Any) -> int | None:
    """The largest single buffer the device allows (Vulkan adapters cap it; lavapipe: 2 GiB)."""
    if _is_cpu(dev) or int(dev.dlpack_device_type()) != 15:
        return None
    with contextlib.suppress(Exception):
        from app.inference.backends import webgpu

        return int(webgpu.adapter(int(dev.index)).max_buffer_bytes)
    return None


def copy_size(dev: Any, wanted: int = COPY_BYTES) -> int:
    """Bytes to copy: ``wanted``, less where the free memory or the largest buffer allowed is smaller."""
    size = wanted
    free = _free_bytes(dev)
    if free is not None:
        size = min(size, int(free * FREE_SHARE / 2))
    limit = _max_buffer_bytes(dev)
    if limit is not None:
        size = min(size, limit)
    size -= size % (1 << 20) if size >= 1 << 20 else 0
    if size < MIN_COPY_BYTES:
        free_text = f"{free / 2**20:,.0f} MiB free" if free is not None else "too little memory"
        raise LlmchatError(
            f"Cannot measure the copy bandwidth of {device_key(dev)}: {free_text}, a copy needs "
            f"2 × {MIN_COPY_BYTES >> 20} MiB at least.",
            "close what else uses the device's memory, or give the figure with --bandwidth GB/S",
        )
    return size


def _time_cpu(nbytes: int, repeats: int) -> list[float]:
    """Seconds of each copy of ``nbytes`` between two numpy arrays, one chunk per thread."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)  # written: its pages are in RAM before the timing
    dst = np.zeros(nbytes, dtype=np.uint8)
    threads = max(1, _threads())
    bounds = [nbytes * i // threads for i in range(threads + 1)]
    chunks = [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(bounds)]

    def copy_all(pool: ThreadPoolExecutor) -> None:
        for _ in pool.map(lambda pair: np.copyto(*pair), chunks):  # numpy copies without the GIL
            pass

    seconds = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        copy_all(pool)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            copy_all(pool)
            seconds.append(time.perf_counter() - t0)
    if not np.array_equal(dst[:: 1 << 16], src[:: 1 << 16]):  # a copy that copies nothing is no figure
        raise LlmchatError("The CPU copy measured for the bandwidth copied wrongly.", "report this bug")
    return seconds


def _time_device(dev: Any, nbytes: int, repeats: int) -> list[float]:
    """Seconds of each device-to-device copy of ``nbytes`` (TVM's runtime; synchronized each time)."""
    import tvm

    src = tvm.runtime.empty((nbytes,), "uint8", dev)
    dst = tvm.runtime.empty((nbytes,), "uint8", dev)
    try:
        src.copyto(dst)  # warm-up
        dev.sync()
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            src.copyto(dst)
            dev.sync()
            seconds.append(time.perf_counter() - t0)
        return seconds
    finally:
        del src, dst


def measure(dev: Any = None, nbytes: int | None = None, repeats: int = REPEATS) -> CopyBandwidth:
    """Measure now: a copy of ``nbytes`` (default: :data:`COPY_BYTES`, less where memory is short) on
    ``dev`` (a TVM device; None or a CPU device: RAM; :data:`CPU_COPY_BYTES` there), ``repeats``
    times after a warm-up; the best."""
    default = CPU_COPY_BYTES if _is_cpu(dev) else COPY_BYTES
    size = copy_size(dev, default if nbytes is None else nbytes)
    repeats = max(1, repeats)
    try:
        seconds = _time_cpu(size, repeats) if _is_cpu(dev) else _time_device(dev, size, repeats)
    except LlmchatError:
        raise
    except Exception as err:  # out of memory, a driver error: a measurement that could not be made
        raise LlmchatError(
            f"Measuring the copy bandwidth of {device_key(dev)} failed: {err}",
            "give the figure with --bandwidth GB/S",
        ) from err
    runs = tuple(2 * size / s for s in seconds if s > 0)
    if not runs:
        raise LlmchatError(
            f"The copies measured on {device_key(dev)} took no time (the clock did not move).",
            "give the figure with --bandwidth GB/S",
        )
    return CopyBandwidth(device_key(dev), max(runs), time.time(), size, runs)


def _parse(key: str, item: Any) -> CopyBandwidth | None:
    if not isinstance(item, dict):
        return None
    bw, when, size = item.get("bytes_per_s"), item.get("measured_at"), item.get("copy_bytes")
    runs = item.get("runs", [])
    numbers = (bw, when, size)
    if not (
        all(isinstance(n, int | float) and not isinstance(n, bool) and math.isfinite(n) for n in numbers)
        and bw > 0
        and when > 0
        and size > 0
        and isinstance(runs, list)
        and all(isinstance(r, int | float) and not isinstance(r, bool) for r in runs)
    ):
        return None
    return CopyBandwidth(key, float(bw), float(when), int(size), tuple(float(r) for r in runs), cached=True)


def _stored() -> tuple[dict[str, Any], str | None]:
    """The file's measurements by device (raw), and what was wrong with it (None: nothing)."""
    data, problem = read_json(path())
    if problem:
        return {}, problem
    if data is None:
        return {}, None
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(devices, dict):
        return {}, f"{path()} does not hold copy bandwidths"
    return devices, None


def lookup(dev: Any = None) -> CopyBandwidth | None:
    """The figure kept for ``dev``, if a valid one is."""
    key = device_key(dev)
    devices, _problem = _stored()
    return _parse(key, devices.get(key))


def cached(dev: Any = None, nbytes: int | None = None, repeats: int = REPEATS) -> CopyBandwidth:
    """The copy bandwidth of ``dev`` kept in the cache, measured (and kept) where there is none or the
    kept one is damaged. Failing to write the cache is not an error: the figure is returned."""
    from app.debug_log import log

    key = device_key(dev)
    devices, problem = _stored()
    if problem:
        log.info("copy bandwidth: %s; measuring again", problem)
    found = _parse(key, devices.get(key))
    if found is not None:
        return found
    if key in devices:
        log.info("copy bandwidth: the entry of %s in %s is damaged; measuring again", key, path())
    result = measure(dev, nbytes, repeats)
    kept = {k: v for k, v in devices.items() if _parse(k, v) is not None}
    kept[key] = result.as_dict()
    try:
        write_json_atomic(path(), {"version": 1, "devices": kept})
    except OSError as err:
        log.info("copy bandwidth: cannot write %s (%s)", path(), err)
    return result
