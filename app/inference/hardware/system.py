"""The machine around the GPU: memory (/proc/meminfo), DMI, OS release, Steam Deck detection."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from app.inference.hardware.amd_gpus import STEAM_DECK_PCI_IDS
from app.inference.hardware.sysfs import SysReader, parse_int

DMI = "/sys/class/dmi/id"
STEAM_DECK_PRODUCTS = {"jupiter": "LCD", "galileo": "OLED"}


@dataclass
class SystemInfo:
    os_name: str  # platform.system(): "Linux", "Darwin", "Windows"
    machine: str  # platform.machine(): "x86_64", "arm64"
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    sys_vendor: str | None = None
    product_name: str | None = None
    os_release: dict[str, str] = field(default_factory=dict)

    @property
    def os_pretty_name(self) -> str:
        return self.os_release.get("PRETTY_NAME") or self.os_release.get("NAME") or self.os_name

    @property
    def is_steamos(self) -> bool:
        return self.os_release.get("ID", "").lower() == "steamos"


def read_meminfo(reader: SysReader) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; None where unreadable."""
    values = reader.read_key_values("/proc/meminfo", sep=":")
    out: list[int | None] = []
    for key in ("MemTotal", "MemAvailable"):
        raw = values.get(key)
        if raw is None:
            if values:
                reader.problem("/proc/meminfo", f"no {key} line")
            out.append(None)
            continue
        parts = raw.split()
        number = parse_int(parts[0]) if parts else None
        if number is None:
            reader.problem("/proc/meminfo", f"{key} is not a number: {raw!r}")
            out.append(None)
            continue
        unit = parts[1].lower() if len(parts) > 1 else ""
        out.append(reader.check_size("/proc/meminfo", key, number * 1024 if unit == "kb" else number))
    return out[0], out[1]


def read_system(reader: SysReader, *, os_name: str | None = None, machine: str | None = None) -> SystemInfo:
    """Everything about the machine the decision needs besides the GPUs."""
    if os_name is None:
        os_name = "Linux" if not reader.is_real_root else platform.system()
    info = SystemInfo(os_name=os_name, machine=machine or platform.machine())
    if not reader.exists("/proc/meminfo"):
        if reader.is_real_root and os_name == "Linux":
            reader.problem("/proc/meminfo", "missing")
    else:
        info.mem_total_bytes, info.mem_available_bytes = read_meminfo(reader)
    if reader.is_real_root and info.mem_total_bytes is None:
        info.mem_total_bytes = _physical_memory()
    info.sys_vendor = reader.read_text(f"{DMI}/sys_vendor")
    info.product_name = reader.read_text(f"{DMI}/product_name")
    for rel in ("/etc/os-release", "/usr/lib/os-release", "/run/host/os-release"):
        if reader.exists(rel):
            info.os_release = reader.read_key_values(rel, sep="=")
            break
    return info


def steam_deck_model(info: SystemInfo, pci_ids: list[str]) -> str | None:
    """ "LCD" / "OLED" / "" (a Deck, model unknown) when this is a Steam Deck, else None."""
    vendor = (info.sys_vendor or "").strip().lower()
    product = (info.product_name or "").strip().lower()
    if vendor == "valve" and product in STEAM_DECK_PRODUCTS:
        return STEAM_DECK_PRODUCTS[product]
    ids = {p.lower() for p in pci_ids}
    if "1002:163f" in ids:
        return "LCD"
    if "1002:1435" in ids:
        return "OLED"
    if ids & STEAM_DECK_PCI_IDS or (vendor == "valve" and info.os_release.get("VARIANT_ID") == "steamdeck"):
        return ""
    return None


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
