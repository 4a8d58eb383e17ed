"""Will a model fit? Weights + KV cache at a context length + workspace, against a memory budget.

    KV cache  = layers × KV heads × head dim × 2 (K and V) × bytes per element × tokens
    workspace = WORKSPACE_BASE_BYTES + vocab × PREFILL_CHUNK_TOKENS × 4   (fp32 logits of one prefill
                chunk dominate the engine's temporary buffers; MLC's estimates show the same shape)
    total     = weights + KV cache + workspace

``fits`` when total ≤ TIGHT_FRACTION × budget, ``tight`` when it is within the budget but above that,
``does not fit`` otherwise. :func:`max_context` is the largest context (a multiple of
CONTEXT_STEP, at most the model's window) whose total stays within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.inference.store.catalog import CatalogEntry

Verdict = Literal["fits", "tight", "does not fit", "unknown"]

KV_BYTES_PER_ELEMENT = 2  # fp16 KV cache
WORKSPACE_BASE_BYTES = 64 * 1024 * 1024
PREFILL_CHUNK_TOKENS = 512
LOGIT_BYTES = 4
TIGHT_FRACTION = 0.9
CONTEXT_STEP = 256
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class FitEstimate:
    """The memory a model needs at one context length, and what that means for the budget."""

    verdict: Verdict
    context: int  # tokens the estimate is for
    weights_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    budget_bytes: int | None
    max_context: int  # largest context that fits the budget (0: not even CONTEXT_STEP tokens; -1: unknown)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes


def kv_bytes_per_token(entry: CatalogEntry, bytes_per_element: int = KV_BYTES_PER_ELEMENT) -> int:
    """KV cache bytes one token costs: layers × KV heads × head dim × 2 (K and V) × bytes."""
    return entry.num_layers * entry.num_kv_heads * entry.head_dim * 2 * bytes_per_element


def workspace_bytes(entry: CatalogEntry) -> int:
    """Temporary buffers of the engine (logits of one prefill chunk, activations)."""
    return WORKSPACE_BASE_BYTES + entry.vocab_size * PREFILL_CHUNK_TOKENS * LOGIT_BYTES


def weights_bytes(entry: CatalogEntry) -> int:
    """Device memory of the weights: the quantized shards as downloaded."""
    return entry.download_bytes


def max_context(entry: CatalogEntry, budget_bytes: int) -> int:
    """The largest context (multiple of CONTEXT_STEP, ≤ the model's window) that fits the budget."""
    room = budget_bytes - weights_bytes(entry) - workspace_bytes(entry)
    if room <= 0:
        return 0
    tokens = room // kv_bytes_per_token(entry)
    tokens = min(tokens, entry.context_window)
    if tokens < entry.context_window:
        tokens -= tokens % CONTEXT_STEP
    return int(max(tokens, 0))


def estimate(entry: CatalogEntry, budget_bytes: int | None, context: int | None = None) -> FitEstimate:
    """Fit of ``entry`` at ``context`` tokens (default: min(window, DEFAULT_CONTEXT)) in ``budget_bytes``."""
    context = min(context or DEFAULT_CONTEXT, entry.context_window)
    weights = weights_bytes(entry)
    kv = kv_bytes_per_token(entry) * context
    work = workspace_bytes(entry)
    if budget_bytes is None or budget_bytes <= 0:
        return FitEstimate("unknown", context, weights, kv, work, None, -1)
    total = weights + kv + work
    if total <= TIGHT_FRACTION * budget_bytes:
        verdict: Verdict = "fits"
    elif total <= budget_bytes:
        verdict = "tight"
    else:
        verdict = "does not fit"
    return FitEstimate(verdict, context, weights, kv, work, budget_bytes, max_context(entry, budget_bytes))
