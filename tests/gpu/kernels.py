"""Cases for llmchat's CUDA kernels (app/inference/pipelines/cuda_kernels.cu), each checked against
numpy in float64.

A :class:`Case` builds, for a target, the PrimFunc that target runs: for CUDA llmchat's rule or pass
applied to the function TVM's passes make (it must take it: the build fails otherwise), for the CPU
TVM's own function (unscheduled TE, or TVM's CPU kernel of the same signature). Its :class:`Run`\\ s
are inputs with a check of the outputs. :func:`build` compiles every case of a list into one module
(one nvcc run, as the engine's build: the fatbin hooks of ``cuda_support``, exported and loaded
again); :func:`run_all` runs them. The GPU suite (tests/gpu/test_cuda_kernels.py) runs the CUDA
side on a GPU; tests/gpu/test_harness_on_cpu.py runs the same cases' CPU side here, which checks the
inputs, the argument order and the numpy references.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import tvm

from app.inference.pipelines import cpu_attention, cuda_attention, cuda_silu_gate
from app.inference.pipelines.cuda_argmax import CudaArgmax
from app.inference.pipelines.cuda_gemm import CudaQ4Gemm
from app.inference.pipelines.cuda_gemv import CudaQ4Gemv
from app.inference.pipelines.cuda_rms_norm import CudaRmsNorm, reference_rms_norm
from app.inference.pipelines.gpu_choices import use_cuda_gemm_mma
from app.inference.quantization import get_format
from app.inference.quantization.base import dequant_matmul_te
from tests.inference.reference import dequant_q4

PAGE = 16
#: relative tolerance (of the largest expected value) for float16 matmul outputs; a wrong nibble,
#: scale or row gives errors of the order of the values themselves
MATMUL_TOL = 5e-3


@dataclass
class Run:
    """One call: ``args`` (numpy arrays: inputs, then zeroed outputs; and scalars), the indices
    of the outputs in ``args``, and ``check(outputs)``, which asserts."""

    label: str
    args: list[Any]
    outputs: tuple[int, ...]
    check: Callable[[list[np.ndarray]], None]


@dataclass
class Case:
    """A kernel's function (``build(target)``) and its runs, made when first asked for (their
    references cost time: only the cases that run pay for them)."""

    name: str
    build: Callable[[Any], Any]  # target -> PrimFunc
    run_makers: list[Callable[[], Run]] = field(default_factory=list)
    _runs: list[Run] | None = None

    @property
    def runs(self) -> list[Run]:
        if self._runs is None:
            self._runs = [make() for make in self.run_makers]
        return self._runs


def is_cuda(target: Any) -> bool:
    return target.kind.name == "cuda"


def _replaced(rule: Any, func: Any, target: Any) -> Any:
    """``func`` as llmchat's dlight-style ``rule`` schedules it on ``target`` (which must take it)."""
    sch = rule.apply(func, target, False)
    assert sch is not None, f"{type(rule).__name__} did not take the function"
    return sch.mod["main"]


def _close(got: np.ndarray, expected: np.ndarray, tol: float, what: str) -> None:
    got64 = got.astype(np.float64)
    assert np.isfinite(got64).all(), f"{what}: not finite"
    err = np.abs(got64 - expected).max()
    scale = max(1.0, np.abs(expected).max())
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol * scale:.3e}"


