"""Vulkan through WebGPU: TVM's WGSL code generator + wgpu-native, driven by llmchat's add-on.

PyPI's ``apache-tvm`` has no Vulkan runtime and no SPIR-V code generator, but it has a WebGPU
(WGSL) code generator, and PyPI's ``wgpu`` bundles wgpu-native, which runs WGSL on Vulkan
(RADV on a Steam Deck or a Radeon, NVIDIA's driver, Mesa's lavapipe).  llmchat's device API
(:mod:`.addon`, ``native/llmchat_webgpu.cc``) connects the two.  ``--device vulkan[:N]`` means
TVM's ``webgpu`` device N: the N-th adapter wgpu finds, GPUs before CPU devices.

This module answers: which adapters are there (:func:`adapters`), why Vulkan cannot run here
(:func:`problem`), the compile target for an adapter (:func:`target_dict`) and what in it
decides the compiled code (:func:`fingerprint`).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from app.errors import LlmchatError

#: TVM's device name for the runtime this backend provides
TVM_DEVICE = "webgpu"
#: TVM's WGSL kernels use at most this many threads per workgroup (MLC's webgpu preset)
MAX_THREADS = 256


@dataclass(frozen=True)
class Adapter:
    """One adapter as wgpu reports it."""

    index: int
    name: str
    vendor: str
    device_type: str  # DiscreteGPU, IntegratedGPU, CPU, Unknown
    backend: str  # Vulkan, Metal, D3D12
    driver: str
    vendor_id: int = 0
    device_id: int = 0
    shader_f16: bool = False
    subgroups: bool = False
    subgroup_min_size: int = 0
    subgroup_max_size: int = 0
    limits: dict[str, int] = field(default_factory=dict)

    @property
    def max_binding_bytes(self) -> int:
        return int(self.limits.get("max_storage_buffer_binding_size", 128 << 20))

    @property
    def max_buffer_bytes(self) -> int:
        return int(self.limits.get("max_buffer_size", 256 << 20))

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "vendor": self.vendor,
            "device_type": self.device_type,
            "backend": self.backend,
            "driver": self.driver,
            "vendor_id": self.vendor_id,
            "device_id": self.device_id,
            "shader_f16": self.shader_f16,
            "subgroups": self.subgroups,
            "subgroup_min_size": self.subgroup_min_size,
            "subgroup_max_size": self.subgroup_max_size,
            "limits": dict(self.limits),
        }


def vulkan_loader_present() -> bool:
    """Whether the Vulkan loader (libvulkan.so.1) can be found by the dynamic linker."""
    if os.name != "posix":
        return True
    return ctypes.util.find_library("vulkan") is not None or _dlopen_ok("libvulkan.so.1")


def _dlopen_ok(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def adapters() -> list[Adapter]:
    """The adapters wgpu sees, in ``vulkan:N`` order (loads the add-on; raises LlmchatError)."""
    from app.inference.backends.webgpu import addon

    addon.load()
    import tvm

    raw = json.loads(str(tvm.get_global_func("llmchat.webgpu.adapters")()))
    out = []
    for i, a in enumerate(raw):
        out.append(
            Adapter(
                index=i,
                name=str(a.get("name", "")),
                vendor=str(a.get("vendor", "")),
                device_type=str(a.get("device_type", "")),
                backend=str(a.get("backend", "")),
                driver=str(a.get("driver", "")),
                vendor_id=int(a.get("vendor_id", 0)),
                device_id=int(a.get("device_id", 0)),
                shader_f16=bool(a.get("shader_f16")),
                subgroups=bool(a.get("subgroups")),
                subgroup_min_size=int(a.get("subgroup_min_size", 0)),
                subgroup_max_size=int(a.get("subgroup_max_size", 0)),
                limits={k: int(v) for k, v in dict(a.get("limits", {})).items()},
            )
        )
    return out


def problem(index: int = 0) -> str | None:
    """Why ``vulkan:index`` cannot run here (None when it can), in words a user can act on."""
    from app.inference.backends.webgpu import addon

    if addon.wgpu_library() is None:
        return "the `wgpu` package (wgpu-native) is not installed"
    if not vulkan_loader_present():
        return "the Vulkan loader (libvulkan.so.1) is not installed"
    try:
        found = adapters()
    except LlmchatError as err:
        return err.problem
    if not found:
        return "wgpu found no Vulkan adapter (no Vulkan driver for this GPU is installed)"
    if index >= len(found):
        return f"there is no Vulkan adapter {index} (wgpu found {len(found)})"
    return None


def fix_for(problem_text: str) -> str:
    """A fix for one of :func:`problem`'s answers."""
    if "wgpu" in problem_text and "not installed" in problem_text:
        return "`pip install wgpu` in llmchat's environment (`make run` installs it), or use --device cpu"
    if "loader" in problem_text or "no Vulkan adapter" in problem_text:
        return (
            "install the Vulkan loader and your GPU's driver (Debian/Ubuntu: "
            "`sudo apt install libvulkan1 mesa-vulkan-drivers`; Arch: `vulkan-radeon`; SteamOS has it in "
            "Desktop Mode), or use --device cpu"
        )
    if "compiler" in problem_text:
        return "install g++ or `pip install ziglang`, or use --device cpu"
    return "run `llmchat doctor`, pick another --device vulkan:N, or use --device cpu"


