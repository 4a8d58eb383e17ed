"""What can run here: Vulkan (loader + ICD manifests), ROCm (KFD, permissions, HIP, rocBLAS),
NVIDIA (driver, CUDA runtime), Metal, and which device runtimes the installed TVM carries.

Everything is read from files under the reader's root; nothing here loads a GPU driver. The only
exception is :func:`tvm_runtimes_live`, used when TVM is already imported in this process.
"""

from __future__ import annotations

import getpass
import importlib.util
import json
import mmap
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from app.inference.hardware.sysfs import SysReader

#: directories the dynamic loader searches on common distributions (Debian/Ubuntu, Fedora, Arch, SteamOS)
LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/lib64",
    "/usr/lib",
    "/lib",
    "/usr/local/lib",
    "/usr/lib/wsl/lib",
)

VULKAN_ICD_DIRS = (
    "/etc/vulkan/icd.d",
    "/etc/xdg/vulkan/icd.d",
    "/usr/local/share/vulkan/icd.d",
    "/usr/share/vulkan/icd.d",
)

GPU_BACKENDS = ("cuda", "rocm", "vulkan", "metal")

#: a gfx target inside a rocBLAS kernel file name: gfx1030, gfx1151, gfx942, gfx90a (not gfx10 or gfx1030x)
GFX_IN_FILE_NAME = re.compile(r"gfx(?:[0-9]{3,4}|[0-9]{2}[a-f])(?![0-9a-z])")


def _lib_dirs(reader: SysReader, extra: tuple[str, ...] = ()) -> list[str]:
    dirs = list(extra)
    if reader.is_real_root:
        dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    return dirs + list(LIB_DIRS)


def find_libs(reader: SysReader, stem: str, dirs: list[str]) -> list[str]:
    """System paths of files named ``stem`` or ``stem.*`` (e.g. "libvulkan.so") in ``dirs``."""
    found: list[str] = []
    for d in dirs:
        for name in reader.listdir(d):
            if name == stem or name.startswith(stem + "."):
                found.append(f"{d.rstrip('/')}/{name}")
    return found


# ---------------------------------------------------------------- Vulkan


@dataclass
class VulkanIcd:
    manifest: str
    library_path: str
    vendor: str  # "amd" | "nvidia" | "intel" | "software" | "other"
    api_version: str | None = None


@dataclass
class VulkanStatus:
    loader: list[str] = field(default_factory=list)  # libvulkan.so.1 files found
    icds: list[VulkanIcd] = field(default_factory=list)
    checked: bool = True  # False: the sysroot has no /usr or /etc (a partial snapshot), nothing to check

    @property
    def loader_found(self) -> bool:
        return bool(self.loader)

    def has_driver_for(self, vendor: str) -> bool:
        return any(icd.vendor == vendor for icd in self.icds)


def _icd_vendor(manifest: str, library: str) -> str:
    text = f"{Path(manifest).name} {Path(library).name}".lower()
    if "lvp" in text or "lavapipe" in text or "swiftshader" in text:
        return "software"
    if "radeon" in text or "radv" in text or "amd" in text:
        return "amd"
    if "nvidia" in text or "nouveau" in text or "nvk" in text:
        return "nvidia"
    if "intel" in text or "anv" in text or "hasvk" in text:
        return "intel"
    return "other"


def probe_vulkan(reader: SysReader) -> VulkanStatus:
    """The Vulkan loader library and the ICD manifests (drivers) it would find."""
    status = VulkanStatus(loader=find_libs(reader, "libvulkan.so.1", _lib_dirs(reader)))
    status.checked = reader.is_real_root or reader.is_dir("/usr") or reader.is_dir("/etc/vulkan")
    dirs = list(VULKAN_ICD_DIRS)
    files: list[str] = []
    if reader.is_real_root:
        home = os.path.expanduser("~")
        dirs = [
            os.environ.get("XDG_CONFIG_HOME", f"{home}/.config") + "/vulkan/icd.d",
            os.environ.get("XDG_DATA_HOME", f"{home}/.local/share") + "/vulkan/icd.d",
            *(d + "/vulkan/icd.d" for d in os.environ.get("XDG_DATA_DIRS", "").split(":") if d),
            *dirs,
        ]
        override = os.environ.get("VK_DRIVER_FILES") or os.environ.get("VK_ICD_FILENAMES")
        if override:
            files = [f for f in override.split(":") if f.endswith(".json")]
            dirs = [d for d in override.split(":") if d and not d.endswith(".json")]
    for d in dict.fromkeys(dirs):
        files += [f"{d}/{n}" for n in reader.listdir(d) if n.endswith(".json")]
    for rel in dict.fromkeys(files):
        text = reader.read_text(rel)
        if text is None:
            continue
        try:
            icd = json.loads(text).get("ICD", {})
            library = str(icd["library_path"])
        except (ValueError, KeyError, TypeError, AttributeError):
            reader.problem(rel, "not a Vulkan ICD manifest (JSON with ICD.library_path)")
            continue
        if not _icd_library_exists(reader, rel, library):
            reader.problem(rel, f"its driver library {library} is not installed")
            continue
        status.icds.append(VulkanIcd(rel, library, _icd_vendor(rel, library), icd.get("api_version")))
    return status


