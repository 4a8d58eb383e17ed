"""PCI ids → GPU model for every vendor, plus libdrm's ``amdgpu.ids`` for names the tables lack.

NVIDIA and Intel entries: ids from pci.ids (pciutils), bandwidth from the vendors' spec sheets
(decimal GB/s), memory in GiB as the driver reports it (data-centre parts report a little less than
the marketed size, e.g. an H200 "141 GB" shows 143,771 MiB). Unknown ids still work: the name
falls back to ``amdgpu.ids`` or to a generic "AMD GPU 1002:xxxx", and bandwidth is ``None``.
"""

from __future__ import annotations

from app.inference.hardware.amd_gpus import GpuModel, lookup_amd
from app.inference.hardware.sysfs import SysReader

VENDORS = {"1002": "amd", "10de": "nvidia", "8086": "intel", "106b": "apple"}

AMDGPU_IDS_PATHS = (
    "/usr/share/libdrm/amdgpu.ids",
    "/usr/local/share/libdrm/amdgpu.ids",
    "/opt/amdgpu/share/libdrm/amdgpu.ids",
)


def _nv(name: str, bw: float | None, vram: float | None) -> GpuModel:
    return GpuModel(name, None, "discrete", bw, vram)


NVIDIA_GPUS: dict[str, GpuModel] = {
    # data centre
    "2335": _nv("H200 SXM 141GB", 4800, 140.4),
    "233b": _nv("H200 NVL", 4800, 140.4),
    "2330": _nv("H100 SXM5 80GB", 3350, 79.6),
    "2331": _nv("H100 PCIe 80GB", 2000, 79.6),
    "2321": _nv("H100 NVL 94GB", 3900, 93.6),
    "2324": _nv("H800", 3350, 79.6),
    "20b0": _nv("A100 SXM4 40GB", 1555, 40),
    "20b2": _nv("A100 SXM4 80GB", 2039, 80),
    "20f1": _nv("A100 PCIe 40GB", 1555, 40),
    "20b5": _nv("A100 PCIe 80GB", 1935, 80),
    "26b9": _nv("L40S", 864, 45),
    "26b5": _nv("L40", 864, 45),
    "27b8": _nv("L4", 300, 22.5),
    "2236": _nv("A10", 600, 24),
    "1eb8": _nv("Tesla T4", 320, 16),
    "1db1": _nv("Tesla V100 SXM2 16GB", 900, 16),
    "1db5": _nv("Tesla V100 SXM2 32GB", 900, 32),
    "2230": _nv("RTX A6000", 768, 48),
    "26b1": _nv("RTX 6000 Ada Generation", 960, 48),
    # GeForce RTX 50
    "2b85": _nv("GeForce RTX 5090", 1792, 32),
    "2c02": _nv("GeForce RTX 5080", 960, 16),
    "2c05": _nv("GeForce RTX 5070 Ti", 896, 16),
    "2f04": _nv("GeForce RTX 5070", 672, 12),
    # GeForce RTX 40
    "2684": _nv("GeForce RTX 4090", 1008, 24),
    "2704": _nv("GeForce RTX 4080", 716.8, 16),
    "2702": _nv("GeForce RTX 4080 SUPER", 736, 16),
    "2705": _nv("GeForce RTX 4070 Ti SUPER", 672, 16),
    "2782": _nv("GeForce RTX 4070 Ti", 504, 12),
    "2783": _nv("GeForce RTX 4070 SUPER", 504, 12),
    "2786": _nv("GeForce RTX 4070", 504, 12),
    "2803": _nv("GeForce RTX 4060 Ti", 288, 8),
    "2805": _nv("GeForce RTX 4060 Ti 16GB", 288, 16),
    "2882": _nv("GeForce RTX 4060", 272, 8),
    # GeForce RTX 30
    "2203": _nv("GeForce RTX 3090 Ti", 1008, 24),
    "2204": _nv("GeForce RTX 3090", 936, 24),
    "2208": _nv("GeForce RTX 3080 Ti", 912, 12),
    "220a": _nv("GeForce RTX 3080 12GB", 912, 12),
    "2206": _nv("GeForce RTX 3080", 760, 10),
    "2482": _nv("GeForce RTX 3070 Ti", 608, 8),
    "2484": _nv("GeForce RTX 3070", 448, 8),
    "2486": _nv("GeForce RTX 3060 Ti", 448, 8),
    "2489": _nv("GeForce RTX 3060 Ti", 448, 8),
    "2503": _nv("GeForce RTX 3060", 360, 12),
    "2504": _nv("GeForce RTX 3060", 360, 12),
}