def adapter(index: int) -> Adapter:
    """``vulkan:index``'s adapter (raises LlmchatError with a fix when it is not there)."""
    why = problem(index)
    if why:
        raise LlmchatError(f"Cannot use --device vulkan:{index}: {why}.", fix_for(why))
    return adapters()[index]


#: subgroup sizes llmchat's WGSL may assume: TVM 0.27 lowers a WGSL reduction as for 32-wide
#: warps whatever ``thread_warp_size`` says (a 16-thread sum shuffles down by 8, which an 8-wide
#: subgroup does not have: NaNs on lavapipe's 8-wide subgroups), so only 32; the adapter must
#: report one fixed size, min == max
SUBGROUP_SIZES = (32,)


@dataclass(frozen=True)
class Profile:
    """What of an adapter decides the compiled WGSL: shader-f16, workgroup memory, threads, and
    the subgroup size when the adapter has one fixed size. Its text form
    (``wgsl-f16-wg32768-t256``, ``wgsl-f16-wg49152-t256-sg32``) is the library's device
    fingerprint and what ``--arch`` takes to build for an adapter that is not here (a prebuilt
    library, a benchmark)."""

    f16: bool
    workgroup_bytes: int
    threads: int
    subgroup: int = 0  # 0: no subgroup operations in the compiled code

    def __str__(self) -> str:
        text = f"wgsl-{'f16' if self.f16 else 'f32'}-wg{self.workgroup_bytes}-t{self.threads}"
        return f"{text}-sg{self.subgroup}" if self.subgroup else text

    @classmethod
    def of(cls, a: Adapter) -> Profile:
        shared = min(int(a.limits.get("max_compute_workgroup_storage_size", 16384)), 65536)
        threads = min(int(a.limits.get("max_compute_invocations_per_workgroup", 256)), MAX_THREADS)
        return cls(a.shader_f16, shared, threads, subgroup_size(a))

    @classmethod
    def parse(cls, text: str) -> Profile:
        m = re.fullmatch(r"wgsl-(f16|f32)-wg(\d+)-t(\d+)(?:-sg(\d+))?", text.strip())
        sizes = ", ".join(str(s) for s in SUBGROUP_SIZES)
        if not m:
            raise LlmchatError(
                f"{text!r} is not a WGSL adapter profile.",
                "use the form wgsl-f16-wg32768-t256, with -sgN for a fixed subgroup size N "
                f"({sizes}; see `llmchat doctor`)",
            )
        subgroup = int(m.group(4) or 0)
        threads = int(m.group(3))
        if m.group(4) is not None and (subgroup not in SUBGROUP_SIZES or subgroup > threads):
            raise LlmchatError(
                f"{text!r} asks for subgroups of {subgroup}, which llmchat's WGSL cannot use.",
                f"use -sgN with N one of {sizes} (at most the thread count), or leave -sgN out",
            )
        return cls(m.group(1) == "f16", int(m.group(2)), threads, subgroup)


def subgroup_size(a: Adapter) -> int:
    """The subgroup size compiled code may assume on ``a``: its size when the adapter offers
    subgroups with one fixed size (min == max) that TVM's reductions can use; else 0 (TVM assumes
    a fixed warp size, so with sizes that vary a reduction or broadcast could read wrong lanes).
    ``LLMCHAT_WGSL_SUBGROUPS=0`` turns them off."""
    if os.environ.get("LLMCHAT_WGSL_SUBGROUPS", "").strip() == "0":
        return 0
    if not a.subgroups or a.subgroup_min_size != a.subgroup_max_size:
        return 0
    size = a.subgroup_min_size
    threads = min(int(a.limits.get("max_compute_invocations_per_workgroup", 256)), MAX_THREADS)
    return size if size in SUBGROUP_SIZES and size <= threads else 0


