"""The compiler pipeline for CPUs (llvm targets)."""

from __future__ import annotations

from typing import Any


def cpu_pipeline(target: Any) -> Any:
    """TVM's default pipeline for now (no CPU schedules yet)."""
    from tvm import relax

    return relax.get_default_pipeline(target)
