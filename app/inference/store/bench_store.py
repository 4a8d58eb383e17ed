"""What ``llmchat bench`` measured on this machine, kept in the cache directory
(``<cache dir>/bench_results.json``) so that the catalog's speed estimates use it.

``record(result)`` stores one result of ``llmchat bench`` (its ``--json`` object); ``results()``
reads them back, skipping what does not look like one (a damaged file is ignored, never a crash).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.jsonfile import read_json, write_json_atomic
from app.paths import cache_dir

FILE_NAME = "bench_results.json"
#: results kept (the newest)
KEEP = 64


@dataclass(frozen=True)
class BenchResult:
    """One decode measurement: ``model`` on ``device`` (e.g. "cpu:0", "cuda:0")."""

    model: str
    device: str
    weight_bytes: int
    decode_tok_s: float
    measured_at: float = 0.0  # seconds since the epoch

    @property
    def backend(self) -> str:
        return self.device.partition(":")[0]

    @property
    def bytes_per_s(self) -> float:
        """The weight bytes read per second of decode: what a decode step reached on this device."""
        return self.weight_bytes * self.decode_tok_s


def path() -> Path:
    return cache_dir() / FILE_NAME


def _parse(item: Any) -> BenchResult | None:
    if not isinstance(item, dict):
        return None
    model, device = item.get("model"), item.get("device")
    weight, speed = item.get("weight_bytes"), item.get("decode_tok_s")
    when = item.get("measured_at", 0.0)
    numbers = (weight, speed, when)
    if not (
        isinstance(model, str)
        and isinstance(device, str)
        and device
        and all(isinstance(n, int | float) and not isinstance(n, bool) and math.isfinite(n) for n in numbers)
        and weight > 0
        and speed > 0
    ):
        return None
    return BenchResult(model, device, int(weight), float(speed), float(when))


def results() -> list[BenchResult]:
    """The stored results, oldest first (none when the file is missing or damaged)."""
    data, _problem = read_json(path())
    items = data.get("results") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return []
    return [r for r in (_parse(item) for item in items) if r is not None]


def record(result: dict[str, Any]) -> BenchResult | None:
    """Store one ``llmchat bench`` result (the keys of its ``--json`` object); None when it has no
    usable decode figure. Failing to write is not an error of the benchmark: it returns None."""
    parsed = _parse({**result, "measured_at": result.get("measured_at", time.time())})
    if parsed is None:
        return None
    kept = [r.__dict__ for r in results()][-(KEEP - 1) :]
    try:
        write_json_atomic(path(), {"version": 1, "results": [*kept, parsed.__dict__]})
    except OSError:
        return None
    return parsed
