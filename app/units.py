"""Counts and sizes as llmchat shows them: ``plural`` ("1 reply", "2 replies"), and sizes in binary
units everywhere (KiB, MiB, GiB), as the hardware report (VRAM, the memory budget) and the drivers
count memory, so a download, a budget and the memory in use compare at a glance."""

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


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 token``, ``2 tokens``, ``1 reply``, ``3 replies`` (``many``: an irregular plural);
    thousands separated by commas."""
    if count == 1:
        return f"1 {word}"
    if many is None:
        many = word[:-1] + "ies" if word.endswith("y") and word[-2:-1] not in "aeiou" else word + "s"
    return f"{count:,} {many}"
