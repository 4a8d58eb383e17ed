"""llmchat's CPU attention kernels (cpu_attention.py) against numpy in float64, on edge shapes.

Each kernel is compiled with the real TVM for this machine and called with TVM's own calling
convention (the one the paged KV cache uses), so a kernel that differs from TVM's contract fails
here: one query row, odd lengths, lengths on and across page boundaries, several sequences in one
batch, GQA ratios 1, 3 and 4, causal and not, float32 and float16, stale NaNs in the unused slots of
pages. No timing assertions (speed is measured by benchmarks/cpu_depth.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tvm

from app.inference.pipelines.cpu_attention import (
    decode_attention_kernel,
    fast_exp2,
    merge_state_kernel,
    prefill_attention_kernel,
)

PAGE = 16
HEAD_DIM = 32
dev = tvm.cpu()


@pytest.fixture(scope="module")
def target():
    return tvm.target.Target({"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()})


def _build(func, target):
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)["main"]


def _t(a):
    return tvm.runtime.tensor(a, device=dev)


def _reference(q, k, v, causal):
    """Output and log2-domain log-sum-exp of one sequence, float64. q [n, Hq, D]; k, v [kv, Hkv, D]."""
    n, h_q, d = q.shape
    kv, h_kv = k.shape[0], k.shape[1]
    out = np.zeros((n, h_q, d))
    lse = np.zeros((n, h_q))
    for h in range(h_q):
        s = q[:, h].astype(np.float64) @ k[:, h // (h_q // h_kv)].T.astype(np.float64) / np.sqrt(d)
        if causal:
            visible = np.arange(kv)[None, :] <= kv - n + np.arange(n)[:, None]
            s = np.where(visible, s, -np.inf)
        top = s.max(axis=1, keepdims=True)
        p = np.exp(s - top)
        out[:, h] = p @ v[:, h // (h_q // h_kv)].astype(np.float64) / p.sum(axis=1, keepdims=True)
        lse[:, h] = (top[:, 0] + np.log(p.sum(axis=1))) / np.log(2)
    return out, lse


def _close(got, ref, dtype):
    tol = 2e-5 if dtype == "float32" else 3e-3
    assert np.abs(got.astype(np.float64) - ref).max() <= tol * max(1.0, np.abs(ref).max())


# (query heads, KV heads): plain multi-head, SmolLM2's ratio 3, Qwen's ratio 4
HEADS = [(2, 2), (6, 2), (4, 1)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(("h_q", "h_kv"), HEADS)
def test_ragged_prefill_matches_numpy(target, dtype, h_q, h_kv):
    """The chunk's queries against its own keys: causal (as the KV cache calls it) and not; three
    sequences in one batch of 1 query row, 16 (a tile) and 37 (odd, across tiles)."""
    rng = np.random.default_rng(1)
    lengths = [1, 16, 37]
    total = sum(lengths)
    q = rng.standard_normal((total, h_q, HEAD_DIM)).astype(dtype)
    k = rng.standard_normal((total, h_kv, HEAD_DIM)).astype(dtype)
    v = rng.standard_normal((total, h_kv, HEAD_DIM)).astype(dtype)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype("int32")
    kernel = _build(prefill_attention_kernel(h_kv, h_q, HEAD_DIM, dtype, paged=False), target)
    for causal in (1, 0):
        out = _t(np.full(q.shape, np.nan, dtype))
        lse = _t(np.full(q.shape[:2], np.nan, "float32"))
        kernel(
            _t(q),
            _t(indptr),
            _t(k),
            _t(v),
            _t(indptr),
            _t(np.zeros(total, "int32")),
            _t(np.zeros(len(lengths), "int32")),
            out,
            lse,
            causal,
            0,
            1.0,
            10000.0,
            HEAD_DIM**-0.5,
        )
        for b, (lo, hi) in enumerate(itertools.pairwise(indptr)):
            ref, ref_lse = _reference(q[lo:hi], k[lo:hi], v[lo:hi], causal)
            _close(out.numpy()[lo:hi], ref, dtype)
            assert np.abs(lse.numpy()[lo:hi] - ref_lse).max() <= 1e-3, (b, causal)


def _paged_cache(rng, dtype, h_kv, kv_lengths, d=HEAD_DIM):
    """Pages [n, 2, h_kv, PAGE, D] holding each sequence's keys/values in shuffled pages; every
    unused slot (past a sequence's last key, spare pages) is NaN, as stale memory may be."""
    n_pages = [-(-n // PAGE) for n in kv_lengths]
    total_pages = sum(n_pages) + 2
    pages = np.full((total_pages, 2, h_kv, PAGE, d), np.nan, dtype)
    order = rng.permutation(total_pages).astype("int32")
    values, keys, vals = [], [], []
    used = 0
    for n, count in zip(kv_lengths, n_pages, strict=True):
        k = rng.standard_normal((n, h_kv, d)).astype(dtype)
        v = rng.standard_normal((n, h_kv, d)).astype(dtype)
        mine = order[used : used + count]
        used += count
        for pos in range(n):
            pages[mine[pos // PAGE], 0, :, pos % PAGE] = k[pos]
            pages[mine[pos // PAGE], 1, :, pos % PAGE] = v[pos]
        values.append(mine)
        keys.append(k)
        vals.append(v)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype("int32")
    last = np.array(
        [n - (c - 1) * PAGE if c else 0 for n, c in zip(kv_lengths, n_pages, strict=True)], "int32"
    )
    return pages, indptr, np.concatenate(values).astype("int32"), last, keys, vals


@pytest.mark.parametrize(("dtype", "wide"), [("float32", True), ("float16", True), ("float32", False)])
@pytest.mark.parametrize(("h_q", "h_kv"), HEADS)
def test_paged_prefill_matches_numpy(target, dtype, wide, h_q, h_kv):
    """The chunk's queries against the keys already in the cache's pages (not causal, as the KV
    cache calls it, and causal): KV lengths of one page exactly, one past it, a single key and
    33 (across two page boundaries); 1, 5, 20 and 3 queries. ``wide=False``: the register tiles
    for CPUs with 16 vector registers (AVX2)."""
    rng = np.random.default_rng(2)
    kv_lengths = [16, 17, 1, 33]
    q_lengths = [1, 5, 20, 3]
    pages, page_indptr, page_values, last, keys, vals = _paged_cache(rng, dtype, h_kv, kv_lengths)
    q_indptr = np.concatenate([[0], np.cumsum(q_lengths)]).astype("int32")
    q = rng.standard_normal((q_indptr[-1], h_q, HEAD_DIM)).astype(dtype)
    func = prefill_attention_kernel(h_kv, h_q, HEAD_DIM, dtype, paged=True, page_size=PAGE, wide=wide)
    kernel = _build(func, target)
    for causal in (0, 1):
        out = _t(np.full(q.shape, np.nan, dtype))
        lse = _t(np.full(q.shape[:2], np.nan, "float32"))
        zeros = np.zeros(len(kv_lengths), "int32")
        kernel(
            _t(q),
            _t(q_indptr),
            _t(pages),
            _t(page_indptr),
            _t(page_values),
            _t(last),
            _t(zeros),
            _t(np.zeros(len(q), "int32")),
            out,
            lse,
            causal,
            0,
            1.0,
            10000.0,
            HEAD_DIM**-0.5,
        )
        for b, (lo, hi) in enumerate(itertools.pairwise(q_indptr)):
            if causal and hi - lo > kv_lengths[b]:
                continue  # more queries than keys: a shape the cache never asks for causally
            ref, ref_lse = _reference(q[lo:hi], keys[b], vals[b], causal)
            _close(out.numpy()[lo:hi], ref, dtype)
            assert np.abs(lse.numpy()[lo:hi] - ref_lse).max() <= 1e-3, (b, causal)


def test_paged_prefill_of_an_empty_cache_is_neutral(target):
    """A sequence with no cached keys yields what TVM's kernel yields: zeros and a log-sum-exp of
    -5e4, which the merge then weighs as nothing."""
    q = np.ones((3, 4, HEAD_DIM), "float32")
    pages = np.full((2, 2, 2, PAGE, HEAD_DIM), np.nan, "float32")
    kernel = _build(prefill_attention_kernel(2, 4, HEAD_DIM, "float32", paged=True, page_size=PAGE), target)
    out, lse = _t(np.full(q.shape, np.nan, "float32")), _t(np.full((3, 4), np.nan, "float32"))
    kernel(
        _t(q),
        _t(np.array([0, 3], "int32")),
        _t(pages),
        _t(np.array([0, 0], "int32")),
        _t(np.zeros(1, "int32")),
        _t(np.zeros(1, "int32")),
        _t(np.zeros(1, "int32")),
        _t(np.zeros(3, "int32")),
        out,
        lse,
        0,
        0,
        1.0,
        10000.0,
        1.0,
    )
    assert np.all(out.numpy() == 0) and np.all(lse.numpy() == -5e4)


def test_merge_state_matches_numpy(target):
    rng = np.random.default_rng(3)
    v, v_other = rng.standard_normal((2, 7, 3, HEAD_DIM)).astype("float32")
    s, s_other = (rng.standard_normal((2, 7, 3)) * 4).astype("float32")
    s_other[0, 0] = -5e4  # an empty partial result weighs nothing
    kernel = _build(merge_state_kernel("float32"), target)
    got_v, got_s = _t(v.copy()), _t(s.copy())
    kernel(got_v, got_s, _t(v_other), _t(s_other))
    w, w_other = np.exp2(s.astype(np.float64)), np.exp2(s_other.astype(np.float64))
    ref_v = (v * w[..., None] + v_other * w_other[..., None]) / (w + w_other)[..., None]
    assert np.abs(got_v.numpy() - ref_v).max() <= 1e-5
    assert np.abs(got_s.numpy() - np.log2(w + w_other)).max() <= 1e-5
    assert np.allclose(got_v.numpy()[0, 0], v[0, 0], atol=1e-6)


def test_fast_exp2_is_accurate(target):
    """The polynomial exp2 the softmax uses: within 2e-7 relative of numpy on [-126, 0], exactly 0
    below -126 (masked scores), 1 at 0."""
    from tvm.script import tirx as T

    n = 4096

    @T.prim_func(s_tir=True)
    def exp2(x: T.Buffer((n,), "float32"), y: T.Buffer((n,), "float32")):
        for i in T.vectorized(n):
            y[i] = fast_exp2(x[i])

    f = _build(exp2, target)
    x = np.concatenate([np.linspace(-126, 0, n - 4), [-126.5, -3e38, 0.0, -1e-3]]).astype("float32")
    y = _t(np.zeros(n, "float32"))
    f(_t(x), y)
    got, ref = y.numpy().astype(np.float64), np.exp2(x.astype(np.float64))
    assert np.all(np.abs(got[: n - 4] - ref[: n - 4]) <= 2e-7 * ref[: n - 4])
    assert got[n - 4] == 0 and got[n - 3] == 0 and got[n - 2] == 1.0


def _decode_case(rng, dtype, h_q, h_kv, lengths):
    pages, indptr, values, last, keys, vals = _paged_cache(rng, dtype, h_kv, lengths)
    q = rng.standard_normal((len(lengths), h_q, HEAD_DIM)).astype(dtype)
    return q, pages, indptr, values, last, keys, vals


def _run_decode(kernel, q, pages, indptr, values, length_info, rotary_mode=0, q_pos=None, k_offset=None):
    n = len(q)
    out = _t(np.full(q.shape, np.nan, q.dtype))
    lse = _t(np.full(q.shape[:2], np.nan, "float32"))
    zeros = np.zeros(n, "int32")
    kernel(
        _t(q),
        _t(pages),
        _t(indptr),
        _t(values),
        _t(length_info),
        _t(zeros if k_offset is None else k_offset),
        _t(zeros if q_pos is None else q_pos),
        out,
        lse,
        rotary_mode,
        1.0,
        10000.0,
        HEAD_DIM**-0.5,
    )
    return out.numpy(), lse.numpy()


# key counts: a single key, under a page, exactly a page, one past it, odd counts across many
# pages (a split boundary inside the run of full pages), a long context (the online softmax over
# hundreds of pages) and a sequence with no pages at all
DECODE_LENGTHS = [1, 7, 16, 17, 33, 255, 1500, 0]


@pytest.mark.parametrize(
    ("dtype", "wide", "h_q", "h_kv"),
    [
        *(("float32", True, h_q, h_kv) for h_q, h_kv in HEADS),
        ("float16", True, 6, 2),
        *(("float32", False, h_q, h_kv) for h_q, h_kv in HEADS[1:]),
    ],
)
def test_decode_matches_numpy(target, dtype, wide, h_q, h_kv):
    """One query per sequence, all of :data:`DECODE_LENGTHS` in one batch: the query heads of a KV
    head computed together, each sequence's pages split over the tasks and merged. ``wide=False``:
    8-lane vectors (AVX2 CPUs). A sequence without keys gives TVM's neutral result (zeros, a
    log-sum-exp of -5e4)."""
    rng = np.random.default_rng(4)
    q, pages, indptr, values, last, keys, vals = _decode_case(rng, dtype, h_q, h_kv, DECODE_LENGTHS)
    kernel = _build(decode_attention_kernel(h_kv, h_q, HEAD_DIM, dtype, False, PAGE, wide=wide), target)
    out, lse = _run_decode(kernel, q, pages, indptr, values, last)
    for b, n in enumerate(DECODE_LENGTHS):
        if n == 0:
            assert np.all(out[b] == 0) and np.all(lse[b] == -5e4)
            continue
        ref, ref_lse = _reference(q[b : b + 1], keys[b], vals[b], causal=False)
        _close(out[b : b + 1], ref, dtype)
        assert np.abs(lse[b] - ref_lse[0]).max() <= 1e-3, b


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_of_8k_keys_matches_numpy(target, splits):
    """8,193 keys (512 full pages and one key): the tasks' partial softmaxes merged, whatever the
    number of splits (one: no merge; three: uneven shares of the pages)."""
    rng = np.random.default_rng(5)
    lengths = [8193]
    q, pages, indptr, values, last, keys, vals = _decode_case(rng, "float32", 9, 3, lengths)
    q *= 4  # peaked softmaxes: the running maximum moves between pages and splits
    kernel = _build(decode_attention_kernel(3, 9, HEAD_DIM, "float32", False, PAGE, splits=splits), target)
    out, lse = _run_decode(kernel, q, pages, indptr, values, last)
    ref, ref_lse = _reference(q, keys[0], vals[0], causal=False)
    _close(out, ref, "float32")
    assert np.abs(lse - ref_lse).max() <= 1e-3


def test_decode_sliding_window_reads_the_sink_and_the_window(target):
    """The sliding-window variant: length_info holds (last page length, window offset, sink size);
    the query sees the sink's slots and the slots from the window offset on, not the ones between."""
    rng = np.random.default_rng(6)
    slots, sink, offset = 70, 4, 21  # slots 0..3 and 21..69 are attended
    pages, indptr, values, last, keys, vals = _paged_cache(rng, "float32", 2, [slots])
    q = rng.standard_normal((1, 6, HEAD_DIM)).astype("float32")
    length_info = np.array([[last[0]], [offset], [sink]], "int32")
    kernel = _build(decode_attention_kernel(2, 6, HEAD_DIM, "float32", True, PAGE), target)
    out, lse = _run_decode(kernel, q, pages, indptr, values, length_info)
    seen = np.r_[0:sink, offset:slots]
    ref, ref_lse = _reference(q, keys[0][seen], vals[0][seen], causal=False)
    _close(out, ref, "float32")
    assert np.abs(lse - ref_lse).max() <= 1e-3


def _rotate(x, positions):
    """TVM's RoPE (rotate-half, theta 10000, scale 1) of x [n, heads, D] at ``positions``."""
    half = HEAD_DIM // 2
    inv = 1.0 / 10000.0 ** (np.arange(half, dtype=np.float64) * 2 / HEAD_DIM)
    ang = np.asarray(positions, np.float64)[:, None, None] * np.concatenate([inv, inv])[None, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1).astype(np.float64)
    return x.astype(np.float64) * np.cos(ang) + rotated * np.sin(ang)


def test_decode_with_inline_rope_matches_numpy(target):
    """``rotary_mode == 1`` (RoPE inside attention): the query rotated at its position, every key
    at its own; full pages then take the key-at-a-time path too."""
    rng = np.random.default_rng(7)
    lengths = [40]
    q, pages, indptr, values, last, keys, vals = _decode_case(rng, "float32", 6, 2, lengths)
    q_pos, k_offset = np.array([45], "int32"), np.array([5], "int32")
    kernel = _build(decode_attention_kernel(2, 6, HEAD_DIM, "float32", False, PAGE), target)
    out, lse = _run_decode(kernel, q, pages, indptr, values, last, 1, q_pos, k_offset)
    k_rot = _rotate(keys[0], 5 + np.arange(40))
    ref, ref_lse = _reference(_rotate(q, q_pos), k_rot, vals[0], causal=False)
    _close(out, ref, "float32")
    assert np.abs(lse - ref_lse).max() <= 1e-3
