"""GPU enumeration from Linux sysfs: DRM devices joined with the ROCm KFD topology."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from app.inference.hardware.amd_gpus import APU_GFX_TARGETS, gfx_from_kfd_version
from app.inference.hardware.pci_ids import VENDORS, identify, load_amdgpu_ids
from app.inference.hardware.sysfs import SysReader, parse_int

DRM = "/sys/class/drm"
PCI_DEVICES = "/sys/bus/pci/devices"
KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
GIB = 1 << 30

#: PCI vendors of emulated display adapters (QEMU, VirtIO, VMware, VirtualBox): not compute GPUs
_VIRTUAL_VENDORS = {"1234", "1af4", "15ad", "80ee", "1b36"}


@dataclass
class GpuDevice:
    """One GPU as the probe sees it; sizes in bytes, None when unknown."""

    vendor: str  # "amd" | "nvidia" | "intel" | "apple" | "other"
    name: str
    pci_id: str  # "1002:73bf"
    gfx_target: str | None = None  # AMD only, e.g. "gfx1030"
    kind: str = "discrete"  # "discrete" | "integrated"
    vram_bytes: int | None = None
    gtt_bytes: int | None = None
    bandwidth_bytes_per_s: int | None = None
    driver: str | None = None
    revision: str | None = None
    pci_slot: str | None = None
    card: str | None = None  # "card0"
    render_minor: int | None = None  # /dev/dri/renderD<minor>
    kfd_node: int | None = None
    kfd_memory_bytes: int | None = None  # what KFD reports as the GPU's local memory
    compute_units: int | None = None
    vram_source: str = "unknown"  # "sysfs" | "table" | "unknown"
    gfx_source: str = "unknown"  # "kfd" | "table" | "unknown"
    notes: list[str] = field(default_factory=list)

    @property
    def is_integrated(self) -> bool:
        return self.kind == "integrated"


def _hex4(value: str | None) -> str | None:
    if not value:
        return None
    number = parse_int(value if value.lower().startswith("0x") else "0x" + value)
    return None if number is None else f"{number:04x}"


def _pci_ids(reader: SysReader, dev_dir: str) -> tuple[str | None, str | None, str | None, dict[str, str]]:
    """(vendor, device, revision, uevent) as lowercase hex from uevent, falling back to the id files."""
    uevent = reader.read_key_values(f"{dev_dir}/uevent", sep="=")
    vendor = device = None
    pci_id = uevent.get("PCI_ID", "")
    if re.fullmatch(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}", pci_id):
        vendor, device = (part.lower() for part in pci_id.split(":"))
    elif pci_id:
        reader.problem(f"{dev_dir}/uevent", f"PCI_ID is not vendor:device: {pci_id!r}")
    if vendor is None and reader.exists(f"{dev_dir}/vendor"):
        vendor = _hex4(reader.read_text(f"{dev_dir}/vendor"))
    if device is None and reader.exists(f"{dev_dir}/device"):
        device = _hex4(reader.read_text(f"{dev_dir}/device"))
    revision = None
    if reader.exists(f"{dev_dir}/revision"):
        rev = reader.read_int(f"{dev_dir}/revision")
        revision = None if rev is None else f"{rev:02x}"
    return vendor, device, revision, uevent


@dataclass
class KfdNode:
    node: int
    gfx: str | None
    vendor_id: int | None
    device_id: int | None
    render_minor: int | None
    memory_bytes: int | None
    compute_units: int | None


def read_kfd_nodes(reader: SysReader) -> list[KfdNode]:
    """The GPU nodes of the KFD topology (CPU nodes have no SIMDs and no gfx version)."""
    nodes: list[KfdNode] = []
    for entry in reader.listdir(KFD_NODES):
        if not (entry.isascii() and entry.isdigit()):  # "²" or "٣" are digits to str.isdigit
            continue
        base = f"{KFD_NODES}/{entry}"
        props = reader.read_key_values(f"{base}/properties")
        if not props:
            if reader.exists(f"{base}/properties"):
                reader.problem(f"{base}/properties", "no key/value lines")
            continue

        def num(key: str, props: dict[str, str] = props, base: str = base) -> int | None:
            if key not in props:
                return None
            value = parse_int(props[key])
            if value is None:
                reader.problem(f"{base}/properties", f"{key} is not a number: {props[key]!r}")
            return value

        simd = num("simd_count")
        version = num("gfx_target_version")
        if not simd and not version:
            continue  # a CPU node
        memory = 0
        for bank in reader.listdir(f"{base}/mem_banks"):
            bank_props = reader.read_key_values(f"{base}/mem_banks/{bank}/properties")
            heap = parse_int(bank_props.get("heap_type", ""))
            size = reader.check_size(
                f"{base}/mem_banks/{bank}/properties",
                "size_in_bytes",
                parse_int(bank_props.get("size_in_bytes", "")),
            )
            if heap in (1, 2) and size:  # frame buffer public / private
                memory += size
        per_cu = num("simd_per_cu")
        nodes.append(
            KfdNode(
                node=int(entry),
                gfx=gfx_from_kfd_version(version),
                vendor_id=num("vendor_id"),
                device_id=num("device_id"),
                render_minor=num("drm_render_minor"),
                memory_bytes=memory or None,
                compute_units=(simd // per_cu) if simd and per_cu else None,
            )
        )
    return nodes


def _render_minor_of(reader: SysReader, slot: str | None) -> int | None:
    """The renderD minor whose device has PCI slot ``slot``."""
    if not slot:
        return None
    for entry in reader.listdir(DRM):
        m = re.fullmatch(r"renderD(\d+)", entry)
        if m:
            uevent = reader.read_key_values(f"{DRM}/{entry}/device/uevent", sep="=")
            if uevent.get("PCI_SLOT_NAME", "").lower() == slot.lower():
                return int(m.group(1))
    return None


def enumerate_gpus(reader: SysReader) -> list[GpuDevice]:
    """Every PCI GPU under /sys/class/drm, plus display-class PCI devices without a DRM node (one entry
    per PCI device), AMD ones joined with KFD."""
    amdgpu_ids: dict[tuple[str, str], str] | None = None
    kfd = read_kfd_nodes(reader)
    used_kfd: set[int] = set()
    gpus: list[GpuDevice] = []
    seen: set[str] = set()
    entries = [e for e in reader.listdir(DRM) if re.fullmatch(r"card\d+|renderD\d+", e)]
    entries.sort(key=lambda e: (not e.startswith("card"), int(re.sub(r"\D", "", e))))
    candidates = [(f"{DRM}/{entry}/device", entry) for entry in entries]
    # GPUs without a DRM node (NVIDIA compute GPUs without nvidia-drm, servers, VMs): display-class
    # PCI functions (class 0x03xxxx) under /sys/bus/pci/devices; duplicates are dropped by slot below
    for slot in sorted(reader.listdir(PCI_DEVICES)):
        pci_class = (reader.read_text(f"{PCI_DEVICES}/{slot}/class") or "").strip().lower()
        if pci_class.startswith(("0x03", "03")):
            candidates.append((f"{PCI_DEVICES}/{slot}", ""))
    for dev_dir, entry in candidates:
        if not reader.is_dir(dev_dir):
            continue
        vendor_id, device_id, revision, uevent = _pci_ids(reader, dev_dir)
        if not vendor_id or not device_id:
            # platform devices (simpledrm, efifb) have no PCI ids: not a GPU, nothing to report
            if "PCI_ID" in uevent or "PCI_SLOT_NAME" in uevent or reader.exists(f"{dev_dir}/vendor"):
                reader.problem(dev_dir, "no readable PCI vendor/device id; device skipped")
            continue
        if vendor_id in _VIRTUAL_VENDORS:
            continue
        slot = uevent.get("PCI_SLOT_NAME") or os.path.basename(os.path.realpath(reader.path(dev_dir)))
        if slot in seen:
            continue
        seen.add(slot)
        vendor = VENDORS.get(vendor_id, "other")
        if vendor == "amd" and amdgpu_ids is None:
            amdgpu_ids = load_amdgpu_ids(reader)
        name, model = identify(vendor_id, device_id, revision, amdgpu_ids)
        gpu = GpuDevice(
            vendor=vendor,
            name=name,
            pci_id=f"{vendor_id}:{device_id}",
            driver=uevent.get("DRIVER"),
            revision=revision,
            pci_slot=uevent.get("PCI_SLOT_NAME"),
            card=entry if entry.startswith("card") else None,
        )
        if model is not None:
            gpu.bandwidth_bytes_per_s = model.bandwidth_bytes_per_s
            if model.note:
                gpu.notes.append(model.note)
        if vendor == "amd":
            _fill_amd(reader, gpu, dev_dir, model, kfd, used_kfd)
        else:
            gpu.kind = model.kind if model else ("integrated" if vendor == "intel" else "discrete")
            if model and model.vram_bytes and gpu.kind == "discrete":
                gpu.vram_bytes, gpu.vram_source = model.vram_bytes, "table"
        gpus.append(gpu)
    return gpus


def _fill_amd(reader, gpu: GpuDevice, dev_dir: str, model, kfd: list[KfdNode], used: set[int]) -> None:
    gpu.vram_bytes = (
        reader.read_size(f"{dev_dir}/mem_info_vram_total")
        if reader.exists(f"{dev_dir}/mem_info_vram_total")
        else None
    )
    if gpu.vram_bytes is not None:
        gpu.vram_source = "sysfs"
    if reader.exists(f"{dev_dir}/mem_info_gtt_total"):
        gpu.gtt_bytes = reader.read_size(f"{dev_dir}/mem_info_gtt_total")
    gpu.render_minor = _render_minor_of(reader, gpu.pci_slot)
    node = _match_kfd(gpu, kfd, used)
    if node is not None:
        used.add(node.node)
        gpu.kfd_node, gpu.kfd_memory_bytes, gpu.compute_units = (
            node.node,
            node.memory_bytes,
            node.compute_units,
        )
        if gpu.render_minor is None:
            gpu.render_minor = node.render_minor
        if node.gfx:
            gpu.gfx_target, gpu.gfx_source = node.gfx, "kfd"
    if gpu.gfx_target is None and model is not None and model.gfx:
        gpu.gfx_target, gpu.gfx_source = model.gfx, "table"
    # discrete or integrated: the table, then mem_info_vram_vendor/board_info (APUs have neither:
    # ollama's test for a known dGPU), then the gfx target, then ollama's size heuristic
    dev_files = ("mem_info_vram_vendor", "board_info")
    has_vram_vendor = any(reader.exists(f"{dev_dir}/{name}") for name in dev_files)
    if model is not None:
        gpu.kind = model.kind
    elif has_vram_vendor:
        gpu.kind = "discrete"
    elif gpu.gfx_target in APU_GFX_TARGETS or (
        gpu.vram_bytes is not None
        and gpu.gtt_bytes is not None
        and gpu.vram_bytes <= 4 * GIB
        and gpu.gtt_bytes >= 8 * GIB
        and gpu.gtt_bytes >= 4 * gpu.vram_bytes
    ):
        gpu.kind = "integrated"
    else:
        gpu.kind = "discrete"
    if gpu.vram_bytes is None and model is not None and model.vram_bytes:
        gpu.vram_bytes, gpu.vram_source = model.vram_bytes, "table"
        what = "typical VRAM" if gpu.kind == "discrete" else "default carve-out"
        gpu.notes.append(f"mem_info_vram_total not readable: using the {what} of this model")


def _match_kfd(gpu: GpuDevice, kfd: list[KfdNode], used: set[int]) -> KfdNode | None:
    free = [n for n in kfd if n.node not in used]
    if gpu.render_minor is not None:
        for node in free:
            if node.render_minor == gpu.render_minor:
                return node
    vendor, device = (int(x, 16) for x in gpu.pci_id.split(":"))
    for node in free:
        if node.vendor_id == vendor and node.device_id == device:
            return node
    return None