def _icd_library_exists(reader: SysReader, manifest: str, library: str) -> bool:
    """A manifest's ``library_path``: absolute, relative to the manifest, or a name the loader searches."""
    if library.startswith("/"):
        return reader.exists(library)
    if "/" in library:
        return reader.exists(f"{manifest.rsplit('/', 1)[0]}/{library}")
    if reader.is_real_root and library.encode() + b"\x00" in _ld_cache():
        return True
    return any(reader.exists(f"{d}/{library}") for d in _lib_dirs(reader))


# ---------------------------------------------------------------- ROCm


@dataclass
class RocmStatus:
    kfd_exists: bool = False
    kfd_openable: bool = False
    kfd_error: str = ""
    user: str = ""
    render_group_exists: bool = False
    in_render_group: bool | None = None  # None: could not tell
    hip_libs: list[str] = field(default_factory=list)
    hsa_libs: list[str] = field(default_factory=list)
    rocblas_libs: list[str] = field(default_factory=list)
    rocblas_gfx: set[str] = field(default_factory=set)  # gfx targets rocBLAS ships kernels for
    version: str | None = None
    rocm_dirs: list[str] = field(default_factory=list)

    @property
    def libs_found(self) -> bool:
        return bool(self.hip_libs)

    @property
    def usable(self) -> bool:
        """KFD can be opened and the HIP runtime is installed."""
        return self.kfd_openable and self.libs_found


def _groups(reader: SysReader) -> dict[str, tuple[int | None, list[str]]]:
    groups: dict[str, tuple[int | None, list[str]]] = {}
    text = reader.read_text("/etc/group")
    for line in (text or "").splitlines():
        parts = line.strip().split(":")
        if len(parts) >= 4 and parts[0]:
            gid = int(parts[2]) if parts[2].isdigit() else None
            groups[parts[0]] = (gid, [m for m in parts[3].split(",") if m])
    return groups


def _current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return ""


def probe_rocm(reader: SysReader) -> RocmStatus:
    status = RocmStatus(user=_current_user())
    status.kfd_exists = reader.exists("/dev/kfd")
    if status.kfd_exists:
        status.kfd_openable, status.kfd_error = reader.open_rw("/dev/kfd")
    else:
        status.kfd_error = "missing"
    render = _groups(reader).get("render")
    status.render_group_exists = render is not None
    if render is not None:
        gid, members = render
        if status.user and status.user in members:
            status.in_render_group = True
        elif reader.is_real_root and gid is not None:
            status.in_render_group = gid in os.getgroups() or gid == os.getgid()
        else:
            status.in_render_group = False
    roots: list[str] = []
    env_root = os.environ.get("ROCM_PATH") or os.environ.get("HIP_PATH")
    if env_root:
        roots.append(env_root)
    roots.append("/opt/rocm")
    roots += [f"/opt/{n}" for n in reader.listdir("/opt") if n.startswith("rocm-")]
    status.rocm_dirs = [r for r in dict.fromkeys(roots) if reader.is_dir(r)]
    rocm_lib_dirs = [f"{r}/{sub}" for r in status.rocm_dirs for sub in ("lib", "lib64")]
    dirs = _lib_dirs(reader, tuple(rocm_lib_dirs))
    status.hip_libs = find_libs(reader, "libamdhip64.so", dirs)
    status.hsa_libs = find_libs(reader, "libhsa-runtime64.so", dirs)
    status.rocblas_libs = find_libs(reader, "librocblas.so", dirs)
    for d in dirs:
        for lib_dir in _rocblas_kernel_dirs(reader, f"{d}/rocblas"):
            for name in reader.listdir(lib_dir):
                status.rocblas_gfx.update(GFX_IN_FILE_NAME.findall(name.lower()))
    for r in status.rocm_dirs:
        version = reader.read_text(f"{r}/.info/version")
        if version:
            status.version = version.splitlines()[0]
            break
    return status


