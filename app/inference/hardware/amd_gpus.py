"""AMD GPUs: PCI device id → marketing name, gfx target, discrete/integrated, memory bandwidth.

So a GPU without KFD files (ROCm not loaded) still gets a gfx target, and ``bench`` gets the memory
bandwidth for its roofline figure. Ids and names: pci.ids (pciutils) and libdrm's ``amdgpu.ids``;
gfx targets: the kernel's ``kfd_device.c`` table and LLVM's AMDGPUUsage processor list; bandwidth:
vendor spec sheets (bus width × data rate). For APUs the bandwidth is that of the system memory the
part is usually paired with (noted per entry); the real figure depends on the machine's RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1_000_000_000
GIB = 1 << 30


@dataclass(frozen=True)
class GpuModel:
    """What the table knows about one PCI device id (optionally one revision of it)."""

    name: str
    gfx: str | None
    kind: str  # "discrete" | "integrated"
    bandwidth_gb_s: float | None  # decimal GB/s
    vram_gib: float | None = None  # typical VRAM (discrete) or default carve-out (APU)
    codename: str = ""
    note: str = ""

    @property
    def bandwidth_bytes_per_s(self) -> int | None:
        return None if self.bandwidth_gb_s is None else int(self.bandwidth_gb_s * GB)

    @property
    def vram_bytes(self) -> int | None:
        return None if self.vram_gib is None else int(self.vram_gib * GIB)


def _d(name: str, gfx: str, bw: float | None, vram: float | None, codename: str) -> GpuModel:
    return GpuModel(name, gfx, "discrete", bw, vram, codename)


def _i(name: str, gfx: str, bw: float | None, codename: str, note: str, carve_out: float | None = None):
    return GpuModel(name, gfx, "integrated", bw, carve_out, codename, note)


_DDR5_5600 = "bandwidth assumes dual-channel DDR5-5600 (89.6 GB/s); LPDDR5X-7500 machines reach 120 GB/s"
_LPDDR5X_7500 = "bandwidth assumes 128-bit LPDDR5X-7500 (120 GB/s); DDR5-5600 machines reach 89.6 GB/s"
_DDR5_DESKTOP = "bandwidth assumes dual-channel DDR5-5200 (83.2 GB/s)"

#: device id (lowercase hex, 4 digits) → model; revision-specific entries in AMD_BY_REVISION win
AMD_GPUS: dict[str, GpuModel] = {
    # --- RDNA2 desktop / laptop (Navi 21/22/23/24) ---
    "73a5": _d("Radeon RX 6950 XT", "gfx1030", 576, 16, "Navi 21"),
    "73af": _d("Radeon RX 6900 XT", "gfx1030", 512, 16, "Navi 21"),
    "73bf": _d("Radeon RX 6800 / 6800 XT / 6900 XT", "gfx1030", 512, 16, "Navi 21"),
    "73a1": _d("Radeon Pro V620", "gfx1030", 512, 32, "Navi 21"),
    "73a3": _d("Radeon PRO W6800", "gfx1030", 512, 32, "Navi 21"),
    "73ae": _d("Radeon Pro V620 MxGPU", "gfx1030", 512, 32, "Navi 21"),
    "73df": _d("Radeon RX 6700 / 6700 XT / 6750 XT / 6800M", "gfx1031", 384, 12, "Navi 22"),
    "73e0": _d("Radeon RX 6600M", "gfx1032", 224, 8, "Navi 23"),
    "73e1": _d("Radeon PRO W6600M", "gfx1032", 224, 8, "Navi 23"),
    "73e3": _d("Radeon PRO W6600", "gfx1032", 224, 8, "Navi 23"),
    "73ef": _d("Radeon RX 6650 XT / 6700S / 6800S", "gfx1032", 280, 8, "Navi 23"),
    "73ff": _d("Radeon RX 6600 / 6600 XT / 6600M", "gfx1032", 224, 8, "Navi 23"),
    "743f": _d("Radeon RX 6400 / 6500 XT / 6500M", "gfx1034", 144, 4, "Navi 24"),
    "7421": _d("Radeon PRO W6500M", "gfx1034", 144, 4, "Navi 24"),
    "7422": _d("Radeon PRO W6400", "gfx1034", 128, 4, "Navi 24"),
    "7423": _d("Radeon PRO W6300", "gfx1034", 64, 2, "Navi 24"),
    "7424": _d("Radeon RX 6300", "gfx1034", 64, 2, "Navi 24"),
    # --- RDNA3 desktop / laptop (Navi 31/32/33) ---
    "744c": _d("Radeon RX 7900 XT / 7900 XTX / 7900 GRE", "gfx1100", 960, 24, "Navi 31"),
    "7448": _d("Radeon PRO W7900", "gfx1100", 864, 48, "Navi 31"),
    "7449": _d("Radeon PRO W7800 48GB", "gfx1100", 864, 48, "Navi 31"),
    "744a": _d("Radeon PRO W7900 Dual Slot", "gfx1100", 864, 48, "Navi 31"),
    "745e": _d("Radeon PRO W7800", "gfx1100", 576, 32, "Navi 31"),
    "7460": _d("Radeon Pro V710", "gfx1101", 448, 28, "Navi 32"),
    "7470": _d("Radeon PRO W7700", "gfx1101", 576, 16, "Navi 32"),
    "747e": _d("Radeon RX 7700 XT / 7800 XT", "gfx1101", 624, 16, "Navi 32"),
    "7480": _d("Radeon RX 7600 / 7600 XT / 7600S / 7700S", "gfx1102", 288, 8, "Navi 33"),
    "7481": _d("Steam Machine GPU", "gfx1102", None, 8, "Navi 33"),
    "7483": _d("Radeon RX 7600M / 7600M XT", "gfx1102", 256, 8, "Navi 33"),
    "7489": _d("Radeon PRO W7500", "gfx1102", 172.8, 8, "Navi 33"),
    "7499": _d("Radeon RX 7400 / 7300 / PRO W7400", "gfx1102", None, 8, "Navi 33"),
    # --- RDNA4 (Navi 48/44) ---
    "7550": _d("Radeon RX 9070 / 9070 XT / 9070 GRE", "gfx1201", 640, 16, "Navi 48"),
    "7551": _d("Radeon AI PRO R9700", "gfx1201", 640, 32, "Navi 48"),
    "7590": _d("Radeon RX 9060 / 9060 XT", "gfx1200", 320, 16, "Navi 44"),
    # --- APUs (integrated; RDNA2/3/3.5) ---
    "163f": _i(
        "Steam Deck GPU (Van Gogh, LCD)",
        "gfx1033",
        88,
        "Van Gogh",
        "16 GB LPDDR5-5500, 128-bit: 88 GB/s (Valve)",
        carve_out=1,
    ),
    "1435": _i(
        "Steam Deck GPU (Sephiroth, OLED)",
        "gfx1033",
        102.4,
        "Sephiroth",
        "16 GB LPDDR5-6400, 128-bit: 102.4 GB/s (computed)",
        carve_out=1,
    ),
    "1681": _i(
        "Radeon 680M / 660M",
        "gfx1035",
        102.4,
        "Rembrandt",
        "bandwidth assumes 128-bit LPDDR5-6400 (102.4 GB/s)",
    ),
    "164e": _i("Radeon Graphics (Ryzen 7000 desktop)", "gfx1036", 83.2, "Raphael", _DDR5_DESKTOP),
    "13c0": _i("Radeon Graphics (Ryzen 9000 desktop)", "gfx1036", 83.2, "Granite Ridge", _DDR5_DESKTOP),
    "1506": _i("Radeon 610M", "gfx1036", 44, "Mendocino", "bandwidth assumes 64-bit LPDDR5-5500"),
    "15bf": _i("Radeon 780M / 760M / 740M", "gfx1103", 89.6, "Phoenix", _DDR5_5600),
    "15c8": _i("Radeon 740M", "gfx1103", 89.6, "Phoenix 2", _DDR5_5600),
    "1900": _i("Radeon 780M / 760M", "gfx1103", 89.6, "Hawk Point", _DDR5_5600),
    "1901": _i("Radeon 740M", "gfx1103", 89.6, "Hawk Point 2", _DDR5_5600),
    "150e": _i("Radeon 890M / 880M", "gfx1150", 120, "Strix Point", _LPDDR5X_7500),
    "1114": _i("Radeon 860M / 840M", "gfx1152", 120, "Krackan Point", _LPDDR5X_7500),
    "1586": _i(
        "Radeon 8060S / 8050S / 8040S", "gfx1151", 256, "Strix Halo", "256-bit LPDDR5X-8000: 256 GB/s"
    ),
}

#: (device id, PCI revision) → model, for ids shared by several products with different memory
AMD_BY_REVISION: dict[tuple[str, str], GpuModel] = {
    ("73bf", "c0"): _d("Radeon RX 6900 XT", "gfx1030", 512, 16, "Navi 21"),
    ("73bf", "c1"): _d("Radeon RX 6800 XT", "gfx1030", 512, 16, "Navi 21"),
    ("73bf", "c3"): _d("Radeon RX 6800", "gfx1030", 512, 16, "Navi 21"),
    ("73df", "c0"): _d("Radeon RX 6750 XT", "gfx1031", 432, 12, "Navi 22"),
    ("73df", "c1"): _d("Radeon RX 6700 XT", "gfx1031", 384, 12, "Navi 22"),
    ("73df", "c5"): _d("Radeon RX 6700 XT", "gfx1031", 384, 12, "Navi 22"),
    ("73df", "c2"): _d("Radeon RX 6800M", "gfx1031", 384, 12, "Navi 22"),
    ("73df", "c3"): _d("Radeon RX 6800M", "gfx1031", 384, 12, "Navi 22"),
    ("73df", "cf"): _d("Radeon RX 6700M", "gfx1031", 320, 10, "Navi 22"),
    ("73df", "df"): _d("Radeon RX 6700", "gfx1031", 320, 10, "Navi 22"),
    ("73df", "ff"): _d("Radeon RX 6700", "gfx1031", 320, 10, "Navi 22"),
    ("73ef", "c1"): _d("Radeon RX 6650 XT", "gfx1032", 280, 8, "Navi 23"),
    ("73ef", "c0"): _d("Radeon RX 6800S", "gfx1032", 256, 8, "Navi 23"),
    ("73ef", "c2"): _d("Radeon RX 6700S", "gfx1032", 224, 8, "Navi 23"),
    ("73ff", "c1"): _d("Radeon RX 6600 XT", "gfx1032", 256, 8, "Navi 23"),
    ("73ff", "c7"): _d("Radeon RX 6600", "gfx1032", 224, 8, "Navi 23"),
    ("73ff", "c3"): _d("Radeon RX 6600M", "gfx1032", 224, 8, "Navi 23"),
    ("73ff", "cb"): _d("Radeon RX 6600S", "gfx1032", 224, 4, "Navi 23"),
    ("743f", "c1"): _d("Radeon RX 6500 XT", "gfx1034", 144, 4, "Navi 24"),
    ("743f", "c7"): _d("Radeon RX 6400", "gfx1034", 128, 4, "Navi 24"),
    ("744c", "c8"): _d("Radeon RX 7900 XTX", "gfx1100", 960, 24, "Navi 31"),
    ("744c", "cc"): _d("Radeon RX 7900 XT", "gfx1100", 800, 20, "Navi 31"),
    ("744c", "ce"): _d("Radeon RX 7900 GRE", "gfx1100", 576, 16, "Navi 31"),
    ("744c", "cf"): _d("Radeon RX 7900M", "gfx1100", 576, 16, "Navi 31"),
    ("747e", "c8"): _d("Radeon RX 7800 XT", "gfx1101", 624, 16, "Navi 32"),
    ("747e", "ff"): _d("Radeon RX 7700 XT", "gfx1101", 432, 12, "Navi 32"),
    ("7480", "cf"): _d("Radeon RX 7600", "gfx1102", 288, 8, "Navi 33"),
    ("7480", "c0"): _d("Radeon RX 7600 XT", "gfx1102", 288, 16, "Navi 33"),
    ("7480", "c1"): _d("Radeon RX 7700S", "gfx1102", 288, 8, "Navi 33"),
    ("7480", "c3"): _d("Radeon RX 7600S", "gfx1102", 256, 8, "Navi 33"),
    ("7480", "00"): _d("Radeon PRO W7600", "gfx1102", 288, 8, "Navi 33"),
    ("7550", "c0"): _d("Radeon RX 9070 XT", "gfx1201", 640, 16, "Navi 48"),
    ("7550", "c3"): _d("Radeon RX 9070", "gfx1201", 640, 16, "Navi 48"),
    ("7550", "c2"): _d("Radeon RX 9070 GRE", "gfx1201", None, 12, "Navi 48"),
    ("7590", "c0"): _d("Radeon RX 9060 XT", "gfx1200", 320, 16, "Navi 44"),
}

#: gfx targets of APUs (LLVM AMDGPUUsage marks these "APU"), used when the id is not in the table
APU_GFX_TARGETS = frozenset(
    {
        "gfx902",
        "gfx909",
        "gfx90c",
        "gfx1013",
        "gfx1033",
        "gfx1035",
        "gfx1036",
        "gfx1037",
        "gfx1103",
        "gfx1150",
        "gfx1151",
        "gfx1152",
        "gfx1153",
    }
)

#: gfx targets built by current ROCm (v7) releases: ollama's ROCm build list and AMD's support matrix.
#: The rocBLAS kernels actually installed override this list when they can be read.
ROCM_SUPPORTED_GFX = frozenset(
    {
        "gfx908",
        "gfx90a",
        "gfx942",
        "gfx950",
        "gfx1030",
        "gfx1100",
        "gfx1101",
        "gfx1102",
        "gfx1150",
        "gfx1151",
        "gfx1200",
        "gfx1201",
    }
)

#: HSA_OVERRIDE_GFX_VERSION values the community uses for gfx targets ROCm does not build for
_OVERRIDE_FAMILIES = {"gfx103": ("10.3.0", "gfx1030"), "gfx110": ("11.0.0", "gfx1100")}

#: the Steam Deck's GPUs
STEAM_DECK_PCI_IDS = frozenset({"1002:163f", "1002:1435"})


def lookup_amd(device_id: str, revision: str | None = None) -> GpuModel | None:
    """The table entry for ``device_id`` ("73bf" or "0x73BF"), revision-specific when known."""
    dev = _norm(device_id, 4)
    if revision:
        hit = AMD_BY_REVISION.get((dev, _norm(revision, 2)))
        if hit:
            return hit
    return AMD_GPUS.get(dev)


def gfx_from_kfd_version(version: int | None) -> str | None:
    """KFD ``gfx_target_version`` (e.g. 100303) → "gfx1033"; None for 0/None/out of range."""
    if not version or version < 0:
        return None
    major, minor, step = (version // 10000) % 100, (version // 100) % 100, version % 100
    if major == 0 or minor > 0xF or step > 0xF:
        return None
    return f"gfx{major}{minor:x}{step:x}"


def hsa_override_for(gfx: str | None) -> tuple[str, str] | None:
    """(HSA_OVERRIDE_GFX_VERSION value, target it pretends to be) for an unsupported RDNA2/3 gfx."""
    if not gfx:
        return None
    for prefix, (value, target) in _OVERRIDE_FAMILIES.items():
        if gfx.startswith(prefix) and len(gfx) == 7 and gfx != target:
            return value, target
    return None


def _norm(hex_id: str, width: int) -> str:
    text = hex_id.strip().lower()
    if text.startswith("0x"):
        text = text[2:]
    return text.zfill(width)[-width:] if text else text
