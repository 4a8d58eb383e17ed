"""The probe's result: :class:`HardwareReport`, as JSON (``llmchat doctor --json``) or readable text."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.inference.hardware.devices import GpuDevice
from app.inference.hardware.memory import gib

STEAMOS_NOTES = [
    "SteamOS keeps / read-only and resets it on updates: keep llmchat and its virtual environment "
    "under your home directory (cd ~/llmchat && python3 -m venv .venv && .venv/bin/pip install -e .); "
    "do not use sudo pacman or steamos-readonly disable.",
    "Run it in Desktop Mode (Steam button → Power → Switch to Desktop) from Konsole; Game Mode has no "
    "terminal.",
    "SteamOS ships no ROCm; llmchat uses Vulkan (Mesa RADV), which SteamOS has.",
    "The GPU and CPU share one power budget (15 W by default): plug in the charger for long chats.",
]


@dataclass
class HardwareReport:
    """What the probe found and decided. ``backend``/``device`` are what llmchat will use."""

    devices: list[GpuDevice]
    recommended_backend: str
    backend: str
    device: str
    memory_budget_bytes: int
    memory_budget_explanation: str
    steam_deck: bool
    reasons: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # files that could not be read, and why
    recommended_reasons: list[str] = field(default_factory=list)
    backend_reasons: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)  # risky choices offered, never applied
    notes: list[str] = field(default_factory=list)  # e.g. SteamOS specifics
    steam_deck_model: str | None = None  # "LCD" | "OLED" | "" (unknown) when a Deck
    utilization: float = 0.85
    system: dict[str, Any] = field(default_factory=dict)
    runtimes: dict[str, Any] = field(default_factory=dict)
    sysroot: str = "/"
    probe_seconds: float = 0.0

    gpu_index: int | None = None  # index in ``devices`` of the GPU ``backend`` runs on

    @property
    def gpu(self) -> GpuDevice | None:
        """The device ``backend`` runs on (None for cpu and metal)."""
        if self.gpu_index is None or self.backend in ("cpu", "metal"):
            return None
        return self.devices[self.gpu_index]

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [
                {
                    "vendor": d.vendor,
                    "name": d.name,
                    "pci_id": d.pci_id,
                    "gfx_target": d.gfx_target,
                    "kind": d.kind,
                    "vram_bytes": d.vram_bytes,
                    "gtt_bytes": d.gtt_bytes,
                    "bandwidth_bytes_per_s": d.bandwidth_bytes_per_s,
                    "driver": d.driver,
                    "revision": d.revision,
                    "pci_slot": d.pci_slot,
                    "compute_units": d.compute_units,
                    "kfd_memory_bytes": d.kfd_memory_bytes,
                    "vram_source": d.vram_source,
                    "gfx_source": d.gfx_source,
                    "notes": d.notes,
                }
                for d in self.devices
            ],
            "recommended_backend": self.recommended_backend,
            "backend": self.backend,
            "device": self.device,
            "gpu_index": self.gpu_index,
            "memory_budget_bytes": self.memory_budget_bytes,
            "memory_budget_explanation": self.memory_budget_explanation,
            "utilization": self.utilization,
            "steam_deck": self.steam_deck,
            "steam_deck_model": self.steam_deck_model,
            "reasons": self.reasons,
            "recommended_reasons": self.recommended_reasons,
            "backend_reasons": self.backend_reasons,
            "fixes": self.fixes,
            "options": self.options,
            "notes": self.notes,
            "problems": self.problems,
            "system": self.system,
            "runtimes": self.runtimes,
            "sysroot": self.sysroot,
            "probe_seconds": round(self.probe_seconds, 4),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def format_text(self) -> str:
        """The report ``llmchat doctor`` prints."""
        lines: list[str] = []
        add = lines.append
        add("GPUs")
        if not self.devices:
            add("  none found")
        for i, d in enumerate(self.devices):
            gfx = f", {d.gfx_target}" if d.gfx_target else ""
            add(f"  [{i}] {d.name} ({d.pci_id}{gfx}, {d.kind}, driver {d.driver or '?'})")
            label = "VRAM" if d.kind == "discrete" else "carve-out"
            guess = " (typical)" if d.kind == "discrete" else " (assumed default)"
            mem = [f"{label} {gib(d.vram_bytes)}" + (guess if d.vram_source == "table" else "")]
            if d.gtt_bytes:
                mem.append(f"GTT {gib(d.gtt_bytes)}")
            if d.kfd_memory_bytes:
                mem.append(f"KFD memory {gib(d.kfd_memory_bytes)}")
            if d.bandwidth_bytes_per_s:
                mem.append(f"bandwidth {d.bandwidth_bytes_per_s / 1e9:g} GB/s")
            add("      " + ", ".join(mem))
            lines += [f"      ({note})" for note in d.notes]
        if self.steam_deck:
            model = f" ({self.steam_deck_model})" if self.steam_deck_model else ""
            add(f"Steam Deck{model}: yes")
        add("")
        add(f"Recommended backend: {self.recommended_backend}")
        lines += [f"  - {r}" for r in self.recommended_reasons]
        add(f"Backend llmchat will use: {self.backend} (device {self.device})")
        lines += [f"  - {r}" for r in self.backend_reasons]
        tvm = self.runtimes.get("tvm", {})
        if tvm.get("available") is not None:
            add(f"  TVM runtimes here: {', '.join(tvm['available'])} (found by {tvm.get('method')} check)")
        vk = self.runtimes.get("vulkan", {})
        if vk.get("adapters") or vk.get("adapters_problem"):
            add("")
            add("Vulkan adapters (wgpu-native, as `--device vulkan:N`)")
            for i, a in enumerate(vk.get("adapters") or []):
                lim = a.get("limits", {})
                add(
                    f"  [{i}] {a.get('name')} ({a.get('device_type')}, {a.get('backend')}, driver "
                    f"{a.get('driver') or '?'}): shader-f16 {'yes' if a.get('shader_f16') else 'no'}, "
                    f"{_subgroups(a)}, largest binding {gib(lim.get('max_storage_buffer_binding_size'))}, "
                    f"workgroup memory "
                    f"{lim.get('max_compute_workgroup_storage_size', 0) // 1024} KiB"
                )
            if vk.get("adapters_problem"):
                add(f"  {vk['adapters_problem']}")
        rocm = self.runtimes.get("rocm", {})
        rt = rocm.get("runtime") or {}
        if rt or rocm.get("runtime_problem"):
            add("")
            add("ROCm devices (llmchat's HIP runtime, as `--device rocm:N`)")
            if rt.get("library"):
                add(f"  HIP: {rt['library']}")
            for d in rt.get("devices") or []:
                add(
                    f"  [{d.get('index')}] {d.get('name')} ({d.get('arch') or '?'}, "
                    f"wave{d.get('warp_size')}, {d.get('compute_units')} CUs, {gib(d.get('memory_bytes'))})"
                )
            if rocm.get("runtime_problem"):
                add(f"  {rocm['runtime_problem']}")
        add("")
        add(f"Memory budget: {gib(self.memory_budget_bytes)} ({self.memory_budget_bytes:,} bytes)")
        add(f"  {self.memory_budget_explanation}")
        for title, items in (
            ("How to fix", self.fixes),
            ("Options (not applied)", self.options),
            ("Notes", self.notes),
            ("Could not read", self.problems),
        ):
            if items:
                add("")
                add(title)
                lines += [f"  - {item}" for item in items]
        return "\n".join(lines) + "\n"


def _subgroups(a: dict[str, Any]) -> str:
    """An adapter's subgroups as doctor shows them: llmchat's WGSL uses them only at one fixed size."""
    lo, hi = int(a.get("subgroup_min_size") or 0), int(a.get("subgroup_max_size") or 0)
    if not a.get("subgroups"):
        return "subgroups no"
    if not lo or not hi:
        return "subgroups yes, size not reported (not used)"
    if lo == hi:
        return f"subgroups {lo} wide" + ("" if lo == 32 else " (not used: llmchat's WGSL needs 32)")
    return f"subgroups {lo}-{hi} wide (not used: the size varies)"