def _rocblas_kernel_dirs(reader: SysReader, base: str) -> list[str]:
    """``<lib>/rocblas/library`` and ``<lib>/rocblas/<version>/library`` (Debian's layout)."""
    if not reader.is_dir(base):
        return []
    out = [f"{base}/library"] if reader.is_dir(f"{base}/library") else []
    out += [f"{base}/{v}/library" for v in reader.listdir(base) if reader.is_dir(f"{base}/{v}/library")]
    return out


# ---------------------------------------------------------------- NVIDIA / CUDA


@dataclass
class NvidiaStatus:
    driver_version: str | None = None  # from /proc/driver/nvidia/version
    libcuda: list[str] = field(default_factory=list)  # the driver's user-space library
    cudart: list[str] = field(default_factory=list)  # CUDA runtime libraries found

    @property
    def driver_loaded(self) -> bool:
        return self.driver_version is not None


def probe_nvidia(reader: SysReader) -> NvidiaStatus:
    status = NvidiaStatus()
    text = reader.read_text("/proc/driver/nvidia/version")
    if text:
        m = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]*)", text)
        status.driver_version = m.group(1) if m else text.splitlines()[0][:80]
    cuda_dirs = [
        f"/usr/local/{n}/{sub}"
        for n in reader.listdir("/usr/local")
        if n.startswith("cuda")
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib")
    ]
    dirs = _lib_dirs(reader, tuple(cuda_dirs))
    status.libcuda = find_libs(reader, "libcuda.so", dirs)
    status.cudart = find_libs(reader, "libcudart.so", dirs)
    return status


# ---------------------------------------------------------------- TVM


@dataclass
class TvmRuntimes:
    """Which device runtimes the installed TVM can use ("cpu" always), and how that was found."""

    available: set[str] | None  # None: not checked
    method: str  # "given" | "live" | "static" | "unchecked" | "missing"
    details: list[str] = field(default_factory=list)
    devices_exist: dict[str, bool] = field(default_factory=dict)  # live only
    webgpu_adapters: list[dict] = field(default_factory=list)  # what wgpu sees (live, add-on built)
    hip_devices: list[dict] = field(default_factory=list)  # what HIP sees (live, add-on built)


_LOADFILE_MARKERS = {
    "cuda": (b"loadfile_cubin", b"loadfile_ptx"),
    "rocm": (b"loadfile_hsaco",),
    "vulkan": (b"loadfile_vulkan",),
    "metal": (b"loadfile_metal",),
}
_RUNTIME_DEPS = re.compile(rb"lib(?:cudart|cuda|amdhip64|hsa-runtime64|vulkan)\.so(?:\.[0-9]+)*")


def tvm_runtimes_live(timeout_s: float = 3.0) -> TvmRuntimes:
    """Ask the TVM already imported in this process; every call is guarded, nothing can raise.

    A runtime counts when its ``device_api.<backend>`` is registered; only then is its device
    touched (``exist``), each with ``timeout_s`` to answer.
    """
    found = {"cpu"}
    result = TvmRuntimes(found, "live")
    try:
        import tvm
        import tvm_ffi
    except Exception as err:
        return TvmRuntimes(None, "missing", [f"TVM cannot be imported: {err}"])
    for backend in GPU_BACKENDS:
        if backend == "vulkan":
            _webgpu_live(result)
            continue
        if backend == "rocm" and _hip_live(result):
            continue
        try:
            registered = tvm_ffi.get_global_func(f"device_api.{backend}", allow_missing=True) is not None
        except Exception:
            registered = False
        if not registered:
            result.details.append(f"TVM has no {backend} runtime loaded")
            continue
        found.add(backend)
        exists, problem = _device_exists(tvm, backend, timeout_s)
        result.devices_exist[backend] = exists
        if problem:
            result.details.append(problem)
    return result