# ------------------------------------------------------------------------------------------------
# q4f16_1 matmuls: decode GEMV (1), its SiLU-gated pairs (MODE 3), prompt GEMM (4)
# ------------------------------------------------------------------------------------------------
def q4_weights(n: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random ``[n, k]`` matrix in MLC's q4f16_1 layout (uint32 words of 8 nibbles, a float16
    scale per 32 columns): every nibble 0..15 (15 too, which quantizing never writes), scales of
    the size quantized Gaussian weights have. Drawn directly: quantizing a float64 matrix of the
    largest layers took minutes of the GPU run's CPU time."""
    words = rng.integers(0, 1 << 32, size=(n, k // 8), dtype=np.uint32)
    scales = (rng.uniform(0.5, 1.5, size=(n, -(-k // 32))) / (2.5 * np.sqrt(k))).astype(np.float16)
    return words, scales


def q4_matmul64(x: np.ndarray, w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``x [m, k] @ dequant(w, s).T`` in float64, a few thousand rows of the weight at a time."""
    out = np.empty((x.shape[0], w.shape[0]))
    x64 = x.astype(np.float64)
    for r in range(0, w.shape[0], 4096):
        out[:, r : r + 4096] = x64 @ dequant_q4(w[r : r + 4096], s[r : r + 4096]).T
    return out


def q4_matmul_func(k: int, n: int, epilogue: str, rows: Any = 1) -> Any:
    """The fused PrimFunc the engine makes for one linear layer: ``epilogue`` f32 (float32 out),
    f16, bias (float16 bias, then the cast) or res (float16 residual added after the cast);
    ``rows`` 1 is decode, a shape variable a prompt. Parameters: x, weight, scale, [bias], [res], out."""
    from tvm import te

    fmt = get_format("q4f16_1")
    specs = fmt.param_specs(n, k)
    x = te.placeholder((1, rows, k), "float16", name="x")
    args = [x, *(te.placeholder(shape, dtype, name=name) for name, (shape, dtype) in specs.items())]
    if epilogue == "bias":
        args.append(te.placeholder((n,), "float16", name="bias"))
    out = dequant_matmul_te(fmt, list(specs), k, n, "float32" if epilogue == "f32" else "float16")(*args)
    if epilogue == "res":
        res = te.placeholder((1, rows, n), "float16", name="res")
        args.append(res)
        out = te.compute(out.shape, lambda a, b, c: res[a, b, c] + out[a, b, c], name="T_add")
    return te.create_prim_func([*args, out])


def _matmul_run(k: int, n: int, epilogue: str, m: int, seed: int) -> Run:
    rng = np.random.default_rng(seed)
    w, s = q4_weights(n, k, rng)
    x = rng.standard_normal((1, m, k)).astype(np.float16)
    expected = q4_matmul64(x[0], w, s)[None]
    args: list[Any] = [x, w, s]
    if epilogue == "bias":
        bias = rng.standard_normal(n).astype(np.float16)
        args.append(bias)
        expected = expected + bias.astype(np.float64)
    if epilogue == "res":
        res = rng.standard_normal((1, m, n)).astype(np.float16)
        args.append(res)
        expected = expected + res.astype(np.float64)
    args.append(np.zeros((1, m, n), np.float32 if epilogue == "f32" else np.float16))

    def check(outs: list[np.ndarray]) -> None:
        _close(outs[0], expected, MATMUL_TOL, f"q4 matmul k={k} n={n} {epilogue} rows={m}")

    return Run(f"rows={m}", args, (len(args) - 1,), check)


def gemv_case(k: int, n: int, epilogue: str, seed: int = 0) -> Case:
    """``llmchat::q4f16_gemv`` (decode: one row)."""

    def build(target: Any) -> Any:
        func = q4_matmul_func(k, n, epilogue)
        return _replaced(CudaQ4Gemv(), func, target) if is_cuda(target) else func

    return Case(f"gemv_{k}x{n}_{epilogue}", build, [partial(_matmul_run, k, n, epilogue, 1, seed)])


def gemm_case(k: int, n: int, epilogue: str, rows: tuple[int, ...], seed: int = 0) -> Case:
    """``llmchat::q4f16_gemm`` and, for wide layers and prompts long enough on sm_80 and later,
    ``llmchat::q4f16_gemm_mma`` (a prompt of any length: one build, a run per length)."""

    def build(target: Any) -> Any:
        func = q4_matmul_func(k, n, epilogue, rows=tvm.te.var("seq_len", "int64"))
        if not is_cuda(target):
            return func
        # the engine's choice: the mma.sync kernel for wide layers and long prompts from sm_80
        return _replaced(CudaQ4Gemm(mma=use_cuda_gemm_mma(target)), func, target)

    return Case(
        f"gemm_{k}x{n}_{epilogue}", build, [partial(_matmul_run, k, n, epilogue, m, seed + m) for m in rows]
    )


def _silu_gate_te(k: int, n: int) -> Any:
    """TE of the decode MLP's gate_up GEMV (float16 out) then silu(gate) * up, for the CPU."""
    from tvm import te

    fmt = get_format("q4f16_1")
    specs = fmt.param_specs(2 * n, k)
    x = te.placeholder((1, 1, k), "float16", name="x")
    weights = [te.placeholder(shape, dtype, name=name) for name, (shape, dtype) in specs.items()]
    h = dequant_matmul_te(fmt, list(specs), k, 2 * n, "float16")(x, *weights)
    out = te.compute(
        (1, 1, n),
        lambda a, b, c: h[a, b, c] * tvm.tirx.sigmoid(h[a, b, c]) * h[a, b, c + n],
        name="silu_gate",
    )
    return te.create_prim_func([x, *weights, out])


def silu_gate_case(k: int, n: int, seed: int = 0) -> Case:
    """``llmchat::q4f16_gemv`` in MODE 3: ``silu(gate) * up`` of a fused gate_up projection
    (``2n`` rows: gate, then up) written as ``n`` values (cuda_silu_gate.py)."""

    def build(target: Any) -> Any:
        if not is_cuda(target):
            return _silu_gate_te(k, n)
        out = cuda_silu_gate.reference_silu_gate(n).params[-1]
        func = cuda_silu_gate.silu_gate_func(q4_matmul_func(k, 2 * n, "f16"), out)
        assert func is not None, "silu_gate_func did not take the GEMV"
        return func

    def run() -> Run:
        rng = np.random.default_rng(seed)
        w, s = q4_weights(2 * n, k, rng)
        x = rng.standard_normal((1, 1, k)).astype(np.float16)
        h = q4_matmul64(x[0], w, s)[0].astype(np.float16).astype(np.float64)  # the GEMV's float16 outputs
        gate, up = h[:n], h[n:]
        expected = (gate / (1 + np.exp(-gate)) * up)[None, None]

        def check(outs: list[np.ndarray]) -> None:
            _close(outs[0], expected, MATMUL_TOL, f"silu gate k={k} n={n}")

        return Run("one row", [x, w, s, np.zeros((1, 1, n), np.float16)], (3,), check)

    return Case(f"silu_gate_{k}x{n}", build, [run])


# ------------------------------------------------------------------------------------------------
# greedy argmax (3) and decode RMSNorm (6)
# ------------------------------------------------------------------------------------------------
def argmax_case(vocab: int, seed: int = 0) -> Case:
    """``llmchat::argmax_f32<V>``: numpy's argmax exactly (the first index on ties)."""
    from app.inference.compile.device_ops import argmax_te

    def build(target: Any) -> Any:
        x = tvm.te.placeholder((1, 1, vocab), "float32", name="logits")
        func = tvm.te.create_prim_func([x, argmax_te(x)])
        return _replaced(CudaArgmax(), func, target) if is_cuda(target) else func

    rng = np.random.default_rng(seed)
    rows = {
        "random": rng.standard_normal(vocab) * 5,
        "ties: the first of equal maxima": np.r_[np.zeros(vocab // 2), 7.0, np.zeros(vocab - vocab // 2 - 1)],
        "all equal": np.full(vocab, -3.5),
        "maximum last": np.r_[np.full(vocab - 1, -1e30), 1e-30],
        "large negative with -inf": np.r_[np.full(vocab - 1, -np.inf), -1e38][::-1],
    }
    if vocab > 2:
        tied = rng.standard_normal(vocab)
        tied[[vocab // 3, vocab - 1]] = tied.max() + 1.0
        rows["ties far apart"] = tied

    def run(label: str, row: np.ndarray) -> Run:
        logits = row.astype(np.float32).reshape(1, 1, vocab)
        expected = int(np.argmax(logits))

        def check(outs: list[np.ndarray]) -> None:
            assert int(outs[0][0]) == expected, f"argmax<{vocab}> {label}: {int(outs[0][0])} != {expected}"

        return Run(label, [logits, np.full(1, -1, np.int32)], (1,), check)

    return Case(f"argmax_{vocab}", build, [partial(run, label, row) for label, row in rows.items()])


def rms_norm_case(k: int, eps: float, seed: int = 0) -> Case:
    """``llmchat::rms_norm_row<K>``: numpy's float64 RMSNorm, on ordinary rows and on rows so
    small that the epsilon weighs as much as their mean square."""

    def build(target: Any) -> Any:
        func = reference_rms_norm(k, eps)
        if not is_cuda(target):
            return func
        new = CudaRmsNorm().replace(func)
        assert new is not None, "CudaRmsNorm did not take TVM's rms_norm"
        return new.with_attr("tirx.is_scheduled", True)

    rng = np.random.default_rng(seed)
    w = (1 + 0.5 * rng.standard_normal(k)).astype(np.float16)

    def run(scale: float) -> Run:
        x = (scale * rng.standard_normal((1, 1, k))).astype(np.float16)
        x64 = x.astype(np.float64)
        expected = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w.astype(np.float64)

        def check(outs: list[np.ndarray]) -> None:
            _close(outs[0], expected, 4e-3, f"rms_norm<{k}> scale {scale:.1e}")

        return Run(f"scale {scale:.1e}", [x, w, np.zeros((1, 1, k), np.float16)], (2,), check)

    return Case(f"rms_norm_{k}", build, [partial(run, 3.0), partial(run, 3 * np.sqrt(eps))])


# ------------------------------------------------------------------------------------------------
# attention: decode over the paged KV cache (2), a prompt over its own keys and over the cached
# pages (5)
# ------------------------------------------------------------------------------------------------
def paged_kv(lengths: list[int], h_kv: int, d: int, rng: np.random.Generator, spare: int = 3):
    """Pages ``[pages, 2 (K, V), kv head, slot, dim]`` holding sequences of ``lengths`` keys, each
    in pages scattered over the pool; (pages, indptr, values, last page lengths)."""
    per_seq = [-(-n // PAGE) for n in lengths]
    total = sum(per_seq) + spare
    pages = rng.standard_normal((total, 2, h_kv, PAGE, d)).astype(np.float16)
    order = rng.permutation(total).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(per_seq)]).astype(np.int32)
    values = np.ascontiguousarray(order[: indptr[-1]])
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lengths, per_seq, strict=True)], np.int32)
    return pages, indptr, values, last


def _softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, sm_scale: float):
    """float64 attention of ``q [d]`` over ``k, v [n, d]`` where ``visible``; (output, lse in log2)."""
    s = np.where(visible, k @ q * sm_scale, -np.inf)
    m = s.max()
    p = np.exp(s - m)
    return p @ v / p.sum(), (m + np.log(p.sum())) / np.log(2)


def decode_reference(q, pages, indptr, values, lengths, sm_scale):
    """Outputs ``[batch, h_q, d]`` and lse ``[batch, h_q]`` (log2 domain, as TVM's kernels)."""
    batch, h_q, d = q.shape
    h_kv = pages.shape[2]
    out, lse = np.zeros(q.shape), np.zeros((batch, h_q))
    for b, n in enumerate(lengths):
        seq = values[indptr[b] : indptr[b + 1]]
        k = pages[seq, 0].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :n].astype(np.float64)
        v = pages[seq, 1].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :n].astype(np.float64)
        for h in range(h_q):
            g = h // (h_q // h_kv)
            out[b, h], lse[b, h] = _softmax_attention(
                q[b, h].astype(np.float64), k[g], v[g], np.ones(n, bool), sm_scale
            )
    return out, lse


def decode_attention_case(
    h_q: int,
    h_kv: int,
    d: int,
    batches: list[list[int]],
    max_cluster: int = 0,
    seed: int = 0,
    gqa: str = "auto",
    gqa_min_keys: int = 0,
) -> Case:
    """``llmchat::decode_attention`` in place of TVM's ``batch_decode_paged_kv``: chunks merged
    through global memory (``max_cluster`` 0) or in a thread-block cluster (sm_90), and there for
    grouped-query shapes the long-context kernels picked by ``gqa`` / ``gqa_min_keys`` (named in the
    case unless the defaults: they are part of the prebuilt cache's case list); one build, a run
    per batch of sequence lengths. The CPU runs llmchat's CPU kernel of the same signature."""

    def build(target: Any) -> Any:
        from tvm.relax.frontend.nn.llm.kv_cache import _attention_decode

        if not is_cuda(target):
            return cpu_attention.decode_attention_kernel(h_kv, h_q, d, "float16", False, PAGE)
        func = cuda_attention.split_decode_attention(
            _attention_decode(h_kv, h_q, d, "float16", False, {}, target), max_cluster, gqa, gqa_min_keys
        )
        assert func is not None, "split_decode_attention did not take TVM's decode attention"
        return func

    rng = np.random.default_rng(seed)
    sm_scale = d**-0.5

    def run(lengths: list[int]) -> Run:
        pages, indptr, values, last = paged_kv(lengths, h_kv, d, rng)
        q = rng.standard_normal((len(lengths), h_q, d)).astype(np.float16)
        expected, expected_lse = decode_reference(q, pages, indptr, values, lengths, sm_scale)
        zeros = np.zeros(len(lengths), np.int32)
        label = f"keys {lengths}" if len(lengths) <= 4 else f"{len(lengths)} sequences"

        def check(outs: list[np.ndarray]) -> None:
            _close(outs[0], expected, 2e-3, f"decode attention ({h_q}, {h_kv}, {d}) {label}: output")
            _close(outs[1], expected_lse, 1e-3, f"decode attention ({h_q}, {h_kv}, {d}) {label}: lse")

        args = [
            q,
            pages,
            indptr,
            values,
            last,
            zeros,
            zeros,
            np.zeros(q.shape, np.float16),
            np.zeros(q.shape[:2], np.float32),
            0,
            1.0,
            10000.0,
            sm_scale,
        ]
        return Run(label, args, (7, 8), check)

    kind = f"cluster{max_cluster}" if max_cluster else "global"
    if (gqa, gqa_min_keys) != ("auto", 0):
        kind += f"_gqa_{gqa}_{gqa_min_keys}"
    return Case(f"decode_attention_{h_q}_{h_kv}_{d}_{kind}", build, [partial(run, b) for b in batches])


def prefill_reference(q, k, v, q_lens, kv_lens, causal, sm_scale):
    """Ragged prompt attention: sequence ``b``'s rows see its own keys (causal: row r the first
    kv_len - q_len + r + 1 of them). Outputs ``[rows, h_q, d]`` and lse ``[rows, h_q]`` (log2)."""
    h_q, h_kv = q.shape[1], k.shape[1]
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    q0 = k0 = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        keys = k[k0 : k0 + kv_len].astype(np.float64)
        vals = v[k0 : k0 + kv_len].astype(np.float64)
        for r in range(q_len):
            visible = np.arange(kv_len) < (kv_len - q_len + r + 1 if causal else kv_len)
            for h in range(h_q):
                g = h // (h_q // h_kv)
                out[q0 + r, h], lse[q0 + r, h] = _softmax_attention(
                    q[q0 + r, h].astype(np.float64), keys[:, g], vals[:, g], visible, sm_scale
                )
        q0, k0 = q0 + q_len, k0 + kv_len
    return out, lse


def prefill_attention_case(
    h_q: int, h_kv: int, d: int, batches: list[tuple[list[int], list[int], bool]], seed: int = 0
) -> Case:
    """``llmchat::prefill_attention`` in place of TVM's ``batch_prefill_ragged_kv`` (sm_80): one
    build, a run per (query lengths, key lengths, causal). The CPU runs TVM's CPU kernel."""

    def build(target: Any) -> Any:
        from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged_cpu
        from tvm.relax.frontend.nn.llm.kv_cache import _attention_prefill_ragged

        if not is_cuda(target):
            return _attention_prefill_ragged_cpu(h_kv, h_q, d, d, "float16", {})
        tvm_func = _attention_prefill_ragged(h_kv, h_q, d, d, "float16", {}, target)
        func = cuda_attention.prefill_attention(tvm_func)
        assert func is not None, "prefill_attention did not take TVM's prompt attention"
        return func

    rng = np.random.default_rng(seed)
    sm_scale = d**-0.5

    def run(q_lens: list[int], kv_lens: list[int], causal: bool) -> Run:
        rows, keys = sum(q_lens), sum(kv_lens)
        q = rng.standard_normal((rows, h_q, d)).astype(np.float16)
        k = rng.standard_normal((keys, h_kv, d)).astype(np.float16)
        v = rng.standard_normal((keys, h_kv, d)).astype(np.float16)
        q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        expected, expected_lse = prefill_reference(q, k, v, q_lens, kv_lens, causal, sm_scale)
        label = f"queries {q_lens}, keys {kv_lens}, {'causal' if causal else 'not causal'}"

        def check(outs: list[np.ndarray]) -> None:
            _close(outs[0], expected, 4e-3, f"prefill attention ({h_q}, {h_kv}, {d}) {label}: output")
            _close(outs[1], expected_lse, 2e-3, f"prefill attention ({h_q}, {h_kv}, {d}) {label}: lse")

        args = [
            q,
            q_indptr,
            k,
            v,
            kv_indptr,
            np.zeros(rows, np.int32),
            np.zeros(len(q_lens), np.int32),
            np.zeros(q.shape, np.float16),
            np.zeros((rows, h_q), np.float32),
            int(causal),
            0,
            1.0,
            10000.0,
            sm_scale,
        ]
        return Run(label, args, (7, 8), check)

    return Case(f"prefill_attention_{h_q}_{h_kv}_{d}", build, [partial(run, *b) for b in batches])


def paged_prefill_reference(q, pages, indptr, values, q_lens, kv_lens, causal, sm_scale):
    """A prompt chunk's attention to the keys in the paged cache (TVM's ``batch_prefill_paged_kv``):
    sequence ``b``'s ``q_lens[b]`` rows see its ``kv_lens[b]`` cached keys (causal: row r the first
    kv_len - q_len + r + 1). Outputs ``[rows, h_q, d]`` and lse ``[rows, h_q]`` (log2), float64;
    a sequence without keys gives TVM's zeros and lse -5e4. Vectorised per (sequence, head)."""
    h_q, d = q.shape[1], q.shape[2]
    h_kv = pages.shape[2]
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    q0 = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        rows = slice(q0, q0 + q_len)
        q0 += q_len
        if q_len == 0:
            continue
        if kv_len == 0:
            lse[rows] = -5e4
            continue
        seq = values[indptr[b] : indptr[b + 1]]
        k = pages[seq, 0].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :kv_len].astype(np.float64)
        v = pages[seq, 1].transpose(1, 0, 2, 3).reshape(h_kv, -1, d)[:, :kv_len].astype(np.float64)
        limit = kv_len - q_len + np.arange(q_len)[:, None] + 1 if causal else np.full((q_len, 1), kv_len)
        visible = np.arange(kv_len)[None, :] < limit
        assert visible.any(axis=1).all(), "every row must see a key (the reference has no empty rows)"
        for h in range(h_q):
            g = h // (h_q // h_kv)
            s = np.where(visible, q[rows, h].astype(np.float64) @ k[g].T * sm_scale, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True)
            out[rows, h] = p @ v[g] / total
            lse[rows, h] = (m + np.log(total))[:, 0] / np.log(2)
    return out, lse


def paged_prefill_attention_case(
    h_q: int,
    h_kv: int,
    d: int,
    batches: list[tuple[list[int], list[int], bool]],
    pipelined: bool = False,
    seed: int = 0,
) -> Case:
    """``llmchat::prefill_paged_attention`` in place of TVM's ``batch_prefill_paged_kv`` (sm_80),
    its key tiles loaded through registers or (``pipelined``) by cp.async: one build, a run per
    (query lengths, cached key lengths, causal); the pages of each sequence scattered over the
    pool, its last page partly full. The CPU runs TVM's CPU kernel."""

    def build(target: Any) -> Any:
        from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_cpu
        from tvm.relax.frontend.nn.llm.kv_cache import _attention_prefill

        if not is_cuda(target):
            return _attention_prefill_cpu(h_kv, h_q, d, "float16", False, {}, page_size=PAGE)
        tvm_func = _attention_prefill(h_kv, h_q, d, "float16", False, {}, target, page_size=PAGE)
        func = cuda_attention.prefill_paged_attention(tvm_func, pipelined)
        assert func is not None, "prefill_paged_attention did not take TVM's paged prompt attention"
        return func

    rng = np.random.default_rng(seed)
    sm_scale = d**-0.5

    def run(q_lens: list[int], kv_lens: list[int], causal: bool) -> Run:
        rows = sum(q_lens)
        pages, indptr, values, last = paged_kv(kv_lens, h_kv, d, rng)
        q = rng.standard_normal((rows, h_q, d)).astype(np.float16)
        q_indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        expected, expected_lse = paged_prefill_reference(
            q, pages, indptr, values, q_lens, kv_lens, causal, sm_scale
        )
        label = f"queries {q_lens}, cached keys {kv_lens}, {'causal' if causal else 'not causal'}"

        def check(outs: list[np.ndarray]) -> None:
            what = f"paged prefill attention ({h_q}, {h_kv}, {d}) {label}"
            _close(outs[0], expected, 4e-3, f"{what}: output")
            _close(outs[1], expected_lse, 2e-3, f"{what}: lse")

        args = [
            q,
            q_indptr,
            pages,
            indptr,
            values,
            last,
            np.zeros(len(q_lens), np.int32),
            np.zeros(rows, np.int32),
            np.zeros(q.shape, np.float16),
            np.zeros((rows, h_q), np.float32),
            int(causal),
            0,
            1.0,
            10000.0,
            sm_scale,
        ]
        return Run(label, args, (8, 9), check)

    kind = "async" if pipelined else "sync"
    return Case(
        f"paged_prefill_attention_{h_q}_{h_kv}_{d}_{kind}", build, [partial(run, *b) for b in batches]
    )


# ------------------------------------------------------------------------------------------------
# build and run
# ------------------------------------------------------------------------------------------------
def compile_cuda(cases: list[Case], target: Any, path: Path) -> Path:
    """Every case's function (named after the case) for the CUDA ``target``, its kernels compiled
    by nvcc into a fatbin (required: the library needs no compiler to load), exported to ``path``.
    Needs TVM's compiler, no GPU (``make gpu-cache`` runs this ahead of the GPU run)."""
    from app.inference.compile import cuda_support

    funcs = {case.name: case.build(target).with_attr("global_symbol", case.name) for case in cases}
    mod = tvm.IRModule(funcs)
    with cuda_support.cuda_build_hooks(target, require=True) as info, tvm.transform.PassContext(opt_level=3):
        executable = tvm.compile(mod, target)
    assert info["compiled"] == 1
    source = info["sources"][0]
    assert "namespace llmchat" in source  # llmchat's kernels went in
    path.parent.mkdir(parents=True, exist_ok=True)
    executable.export_library(str(path))
    return path


def build(cases: list[Case], target: Any, workdir: Path) -> Any:
    """One module with every case's function for ``target``. CUDA: :func:`compile_cuda`, the
    library loaded as the engine loads its own."""
    if not is_cuda(target):
        funcs = {case.name: case.build(target).with_attr("global_symbol", case.name) for case in cases}
        return tvm.compile(tvm.IRModule(funcs), target)
    from app.inference.compile import cuda_support

    return cuda_support.load_cuda_library(compile_cuda(cases, target, workdir / "kernels.so"))


def run_all(lib: Any, cases: list[Case], device: Any) -> list[str]:
    """Run every case's runs; the failures, as messages (all of them, not just the first)."""
    failures = []
    for case in cases:
        func = lib[case.name]
        for run in case.runs:
            args = [
                tvm.runtime.tensor(a, device=device) if isinstance(a, np.ndarray) else a for a in run.args
            ]
            try:
                func(*args)
                run.check([args[i].numpy() for i in run.outputs])
            except AssertionError as err:
                failures.append(f"{case.name} [{run.label}]: {err}")
    return failures
