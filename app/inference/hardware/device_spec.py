"""``--device`` parsing and the check that the installed TVM runtime can drive that device.

``resolve_device("auto" | "cpu" | "cuda" | "rocm" | "vulkan" | "metal" [":N"])`` returns a
``DeviceSpec`` or raises ``LlmchatError`` saying what is missing and how to get it — PyPI's
``apache-tvm`` has no ROCm or Metal runtime, and asking such a build for one of those devices
must never reach native code that could crash.  ``vulkan`` runs through llmchat's own WebGPU
device API on wgpu-native (:mod:`app.inference.backends.webgpu`): TVM's ``webgpu`` device N.
``rocm`` runs through llmchat's own HIP runtime (:mod:`app.inference.backends.hip`): HIP's device N.
With ``LLMCHAT_GPU_RUNTIME=twin``, ``cuda`` runs through that same runtime bound to NVIDIA's
driver (its CUDA twin) instead of TVM's CUDA runtime.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from app.errors import LlmchatError

BACKENDS = ("cpu", "cuda", "rocm", "vulkan", "metal")
_DEVICE_RE = re.compile(r"^(auto|cpu|llvm|cuda|rocm|vulkan|metal)(?::(\d+))?$")

#: where the installed TVM has no runtime for a backend that llmchat brings no add-on for (Metal):
#: MLC's TVM wheels would have one, but they replace apache-tvm, which llmchat needs
NO_RUNTIME_FIX = (
    "llmchat has no {what} runtime of its own and PyPI's apache-tvm was built without one: "
    "run on the CPU with --device cpu (or --device auto)"
)
METAL_ELSEWHERE = "Metal exists only on macOS (Apple GPUs): use --device auto or --device cpu on this machine"


@dataclass(frozen=True)
class DeviceSpec:
    """A concrete device: backend name and index."""

    backend: str  # one of BACKENDS
    index: int = 0

    def __str__(self) -> str:
        return f"{self.backend}:{self.index}"


def parse_device(text: str) -> tuple[str, int | None]:
    """Split ``"cuda:1"`` into ``("cuda", 1)``; ``"auto"`` -> ``("auto", None)``."""
    match = _DEVICE_RE.match((text or "auto").strip().lower())
    if not match:
        raise LlmchatError(
            f"Unknown device {text!r}.",
            "use one of: auto, cpu, cuda, rocm, vulkan, metal (optionally with an index, e.g. cuda:1)",
        )
    kind = "cpu" if match.group(1) == "llvm" else match.group(1)
    return kind, int(match.group(2)) if match.group(2) is not None else None


def _global_func_exists(name: str) -> bool:
    import tvm

    return tvm.get_global_func(name, allow_missing=True) is not None


def _prepare_cuda() -> None:
    try:
        from app.inference.compile.cuda_support import prepare_cuda_runtime
    except ImportError:
        return
    prepare_cuda_runtime()


def runtime_problem(backend: str, index: int = 0) -> str | None:
    """Why the installed TVM cannot run ``backend`` (None when it can, as far as can be told safely)."""
    if backend == "cpu":
        return None
    if backend == "vulkan":
        from app.inference.backends import webgpu

        return webgpu.problem(index)
    if backend == "rocm":
        from app.inference.backends import hip

        return hip.problem(index)
    if backend == "cuda":
        try:
            _prepare_cuda()
        except LlmchatError as err:
            return err.problem
    if not _global_func_exists(f"device_api.{backend}"):
        if backend == "cuda":
            return (
                "the installed TVM cannot load its CUDA runtime (libtvm_runtime_cuda.so needs "
                "libcudart.so.13 from CUDA 13 and an NVIDIA driver)"
            )
        name = {"rocm": "ROCm", "vulkan": "Vulkan", "metal": "Metal"}.get(backend, backend)
        return f"the installed TVM runtime was built without {name} support"
    return None


def check_device(spec: DeviceSpec) -> None:
    """Raise LlmchatError unless ``spec`` exists and the TVM runtime can drive it."""
    problem = runtime_problem(spec.backend, spec.index)
    if problem and spec.backend == "vulkan":
        from app.inference.backends import webgpu

        raise LlmchatError(f"Cannot use --device {spec}: {problem}.", webgpu.fix_for(problem))
    if problem and spec.backend == "rocm":
        from app.inference.backends import hip

        raise LlmchatError(f"Cannot use --device {spec}: {problem}.", hip.fix_for(problem))
    if problem:
        what = {"rocm": "ROCm", "vulkan": "Vulkan", "metal": "Metal", "cuda": "CUDA"}[spec.backend]
        if spec.backend == "cuda":
            fix = (
                "install the CUDA 13 runtime (`pip install nvidia-cuda-runtime`) and an NVIDIA driver, "
                "or run on the CPU with --device cpu"
            )
        elif spec.backend == "metal" and sys.platform != "darwin":
            fix = METAL_ELSEWHERE
        else:
            fix = NO_RUNTIME_FIX.format(what=what)
        raise LlmchatError(f"Cannot use --device {spec}: {problem}.", fix)
    if spec.backend in ("cpu", "vulkan", "rocm"):
        return  # vulkan, rocm: llmchat's runtimes have seen the device
    import tvm

    if not tvm.device(spec.backend, spec.index).exist:
        raise LlmchatError(
            f"No {spec.backend} device {spec.index} was found.",
            "check the driver (`llmchat doctor`), pick another index, or use --device cpu",
        )


def _auto() -> DeviceSpec:
    try:
        from app.inference.hardware import shared_probe
    except ImportError:
        return DeviceSpec("cpu", 0)
    try:
        report = shared_probe()  # loads the CUDA runtime first where NVIDIA's driver is
    except Exception:  # the probe is best effort; never block a start on it
        from app.debug_log import log

        log.warning("the hardware probe failed: --device auto falls back to the CPU", exc_info=True)
        return DeviceSpec("cpu", 0)
    backend = str(getattr(report, "backend", "cpu") or "cpu")
    device = str(getattr(report, "device", "") or "")
    index = 0
    if ":" in device:
        try:
            index = int(device.rsplit(":", 1)[1])
        except ValueError:
            index = 0
    if backend not in BACKENDS or runtime_problem(backend, index):
        return DeviceSpec("cpu", 0)
    spec = DeviceSpec(backend, index)
    try:
        check_device(spec)
    except LlmchatError:
        return DeviceSpec("cpu", 0)
    return spec


def resolve_device(text: str = "auto") -> DeviceSpec:
    """Turn a ``--device`` value into a usable ``DeviceSpec`` (raises LlmchatError otherwise)."""
    kind, index = parse_device(text)
    if kind == "auto":
        return _auto()
    spec = DeviceSpec(kind, index or 0)
    check_device(spec)
    return spec


def tvm_device(spec: DeviceSpec):
    """The ``tvm.runtime.Device`` for ``spec``."""
    import tvm

    if spec.backend == "cuda":
        _prepare_cuda()
    if spec.backend == "vulkan":
        from app.inference.backends import webgpu

        return webgpu.device(spec.index)
    if spec.backend == "rocm":
        from app.inference.backends import hip

        return hip.device(spec.index)
    return tvm.device(spec.backend, spec.index)