def _webgpu_static() -> tuple[bool, str]:
    """Whether llmchat's Vulkan route (TVM's WGSL + wgpu-native + llmchat's add-on) can run,
    judged without loading anything: the ``wgpu`` package and a built add-on or a compiler."""
    try:
        from app.inference.backends.webgpu import addon, vulkan_loader_present
    except ImportError as err:  # a partial install
        return False, f"llmchat's vulkan runtime cannot be imported ({err})"
    if addon.wgpu_library() is None:
        return False, "the vulkan runtime needs the `wgpu` package (wgpu-native), which is not installed"
    if not vulkan_loader_present():
        return False, "the vulkan runtime needs the Vulkan loader (libvulkan.so.1), which is not installed"
    if not addon.ADDON.buildable():
        return False, "the vulkan runtime's add-on is not built and no C++ compiler was found to build it"
    return True, ""


def _webgpu_live(result: TvmRuntimes) -> None:
    """The Vulkan route in this process: the adapters wgpu sees once the add-on is built."""
    ok, detail = _webgpu_static()
    if not ok:
        result.details.append(detail)
        return
    assert result.available is not None
    result.available.add("vulkan")
    try:
        from app.inference.backends import webgpu
        from app.inference.backends.webgpu import addon

        if not (addon.loaded() or addon.library_path(None).is_file()):
            result.details.append("the vulkan runtime's add-on is built on first use (no adapters listed)")
            return
        found = webgpu.adapters()
    except Exception as err:  # never let the probe fail on a driver
        result.details.append(f"the vulkan runtime could not list adapters: {err}")
        result.devices_exist["vulkan"] = False
        return
    result.webgpu_adapters = [a.as_dict() for a in found]
    result.devices_exist["vulkan"] = any(a.device_type != "CPU" for a in found)
    if not found:
        result.details.append("wgpu found no Vulkan adapter")


def _hip_static() -> tuple[bool, str]:
    """Whether llmchat's ROCm runtime (its HIP add-on) can be had, judged without loading it:
    a built add-on or a compiler to build it.  HIP itself is the system's part (probe_rocm)."""
    try:
        from app.inference.backends.hip import addon
    except ImportError as err:  # a partial install
        return False, f"llmchat's rocm runtime cannot be imported ({err})"
    if not addon.ADDON.buildable():
        return False, "the rocm runtime's add-on is not built and no C++ compiler was found to build it"
    return True, ""


def _hip_live(result: TvmRuntimes) -> bool:
    """The ROCm route in this process: llmchat's HIP runtime and the GPUs HIP finds.  False when
    another runtime already serves ``device_api.rocm`` (an MLC wheel): the caller asks TVM."""
    try:
        import tvm_ffi

        from app.inference.backends.hip import addon
    except Exception:
        return False
    if addon.mode() == addon.TWIN:
        result.details.append("llmchat's GPU runtime is in CUDA twin mode (LLMCHAT_GPU_RUNTIME=twin)")
        return True
    if not addon.loaded() and tvm_ffi.get_global_func("device_api.rocm", allow_missing=True) is not None:
        return False
    ok, detail = _hip_static()
    if not ok:
        result.details.append(detail)
        return True
    assert result.available is not None
    result.available.add("rocm")
    try:
        if not (addon.loaded() or addon.library_path(None).is_file()):
            result.details.append("the rocm runtime's add-on is built on first use (devices not listed)")
            return True
        st = addon.status()
    except Exception as err:  # never let the probe fail on a driver
        result.details.append(f"the rocm runtime could not list devices: {err}")
        result.devices_exist["rocm"] = False
        return True
    result.hip_devices = list(st.get("devices", []))
    result.devices_exist["rocm"] = bool(result.hip_devices)
    if not st.get("driver_found"):
        result.details.append(f"the rocm runtime: {st.get('error')}")
    elif not result.hip_devices:
        result.details.append(f"the rocm runtime: HIP found no GPU ({st.get('devices_error') or 'none'})")
    return True


