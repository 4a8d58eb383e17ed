"""Which backend to use, why, and what to run to get a better one.

Two answers: ``recommended_backend`` is what the hardware and the installed drivers call for;
``backend`` is what will actually run with the TVM runtimes installed here. Each comes with reasons
a person can read; ``fixes`` are concrete commands. ``HSA_OVERRIDE_GFX_VERSION`` is only offered,
with its risk, never applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.inference.hardware.amd_gpus import ROCM_SUPPORTED_GFX, hsa_override_for
from app.inference.hardware.devices import GpuDevice
from app.inference.hardware.runtimes import NvidiaStatus, RocmStatus, TvmRuntimes, VulkanStatus
from app.inference.hardware.system import SystemInfo

BACKENDS = ("rocm", "vulkan", "cuda", "metal", "cpu")
FALLBACKS = {
    "rocm": ["vulkan", "cpu"],
    "cuda": ["vulkan", "cpu"],
    "vulkan": ["cpu"],
    "metal": ["cpu"],
    "cpu": [],
}


@dataclass
class Decision:
    recommended_backend: str
    backend: str
    device: str  # "rocm:0", "vulkan:0", "cuda:0", "metal:0", "cpu:0"
    gpu: GpuDevice | None  # the GPU the backend runs on (None for cpu)
    recommended_reasons: list[str] = field(default_factory=list)
    backend_reasons: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)  # risky choices offered, never applied


@dataclass
class Inputs:
    gpus: list[GpuDevice]
    system: SystemInfo
    vulkan: VulkanStatus
    rocm: RocmStatus
    nvidia: NvidiaStatus
    tvm: TvmRuntimes
    steam_deck: str | None = None
    hsa_override: str | None = None  # HSA_OVERRIDE_GFX_VERSION the user exported, if any


def _distro(system: SystemInfo) -> str:
    ids = {system.os_release.get("ID", "").lower(), *system.os_release.get("ID_LIKE", "").lower().split()}
    if ids & {"steamos", "arch"}:
        return "arch"
    if ids & {"fedora", "rhel", "centos"}:
        return "fedora"
    if ids & {"opensuse", "suse", "opensuse-tumbleweed"}:
        return "suse"
    return "debian"


def _install(system: SystemInfo, packages: dict[str, str]) -> str:
    distro = _distro(system)
    return {
        "debian": f"sudo apt install {packages['debian']}",
        "fedora": f"sudo dnf install {packages['fedora']}",
        "arch": f"sudo pacman -S {packages['arch']}",
        "suse": f"sudo zypper install {packages.get('suse', packages['fedora'])}",
    }[distro]


def choose_gpu(gpus: list[GpuDevice]) -> GpuDevice | None:
    """The GPU to run on: a discrete one before an integrated one, NVIDIA > AMD > Intel, then the largest."""
    vendor_rank = {"nvidia": 3, "amd": 2, "intel": 1}
    usable = [g for g in gpus if g.vendor in vendor_rank]
    if not usable:
        return None
    return max(usable, key=lambda g: (g.kind == "discrete", vendor_rank[g.vendor], g.vram_bytes or 0))


def _index(gpu: GpuDevice, gpus: list[GpuDevice], backend: str) -> int:
    if backend == "cuda":
        same = [g for g in gpus if g.vendor == "nvidia"]
    elif backend == "rocm":
        same = sorted(
            (g for g in gpus if g.vendor == "amd"),
            key=lambda g: (g.kfd_node if g.kfd_node is not None else 1 << 30, g.pci_slot or ""),
        )
    else:
        same = [g for g in gpus if g.vendor in ("nvidia", "amd", "intel")]
    return next((i for i, g in enumerate(same) if g is gpu), 0)


def decide(inp: Inputs) -> Decision:
    """recommended_backend and backend with their reasons and fixes."""
    gpu = choose_gpu(inp.gpus)
    d = Decision("cpu", "cpu", "cpu:0", gpu)
    _recommend(inp, gpu, d)
    _runnable(inp, gpu, d)
    return d


# ------------------------------------------------------------------ what the hardware calls for


def _recommend(inp: Inputs, gpu: GpuDevice | None, d: Decision) -> None:
    why = d.recommended_reasons
    if inp.system.os_name == "Darwin":
        d.recommended_backend = "metal"
        why.append("macOS: Metal is the GPU API on a Mac (Apple silicon shares its memory with the GPU).")
        return
    if gpu is None:
        others = [g for g in inp.gpus if g.vendor not in ("nvidia", "amd", "intel")]
        why.append(
            "No supported GPU found"
            + (f" ({', '.join(g.name for g in others)})" if others else "")
            + ": the model runs on the CPU."
        )
        return
    if gpu.vendor == "nvidia":
        _recommend_nvidia(inp, gpu, d)
    elif gpu.vendor == "amd":
        _recommend_amd(inp, gpu, d)
    else:
        _recommend_intel(inp, gpu, d)


def _recommend_nvidia(inp: Inputs, gpu: GpuDevice, d: Decision) -> None:
    d.recommended_backend = "cuda"
    d.recommended_reasons.append(f"{gpu.name}: an NVIDIA GPU runs fastest with CUDA.")
    if not (inp.nvidia.driver_loaded or gpu.driver == "nvidia"):
        bound = f" (bound to {gpu.driver})" if gpu.driver else ""
        d.recommended_reasons.append(f"The NVIDIA driver is not loaded{bound}; CUDA needs it.")
        d.fixes.append(
            "Install NVIDIA's proprietary driver: "
            + _install(inp.system, {"debian": "nvidia-driver", "fedora": "akmod-nvidia", "arch": "nvidia"})
            + " (Ubuntu: sudo ubuntu-drivers install), then reboot."
        )


def _recommend_intel(inp: Inputs, gpu: GpuDevice, d: Decision) -> None:
    if gpu.kind == "discrete":
        d.recommended_backend = "vulkan"
        d.recommended_reasons.append(f"{gpu.name}: an Intel Arc GPU runs through Vulkan (Mesa ANV).")
    else:
        d.recommended_reasons.append(
            f"{gpu.name}: an Intel integrated GPU is rarely faster than the CPU for LLM decoding "
            "(both read the same memory); the model runs on the CPU."
        )


def _recommend_amd(inp: Inputs, gpu: GpuDevice, d: Decision) -> None:
    why, rocm = d.recommended_reasons, inp.rocm
    gfx = gpu.gfx_target
    gfx_text = f" ({gfx})" if gfx else ""
    d.recommended_backend = "vulkan"
    if inp.steam_deck is not None:
        why.append(
            f"Steam Deck{' ' + inp.steam_deck if inp.steam_deck else ''}: {gpu.name}{gfx_text} is an APU; "
            "ROCm does not support it and SteamOS does not ship ROCm. Vulkan (Mesa RADV) runs it and can use "
            "unified memory well beyond the 1–4 GB the BIOS reserves for the GPU."
        )
        return
    if gpu.is_integrated:
        why.append(
            f"{gpu.name}{gfx_text} is an integrated GPU (APU) sharing system memory: Vulkan (Mesa RADV) "
            "runs it and can use the carve-out plus GTT memory; ROCm's support for APUs is partial."
        )
        _offer_override(inp, gpu, d, only_if_rocm_installed=True)
        return
    if gfx is None:
        why.append(
            f"{gpu.name}: its gfx target is unknown (no KFD data, not in the table), so ROCm "
            "cannot be matched to it; Vulkan works on every RDNA GPU."
        )
        return
    supported = rocm.rocblas_gfx or ROCM_SUPPORTED_GFX
    source = (
        "the installed rocBLAS ships kernels for" if rocm.rocblas_gfx else "current ROCm releases support"
    )
    if gfx not in supported:
        pretend = gfx_from_override(inp.hsa_override)
        if pretend in supported and rocm.usable:
            d.recommended_backend = "rocm"
            why.append(
                f"{gpu.name} ({gfx}) is not supported by ROCm, but you set HSA_OVERRIDE_GFX_VERSION="
                f"{inp.hsa_override}, so ROCm treats it as {pretend}: using ROCm as you asked "
                "(unsupported by AMD; if it crashes or answers garbage, unset it to get Vulkan)."
            )
            return
        why.append(
            f"{gpu.name} ({gfx}): not among the gfx targets {source} "
            f"({', '.join(sorted(supported))}); Vulkan runs it."
        )
        _offer_override(inp, gpu, d, only_if_rocm_installed=False)
        return
    if rocm.usable:
        d.recommended_backend = "rocm"
        version = f" {rocm.version}" if rocm.version else ""
        why.append(
            f"{gpu.name} ({gfx}) is a discrete Radeon that ROCm{version} supports, /dev/kfd opens "
            "and the HIP runtime is installed: ROCm is the fastest path."
        )
        return
    why.append(
        f"{gpu.name} ({gfx}) is supported by ROCm, but ROCm is not usable here: "
        + "; ".join(_rocm_problems(inp))
        + ". Vulkan runs it meanwhile."
    )
    d.fixes.extend(_rocm_fixes(inp))


def gfx_from_override(value: str | None) -> str | None:
    """ "10.3.0" → "gfx1030" (ROCR parses major.minor.step); None when unset or malformed."""
    if not value:
        return None
    parts = value.strip().split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    major, minor, step = (int(p) for p in parts)
    if not 0 < major <= 63 or minor > 0xF or step > 0xF:
        return None
    return f"gfx{major}{minor:x}{step:x}"


def _rocm_problems(inp: Inputs) -> list[str]:
    rocm, out = inp.rocm, []
    if not rocm.kfd_exists:
        out.append("/dev/kfd does not exist (the amdgpu driver's compute interface is not available)")
    elif not rocm.kfd_openable:
        out.append(f"/dev/kfd cannot be opened ({rocm.kfd_error})")
        if rocm.in_render_group is False:
            out.append(f"user {rocm.user or '?'} is not in the render group")
    if not rocm.hip_libs:
        out.append("the HIP runtime (libamdhip64.so) is not installed")
    return out


def _rocm_fixes(inp: Inputs) -> list[str]:
    rocm, fixes = inp.rocm, []
    if not rocm.kfd_exists:
        fixes.append(
            "Make /dev/kfd available: load the amdgpu driver (sudo modprobe amdgpu); in a container "
            "pass --device /dev/kfd --device /dev/dri."
        )
    elif not rocm.kfd_openable and (rocm.in_render_group is False or rocm.kfd_error == "permission denied"):
        fixes.append(
            "Give your user access to the GPU: sudo usermod -aG render,video $USER "
            "(then log out and back in)."
        )
    if not rocm.hip_libs:
        fixes.append(
            "Install ROCm's HIP runtime: "
            + _install(
                inp.system,
                {
                    "debian": "rocm-hip-runtime  (AMD's repository: amdgpu-install --usecase=rocm)",
                    "fedora": "rocm-hip rocblas",
                    "arch": "rocm-hip-runtime rocblas",
                },
            )
        )
    return fixes


def _offer_override(inp: Inputs, gpu: GpuDevice, d: Decision, *, only_if_rocm_installed: bool) -> None:
    override = hsa_override_for(gpu.gfx_target)
    if override is None or (only_if_rocm_installed and not inp.rocm.libs_found):
        return
    value, target = override
    d.options.append(
        f"Unsupported option for ROCm: run with HSA_OVERRIDE_GFX_VERSION={value} so ROCm treats "
        f"{gpu.gfx_target} as {target}. The community uses it for this family; risk: AMD does not "
        f"support it, kernels built for {target} can crash or compute wrong results on {gpu.gfx_target}. "
        "llmchat never sets it for you: export HSA_OVERRIDE_GFX_VERSION="
        f"{value} and choose --device rocm yourself."
    )


# ------------------------------------------------------------------ what will run here


def _system_ready(inp: Inputs, gpu: GpuDevice | None, backend: str) -> tuple[bool, str, list[str]]:
    """(ready, why not, fixes) for the drivers/libraries a backend needs, independent of TVM."""
    if backend == "cpu":
        return True, "", []
    if gpu is None and backend != "metal":
        return False, "no GPU", []
    if backend == "metal":
        return inp.system.os_name == "Darwin", "not a Mac", []
    if backend == "rocm":
        return inp.rocm.usable, "ROCm is not usable", []
    if backend == "cuda":
        ok = inp.nvidia.driver_loaded or (gpu is not None and gpu.driver == "nvidia")
        return ok, "the NVIDIA driver is not loaded", []
    # vulkan
    assert gpu is not None
    problems, fixes = [], []
    if not inp.vulkan.checked:
        return True, "", []
    if not inp.vulkan.loader_found:
        problems.append("the Vulkan loader (libvulkan.so.1) is not installed")
    if not inp.vulkan.has_driver_for(gpu.vendor):
        problems.append(f"no Vulkan driver manifest (icd.d/*.json) for the {gpu.vendor.upper()} GPU")
    if problems:
        pkgs = {
            "amd": {
                "debian": "libvulkan1 mesa-vulkan-drivers",
                "fedora": "vulkan-loader mesa-vulkan-drivers",
                "arch": "vulkan-icd-loader vulkan-radeon",
            },
            "intel": {
                "debian": "libvulkan1 mesa-vulkan-drivers",
                "fedora": "vulkan-loader mesa-vulkan-drivers",
                "arch": "vulkan-icd-loader vulkan-intel",
            },
        }.get(gpu.vendor, {"debian": "libvulkan1", "fedora": "vulkan-loader", "arch": "vulkan-icd-loader"})
        fixes.append("Install the Vulkan loader and driver: " + _install(inp.system, pkgs))
    return not problems, "; ".join(problems), fixes


def _tvm_fix(backend: str, inp: Inputs) -> str:
    detail = next((t for t in inp.tvm.details if f" {backend} " in f" {t} "), "")
    if backend == "cuda":
        return (
            "Make TVM's CUDA runtime loadable"
            + (f" ({detail})" if detail else "")
            + ": install the CUDA runtime it was built against (CUDA 13: libcudart.so.13) and the "
            "NVIDIA driver, or add their directory to LD_LIBRARY_PATH."
        )
    if backend == "vulkan":
        return (
            "Vulkan runs through llmchat's WebGPU add-on"
            + (f" ({detail})" if detail else "")
            + ": it needs the `wgpu` package (`make run` installs it), the Vulkan loader and a C++ compiler "
            "to build the add-on once (g++, or `pip install ziglang` where there is none, e.g. SteamOS)."
        )
    if backend == "rocm":
        return (
            "ROCm runs through llmchat's own HIP runtime add-on"
            + (f" ({detail})" if detail else "")
            + ": it needs ROCm's HIP runtime (libamdhip64.so.7, .6 or .5; AMD's rocm-hip-runtime package), "
            "access to /dev/kfd (the render and video groups) and a C++ compiler to build the add-on once "
            "(g++, or `pip install ziglang`)."
        )
    what = {"metal": "Metal"}.get(backend, backend)
    # MLC's TVM wheels have such runtimes but replace apache-tvm, which llmchat needs: not a fix here
    return (
        f"llmchat has no {what} runtime of its own and PyPI's apache-tvm was built without one: "
        "it runs on the CPU here (--device cpu)."
    )


def _runnable(inp: Inputs, gpu: GpuDevice | None, d: Decision) -> None:
    why = d.backend_reasons
    tvm = inp.tvm
    for backend in [d.recommended_backend, *FALLBACKS[d.recommended_backend]]:
        ready, not_ready, fixes = _system_ready(inp, gpu, backend)
        tvm_ok = tvm.available is None or backend in tvm.available
        no_device = ready and tvm_ok and tvm.devices_exist.get(backend) is False
        if no_device:
            tvm_ok = False
        if ready and tvm_ok:
            d.backend = backend
            assert backend == "cpu" or gpu is not None or backend == "metal"
            index = 0 if backend in ("cpu", "metal") or gpu is None else _index(gpu, inp.gpus, backend)
            d.device = f"{backend}:{index}"
            if backend == "vulkan" and not inp.vulkan.checked:
                why.append("The Vulkan loader and drivers were not checked: the sysroot has no /usr.")
            if backend == d.recommended_backend:
                why.append(
                    f"{backend} will run here"
                    + (
                        " (TVM runtimes not checked)."
                        if tvm.available is None
                        else f": the installed TVM has the {backend} runtime."
                    )
                )
            else:
                why.append(f"Falling back to {backend}.")
            return
        if not ready:
            why.append(f"{backend} cannot run here: {not_ready}.")
            d.fixes.extend(f for f in fixes if f not in d.fixes)
        elif no_device:
            why.append(f"{backend} cannot run here: TVM's {backend} runtime finds no device.")
        else:
            why.append(f"{backend} cannot run here: the installed TVM has no usable {backend} runtime.")
            fix = _tvm_fix(backend, inp)
            if fix not in d.fixes:
                d.fixes.append(fix)
    # cpu is always ready, so the loop always ends in a return
