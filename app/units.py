"""Sizes as llmchat shows them: binary units everywhere (KiB, MiB, GiB), as the hardware report
(VRAM, the memory budget) and the drivers count memory, so a download, a budget and the memory in
use compare at a glance."""

from __future__ import annotations

KIB = 1 << 10
GIB = 1 << 30


def format_bytes(count: float | None) -> str:
    """``512 B``, ``70.0 KiB``, ``88.6 MiB``, ``4.22 GiB``; ``unknown`` for None."""
    if count is None:
        return "unknown"
    value = float(count)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < KIB:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= KIB
    return f"{value:.2f} GiB"
