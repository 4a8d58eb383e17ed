"""The fit estimate: weights + KV cache + workspace against a memory budget."""

from __future__ import annotations

import dataclasses

import pytest

from app.inference.store import fit
from app.inference.store.catalog import load_catalog

GB = 1_000_000_000


@pytest.fixture
def llama8b():
    return load_catalog().get("llama-3.1-8b-instruct")


def test_kv_cache_arithmetic(llama8b):
    # Llama 3.1 8B: 32 layers × 8 KV heads × 128 head dim × 2 (K, V) × 2 bytes = 128 KiB per token
    assert fit.kv_bytes_per_token(llama8b) == 32 * 8 * 128 * 2 * 2 == 131072
    est = fit.estimate(llama8b, 24 * GB, context=8192)
    assert est.kv_cache_bytes == 131072 * 8192  # 1 GiB
    assert est.weights_bytes == llama8b.download_bytes
    assert est.workspace_bytes == fit.WORKSPACE_BASE_BYTES + 128256 * fit.PREFILL_CHUNK_TOKENS * 4
    assert est.total_bytes == est.weights_bytes + est.kv_cache_bytes + est.workspace_bytes


def test_verdicts_follow_the_budget(llama8b):
    need = fit.estimate(llama8b, 10**15, context=4096).total_bytes
    assert fit.estimate(llama8b, int(need / 0.9) + 1, 4096).verdict == "fits"
    assert fit.estimate(llama8b, need, 4096).verdict == "tight"
    assert fit.estimate(llama8b, int(need / 0.95), 4096).verdict == "tight"
    assert fit.estimate(llama8b, need - 1, 4096).verdict == "does not fit"
    assert fit.estimate(llama8b, None, 4096).verdict == "unknown"


def test_max_context_is_the_largest_that_fits(llama8b):
    budget = 6 * GB
    best = fit.max_context(llama8b, budget)
    assert best % fit.CONTEXT_STEP == 0 and 0 < best < llama8b.context_window
    assert fit.estimate(llama8b, budget, best).total_bytes <= budget
    # one more step of context would not fit
    over = fit.estimate(llama8b, budget, best + fit.CONTEXT_STEP)
    assert over.total_bytes > budget
    # a huge budget is capped by the model's window; a tiny one leaves nothing
    assert fit.max_context(llama8b, 10**15) == llama8b.context_window
    assert fit.max_context(llama8b, 1 * GB) == 0


def test_context_defaults_and_is_capped_by_the_window(llama8b):
    llama2 = load_catalog().get("llama-2-7b-chat")
    assert fit.estimate(llama8b, 24 * GB).context == fit.DEFAULT_CONTEXT
    assert fit.estimate(llama2, 24 * GB, context=100_000).context == llama2.context_window == 4096


def test_more_kv_heads_cost_more(llama8b):
    mha = dataclasses.replace(llama8b, num_kv_heads=32)
    assert fit.kv_bytes_per_token(mha) == 4 * fit.kv_bytes_per_token(llama8b)
    assert fit.max_context(mha, 8 * GB) < fit.max_context(llama8b, 8 * GB)
