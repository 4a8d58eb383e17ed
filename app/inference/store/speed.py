"""How fast would a catalog model decode here? Memory bandwidth ÷ weight bytes, corrected by what
``llmchat bench`` measured on this machine.

Decoding one token reads every weight once, so a device that moves B bytes/s decodes at most
B ÷ weight bytes tokens/s. What llmchat's kernels reach of B differs per backend (measured on an
H200, BENCHMARKS.md: CUDA 0.45 of the copy bandwidth on the Llama-2-7B shape, Vulkan ~0.2), and a CPU's
bandwidth is not probed: it is guessed from its cores. Where ``llmchat bench`` ran on this machine
(:mod:`app.inference.store.bench_store`), its figures replace the guess: the same model's measured speed,
else the bytes per second another model's decode reached on the same backend.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from app.inference.store.bench_store import BenchResult
from app.inference.store.fit import weights_bytes

#: below this many tokens per second a reply is painfully slow (a 300-token answer takes a minute)
SLOW_TOK_S = 5.0
#: the share of a GPU's nominal bandwidth llmchat's decode reaches (nothing measured here yet)
GPU_EFFICIENCY = {"cuda": 0.45, "rocm": 0.45, "vulkan": 0.2}
#: CPU: weight bytes a decode streams per second and core (SmolLM2-135M, 2 cores: ~6 GB/s each), at most
CPU_BYTES_PER_CORE_S = 6e9
CPU_MAX_BYTES_S = 50e9

Source = Literal["measured", "bench", "estimate"]


@dataclass(frozen=True)
class SpeedEstimate:
    """Decode tokens per second of one model on this machine, and where the figure comes from."""

    tok_s: float
    source: Source  # "measured": bench ran this model here; "bench": scaled from bench runs here
    basis: str  # the arithmetic, in words

    @property
    def slow(self) -> bool:
        return self.tok_s < SLOW_TOK_S

    def short(self) -> str:
        """``~12 tok/s``; ``~2 tok/s slow`` below SLOW_TOK_S."""
        figure = f"{self.tok_s:.1f}" if self.tok_s < 10 else f"{self.tok_s:.0f}"
        return f"~{figure} tok/s" + (" slow" if self.slow else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "decode_tok_s": round(self.tok_s, 1),
            "source": self.source,
            "slow": self.slow,
            "basis": self.basis,
        }


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def nominal_bytes_per_s(report: Any) -> tuple[float | None, str]:
    """(bytes/s a decode reaches on the probed device without a measurement, how it was guessed)."""
    backend = getattr(report, "backend", None) or "cpu"
    if backend == "cpu":
        cores = _cores()
        rate = min(cores * CPU_BYTES_PER_CORE_S, CPU_MAX_BYTES_S)
        return rate, f"{cores} CPU cores × {CPU_BYTES_PER_CORE_S / 1e9:g} GB/s"
    gpu = getattr(report, "gpu", None)
    bandwidth = getattr(gpu, "bandwidth_bytes_per_s", None)
    share = GPU_EFFICIENCY.get(backend)
    if not bandwidth or share is None:
        return None, f"the bandwidth of {getattr(gpu, 'name', None) or backend} is unknown"
    return bandwidth * share, f"{bandwidth / 1e9:,.0f} GB/s × {share:g} ({backend})"


def estimate(entry: Any, report: Any, measured: Iterable[BenchResult] = ()) -> SpeedEstimate | None:
    """Decode speed of catalog ``entry`` on the device the probe ``report`` picked (None: unknown,
    e.g. without a report)."""
    if report is None:
        return None
    backend = getattr(report, "backend", None) or "cpu"
    weights = weights_bytes(entry)
    if weights <= 0:
        return None
    here = [r for r in measured if r.backend == backend]
    same = [r for r in here if r.model == entry.id]
    if same:
        latest = same[-1]
        return SpeedEstimate(
            latest.decode_tok_s,
            "measured",
            f"llmchat bench on {latest.device}: {latest.decode_tok_s:.1f} tok/s",
        )
    if here:
        latest_per_model = {r.model: r for r in here}  # the newest of each model
        rate = statistics.median(r.bytes_per_s for r in latest_per_model.values())
        return SpeedEstimate(
            rate / weights,
            "bench",
            f"{rate / 1e9:.1f} GB/s reached by llmchat bench on {backend} "
            f"÷ {weights / 1e9:.2f} GB of weights",
        )
    rate, how = nominal_bytes_per_s(report)
    if rate is None:
        return None
    return SpeedEstimate(rate / weights, "estimate", f"{how} ÷ {weights / 1e9:.2f} GB of weights")


def speed_function(report: Any):
    """entry -> SpeedEstimate | None for the screens and ``llmchat models`` (bench results read once)."""
    from app.inference.store import bench_store

    measured = bench_store.results()
    return lambda entry: estimate(entry, report, measured)