def target_dict(index: int, host: dict[str, Any], profile: str | None = None) -> dict[str, Any]:
    """TVM's ``webgpu`` target sized to the adapter (or to ``profile``): workgroup memory and
    threads from its limits (TVM assumes 32 KiB; a prefill attention of a 1B model wants more
    than WebGPU's default 16 KiB); subgroups only for a profile with a fixed subgroup size
    (``-sgN``: TVM's shuffles assume one warp size; lavapipe offers none, RADV may run 32 or 64
    wide), with ``thread_warp_size`` that size."""
    p = Profile.parse(profile) if profile else Profile.of(adapter(index))
    return {
        "kind": "webgpu",
        "max_num_threads": p.threads,
        "max_shared_memory_per_block": p.workgroup_bytes,
        "thread_warp_size": p.subgroup or 1,
        "supports_subgroups": bool(p.subgroup),
        "host": host,
    }


def fingerprint(index: int) -> str:
    """The adapter's :class:`Profile`: a library built for other adapter features is rebuilt,
    not reused; one built for the same features elsewhere is found."""
    return str(Profile.of(adapter(index)))


def device(index: int) -> Any:
    """TVM's device for ``vulkan:index`` (the add-on loaded)."""
    from app.inference.backends.webgpu import addon

    addon.load()
    import tvm

    return tvm.device(TVM_DEVICE, index)


def stats(index: int = 0) -> dict[str, Any]:
    """The add-on's counters for an opened adapter: dispatches, submits, syncs, read-backs,
    bytes allocated, bind groups cached."""
    import tvm

    return json.loads(str(tvm.get_global_func("llmchat.webgpu.stats")(index)))


#: environment switch: the add-on times every dispatch on the GPU (timestamp queries; it makes each
#: submission wait for its work, so decode gets slower while it is on)
PROFILE_ENV = "LLMCHAT_WEBGPU_PROFILE"


def profile(index: int = 0) -> dict[str, Any]:
    """GPU time per kernel since the adapter was opened (or :func:`profile_reset`), when the
    process runs with ``LLMCHAT_WEBGPU_PROFILE=1``: ``{"enabled", "error", "total_ns", "kernels":
    [{"name", "count", "ns"}, ...]}``, the slowest first. A kernel's time is from the timestamp
    before it to the one after it (its execution and the barrier in front of it)."""
    import tvm

    return json.loads(str(tvm.get_global_func("llmchat.webgpu.profile")(index)))


def profile_reset(index: int = 0) -> None:
    """Wait for the queued work, then start :func:`profile`'s sums again."""
    import tvm

    tvm.get_global_func("llmchat.webgpu.profile_reset")(index)


#: the KV cache keeps one page more than the context needs (runtime.ModelRuntime)
_PAGE = 16


def check_fits(
    index: int,
    params: list[dict[str, Any]],
    kv_bytes_per_token_layer: int,
    context: int,
    explicit: bool = False,
) -> int:
    """Say before loading whether a model fits the adapter's buffer limits: every weight tensor
    is one buffer and must fit one binding (lavapipe: 128 MiB, NVIDIA: 2 GiB); each layer's KV
    pages are one buffer too, so the context window is shortened to fit (or, when the user asked
    for that window, refused). Returns the context window to use."""
    import numpy as np

    a = adapters()[index]
    limit = min(a.max_binding_bytes, a.max_buffer_bytes)
    for p in params:
        nbytes = (
            int(np.prod(p["shape"], dtype=np.int64))
            * np.dtype("float16" if p["dtype"] == "bfloat16" else p["dtype"]).itemsize
        )
        if nbytes > limit:
            raise LlmchatError(
                f"The weight {p['name']} ({nbytes / 2**20:,.0f} MiB) is larger than {a.name} can bind "
                f"in one buffer ({limit / 2**20:,.0f} MiB), so this model cannot run on it.",
                "use a smaller model or a more compact quantization, or --device cpu",
            )
    fits = limit // max(1, kv_bytes_per_token_layer) // _PAGE * _PAGE - 2 * _PAGE
    if context <= fits:
        return context
    if explicit or fits < 64:
        raise LlmchatError(
            f"A context window of {context} tokens needs KV-cache buffers larger than {a.name} can bind "
            f"({limit / 2**20:,.0f} MiB per layer).",
            f"use --context-window {max(64, fits)} or less",
        )
    return int(fits)