def _device_exists(tvm, backend: str, timeout_s: float) -> tuple[bool, str]:
    """``tvm.<backend>(0).exist`` in a daemon thread: a driver that hangs cannot hang the app."""
    outcome: list[tuple[bool, str]] = []

    def ask() -> None:
        try:
            outcome.append((bool(tvm.runtime.device(backend, 0).exist), ""))
        except Exception as err:
            outcome.append((False, f"tvm.{backend}(0).exist failed: {err}"))

    worker = threading.Thread(target=ask, name=f"tvm-{backend}-exist", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return False, f"tvm.{backend}(0).exist did not answer within {timeout_s:g} s"
    return outcome[0]


def tvm_runtimes_static(reader: SysReader | None = None, package_dir: Path | None = None) -> TvmRuntimes:
    """Read the installed TVM package's runtime libraries without importing TVM (fast).

    0.27 wheels ship one sidecar per device runtime (``libtvm_runtime_cuda.so`` …) that loads only
    when its dependencies (``libcudart``/``libcuda``, ``libamdhip64``, ``libvulkan``) resolve; older
    monolithic builds (MLC's wheels) register ``runtime.module.loadfile_<kind>`` in libtvm_runtime.
    """
    pkg = package_dir or _tvm_package_dir()
    if pkg is None:
        return TvmRuntimes(None, "missing", ["the tvm package is not installed"])
    lib_dirs = [p for p in (pkg / "lib", pkg) if p.is_dir()]
    found = {"cpu"}
    result = TvmRuntimes(found, "static")
    reader = reader or SysReader("/")
    cache = _ld_cache()
    for backend in GPU_BACKENDS:
        if backend == "vulkan" and package_dir is None:  # the installed TVM: llmchat's add-on drives it
            ok, detail = _webgpu_static()
            if ok:
                found.add(backend)
                continue
            result.details.append(detail)
        if backend == "rocm" and package_dir is None:  # llmchat's HIP runtime drives it
            ok, detail = _hip_static()
            if ok:
                found.add(backend)
                continue
            result.details.append(detail)
        sidecars = [d / f"libtvm_runtime_{backend}{ext}" for d in lib_dirs for ext in (".so", ".dylib")]
        sidecar = next((p for p in sidecars if p.is_file()), None)
        if sidecar is not None:
            missing = [dep for dep in _needed(sidecar) if not _resolvable(dep, sidecar.parent, reader, cache)]
            if missing:
                result.details.append(
                    f"TVM's {backend} runtime ({sidecar.name}) cannot load: {', '.join(missing)} not found"
                )
            else:
                found.add(backend)
            continue
        monolithic = [d / n for d in lib_dirs for n in ("libtvm_runtime.so", "libtvm_runtime.dylib")]
        if any(_contains(p, _LOADFILE_MARKERS[backend]) for p in monolithic if p.is_file()):
            found.add(backend)
        elif not (backend in ("vulkan", "rocm") and package_dir is None):
            result.details.append(f"the installed TVM has no {backend} runtime")
    return result


def _tvm_package_dir() -> Path | None:
    """Where the tvm package is installed, found without importing it."""
    try:
        spec = importlib.util.find_spec("tvm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _needed(lib: Path) -> list[str]:
    try:
        with open(lib, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return sorted({m.group().decode() for m in _RUNTIME_DEPS.finditer(data)})
    except (OSError, ValueError):
        return []


def _contains(path: Path, markers: tuple[bytes, ...]) -> bool:
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(m) >= 0 for m in markers)
    except (OSError, ValueError):
        return False


def _ld_cache() -> bytes:
    try:
        with open("/etc/ld.so.cache", "rb") as fh:
            return fh.read(8 << 20)
    except OSError:
        return b""


def _resolvable(dep: str, origin: Path, reader: SysReader, cache: bytes) -> bool:
    if (origin / dep).exists() or dep.encode() + b"\x00" in cache:
        return True
    return any(reader.exists(f"{d}/{dep}") for d in _lib_dirs(reader))


def tvm_runtimes_for(reader: SysReader, given: set[str] | None) -> TvmRuntimes:
    """The TVM runtime set the decision uses: given > $LLMCHAT_TVM_RUNTIMES > live > static."""
    if given is not None:
        return TvmRuntimes({"cpu", *given}, "given")
    env = os.environ.get("LLMCHAT_TVM_RUNTIMES")
    if env is not None:
        names = {n.strip().lower() for n in env.split(",") if n.strip()}
        return TvmRuntimes({"cpu", *names}, "given", ["from $LLMCHAT_TVM_RUNTIMES"])
    if not reader.is_real_root:
        return TvmRuntimes(None, "unchecked", ["TVM runtimes are not checked when probing a sysroot"])
    if "tvm" in sys.modules:
        return tvm_runtimes_live()
    return tvm_runtimes_static(reader)