INTEL_GPUS: dict[str, GpuModel] = {
    "56a0": _nv("Arc A770", 560, 16),
    "56a1": _nv("Arc A750", 512, 8),
    "56a5": _nv("Arc A380", 186, 6),
    "56a6": _nv("Arc A310", 124, 4),
    "5690": _nv("Arc A770M", 512, 16),
    "5691": _nv("Arc A730M", 336, 12),
    "5692": _nv("Arc A550M", 224, 8),
    "5693": _nv("Arc A370M", 112, 4),
    "5694": _nv("Arc A350M", 112, 4),
    "e20b": _nv("Arc B580", 456, 12),
    "e20c": _nv("Arc B570", 380, 10),
    "e211": _nv("Arc Pro B60", 456, 24),
    "e212": _nv("Arc Pro B50", 224, 16),
}


def parse_amdgpu_ids(text: str) -> dict[tuple[str, str], str]:
    """libdrm ``amdgpu.ids`` text → {(device, revision): name}, lowercase hex keys."""
    table: dict[tuple[str, str], str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) != 3 or not parts[2]:
            continue  # the version line ("1.0.0") and anything malformed
        table.setdefault((parts[0].lower(), parts[1].lower()), parts[2])
    return table


def load_amdgpu_ids(reader: SysReader) -> dict[tuple[str, str], str]:
    """The first readable ``amdgpu.ids`` under the reader's root; {} when none is installed."""
    for rel in AMDGPU_IDS_PATHS:
        if reader.exists(rel):
            text = reader.read_text(rel)
            if text:
                return parse_amdgpu_ids(text)
    return {}


def amdgpu_ids_name(ids: dict[tuple[str, str], str], device: str, revision: str | None) -> str | None:
    """The libdrm name for device+revision (any revision of the device as a last resort)."""
    if revision:
        hit = ids.get((device, revision))
        if hit:
            return hit
    for (dev, _rev), name in ids.items():
        if dev == device:
            return name
    return None


def identify(
    vendor_id: str, device_id: str, revision: str | None, amdgpu_ids: dict[tuple[str, str], str] | None = None
) -> tuple[str, GpuModel | None]:
    """(display name, table model or None) for a PCI device; ids as 4-digit lowercase hex."""
    vendor = VENDORS.get(vendor_id, "other")
    model: GpuModel | None = None
    if vendor == "amd":
        model = lookup_amd(device_id, revision)
        ids = amdgpu_ids or {}
        exact = ids.get((device_id, revision)) if revision else None
        if model is not None:
            ambiguous = " / " in model.name
            return (exact if exact and ambiguous else "AMD " + model.name), model
        name = exact or amdgpu_ids_name(ids, device_id, revision)
        return (name or f"AMD GPU 1002:{device_id}"), None
    if vendor == "nvidia":
        model = NVIDIA_GPUS.get(device_id)
        return ("NVIDIA " + model.name if model else f"NVIDIA GPU 10de:{device_id}"), model
    if vendor == "intel":
        model = INTEL_GPUS.get(device_id)
        return ("Intel " + model.name if model else f"Intel GPU 8086:{device_id}"), model
    return f"GPU {vendor_id}:{device_id}", None
