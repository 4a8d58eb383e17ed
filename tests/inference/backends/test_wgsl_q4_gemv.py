"""llmchat's WGSL q4f16_1 decode GEMV (app/inference/pipelines/wgsl_q4_gemv.py) on a real Vulkan
driver (lavapipe in CI) against float64 numpy: every epilogue the models make, rows and groups
that leave lanes idle, both decodes; and which functions the rule takes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.kernels import MATMUL_TOL, _close, _matmul_run, q4_matmul64, q4_matmul_func
from tests.inference.backends.vulkan_env import need_vulkan


def _layout(name: str):
    from app.inference.pipelines import wgsl_q4_gemv

    layout = wgsl_q4_gemv.parse(name)
    assert layout is not None, name
    return layout


def _run_on_vulkan(func, args, tmp_path, name="gemv"):
    import tvm

    from app.inference.backends import webgpu

    target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile="wgsl-f16-wg32768-t256"))
    lib = tvm.compile(tvm.IRModule({name: func.with_attr("global_symbol", name)}), target=target)
    lib.export_library(str(tmp_path / f"{name}.so"))
    lib = tvm.runtime.load_module(str(tmp_path / f"{name}.so"))
    dev = webgpu.device(0)
    tensors = [tvm.runtime.tensor(a, dev) for a in args]
    lib[name](*tensors)
    return tensors[-1].numpy()


def _int8_rounded(x: np.ndarray, width: int = 32) -> np.ndarray:
    """``x`` (float16) as the dp4a kernel sees it, in float64: per ``width`` values, max|x| / 127
    steps, rounded half to even (WGSL's ``round``)."""
    x64 = x.astype(np.float32).reshape(-1, width)
    amax = np.abs(x64).max(axis=1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.round(x64 * inv)
    return (q.astype(np.float64) * (amax.astype(np.float64) / 127)).reshape(x.shape)


CASES = [
    # k, n, epilogue, layout: groups a multiple of the lanes, and not (11008 / 32 = 344 groups)
    (4096, 256, "f16", "q4-r4-l32-t256"),
    (4096, 128, "res", "q4-r2-l64-t256"),
    (896, 128, "bias", "q4-r4-l32-t128"),
    (11008, 64, "res", "q4-r4-l64-t256"),
    (2048, 512, "f32", "q4-r4-l32-t256"),
    (4096, 256, "f16", "q4-r4-l32-t256-f32"),
    (11008, 64, "bias", "q4-r2-l128-t256-f32"),
    (4096, 256, "res", "q4-r4-l32-t256-dp4a"),
    (11008, 64, "f16", "q4-r4-l64-t256-dp4a"),
    (896, 128, "bias", "q4-r2-l32-t128-dp4a"),
    (2048, 512, "f32", "q4-r4-l32-t256-dp4a"),
    (4096, 256, "res", "q4-r4-l32-t256-dp4a2"),
    (11008, 64, "bias", "q4-r2-l32-t64-dp4a2"),
    # the next step's weights loaded ahead: an even and an odd number of steps, a partial last one
    (4096, 256, "f16", "q4-r4-l32-t256-dp4a-pf"),
    (11008, 64, "res", "q4-r1-l64-t256-dp4a-pf"),
    (2048, 64, "bias", "q4-r1-l64-t64-dp4a-pf"),
    # the first steps' weights loaded before the staging: all of them (4 steps), 3 of 11, 2 of 2
    (4096, 256, "res", "q4-r4-l32-t256-dp4a-pre4"),
    (11008, 64, "f16", "q4-r2-l32-t256-dp4a-pre3"),
    (2048, 64, "bias", "q4-r1-l32-t64-dp4a-pre2"),
]


@pytest.mark.parametrize(
    ("k", "n", "epilogue", "name"), CASES, ids=[f"{c[0]}x{c[1]}-{c[2]}-{c[3]}" for c in CASES]
)
def test_q4_gemv_matches_float64_on_vulkan(k, n, epilogue, name, tmp_path):
    need_vulkan()
    from app.inference.pipelines.wgsl_q4_gemv import WgslQ4Gemv

    func = q4_matmul_func(k, n, epilogue)
    new = WgslQ4Gemv(_layout(name)).kernel(func)
    assert new is not None, "the rule did not take the GEMV"
    run = _matmul_run(k, n, epilogue, 1, seed=k + n)
    if "-dp4a" in name and "-dp4a2" not in name:
        # the kernel's own arithmetic: the activations rounded to int8 per 32 values; the same
        # rounding here, then the float64 reference of that input
        x, w, s = run.args[:3]
        expected = q4_matmul64(_int8_rounded(x)[0], w, s)[None]
        for extra in run.args[3:-1]:
            expected = expected + extra.astype(np.float64)

        def run_check(outs):
            _close(outs[0], expected, MATMUL_TOL, f"dp4a {name} k={k} n={n} {epilogue}")
    else:
        run_check = run.check
    got = _run_on_vulkan(new, run.args, tmp_path)
    run_check([got])
    # a wrong row, nibble or scale is far outside the tolerance: the check can fail
    bad = got.copy()
    bad[0, 0, 1] += np.float32(0.05) * max(1.0, float(np.abs(got).max()))
    with pytest.raises(AssertionError):
        run_check([bad])


def test_rule_takes_only_what_tiles_and_keeps_parameter_order():
    from app.inference.pipelines.wgsl_q4_gemv import WgslQ4Gemv

    rule = WgslQ4Gemv(_layout("q4-r4-l32-t256"))  # 32 rows per workgroup
    assert rule.kernel(q4_matmul_func(4096, 48, "f16")) is None  # 48 rows do not tile
    assert rule.kernel(q4_matmul_func(4096, 64, "f16", rows=1)) is not None
    assert (
        WgslQ4Gemv(_layout("q4-r4-l32-t256"), min_rows=4096).kernel(q4_matmul_func(4096, 64, "f16")) is None
    )
    func = q4_matmul_func(896, 64, "bias")
    new = rule.kernel(func)
    assert [tuple(int(d) for d in p.shape) for p in new.params] == [
        tuple(int(d) for d in p.shape) for p in func.params
    ]
    assert [str(p.dtype) for p in new.params] == [str(p.dtype) for p in func.params]


@pytest.mark.parametrize(
    "name",
    [
        "q4-r4-l32-t256",
        "q4-r2-l128-t256-f32",
        "q4-r4-l64-t256-dp4a",
        "q4-r1-l64-t256-dp4a-pf",
        "q4-r4-l32-t256-dp4a-pre4",
    ],
)
def test_layout_names_round_trip(name):
    assert _layout(name).name == name


@pytest.mark.parametrize(
    "name",
    [
        "q4-r4-l32",
        "q4-r4-l48-t256",
        "q4-r4-l32-t512",
        "q4-x4-l32-t256",
        "q4-r4-l32-t256-f8",
        "q4-r4-l32-t256-dp4a-f32",
        "q4-r4-l32-t256-kmax",
        "q4-r4-l32-t256-pf",  # a prefetch for the int8 kernels only
        "q4-r4-l32-t256-pre2",  # a preload too
        "q4-r4-l32-t256-dp4a-pre9",
        "q4-r4-l32-t256-dp4a-pf-pre2",  # one or the other
    ],
)
def test_bad_layout_names_are_refused(name):
    from app.inference.pipelines import wgsl_q4_gemv

    assert wgsl_q4_gemv.parse(name) is None


def test_rule_limits_from_the_name_and_the_automatic_choice():
    from app.inference.pipelines import wgsl_gemv, wgsl_q4_gemv

    layout, min_rows, max_k = wgsl_q4_gemv.parse_rule("q4-r4-l32-t256-dp4a-nmin4096-kmax8191")
    assert (layout.name, min_rows, max_k) == ("q4-r4-l32-t256-dp4a", 4096, 8191)
    limited = wgsl_gemv.rule("q4-r4-l32-t256-dp4a-nmin4096-kmax8191")
    assert limited.kernel(q4_matmul_func(4096, 4096, "f16")) is not None
    assert limited.kernel(q4_matmul_func(4096, 2048, "f16")) is None  # under 4096 rows
    assert limited.kernel(q4_matmul_func(11008, 4096, "f16")) is None  # K over 8191
    # q4-auto: int8 dot4 in 256-thread workgroups, the most rows a set that still gives 256
    # workgroups (else the fewest rows), up to K 16384 and the workgroup memory given
    assert wgsl_q4_gemv.choose(4096, 12288).name == "q4-r4-l32-t256-dp4a"  # 384 workgroups
    assert wgsl_q4_gemv.choose(4096, 22016).name == "q4-r4-l32-t256-dp4a"
    assert wgsl_q4_gemv.choose(11008, 4096).name == "q4-r2-l32-t256-dp4a"  # 256 of 16 rows
    assert wgsl_q4_gemv.choose(11008, 2048).name == "q4-r1-l32-t256-dp4a"  # 256 of 8 rows
    assert wgsl_q4_gemv.choose(896, 1152).name == "q4-r1-l32-t256-dp4a"  # 144: as many as it gets
    assert wgsl_q4_gemv.choose(4096, 48).name == "q4-r1-l32-t256-dp4a"
    assert wgsl_q4_gemv.choose(16416, 4096) is None  # K over 16384
    need = wgsl_q4_gemv.shared_bytes(wgsl_q4_gemv.Q4GemvLayout(2, 32, 256, "dp4a"), 11008)
    assert 16384 < need <= 32768
    assert wgsl_q4_gemv.choose(11008, 4096, max_shared=need).name == "q4-r2-l32-t256-dp4a"
    # less memory: 1 row a set (smaller partial sums), then none
    assert wgsl_q4_gemv.choose(11008, 4096, max_shared=need - 1).name == "q4-r1-l32-t256-dp4a"
    assert wgsl_q4_gemv.choose(11008, 4096, max_shared=16384) is None
    assert wgsl_q4_gemv.choose(4096, 36) is None  # no layout tiles 36 rows


FUSED_CASES = [
    # k, n (the GEMV's rows: gate and up with the SiLU gate), epilogue, RMSNorm before, SiLU after
    (4096, 512, "res", True, False),  # a 7B o/down-like row with the norm (qkv) and a residual
    (896, 1152, "bias", True, False),  # Qwen2.5-0.5B q/k/v: bias, 28 groups (lanes idle)
    (11008, 256, "f16", False, True),  # a row over 256 groups: two staging steps
    (4096, 1024, "f16", True, True),  # Llama's gate_up: the norm before, the gate after
    (2048, 64, "f16", True, True),  # 2 rows a set (64 rows: fewer than 256 workgroups)
    (896, 2048, "f32", True, False),  # the logits: float32 out
]


def _rms64(x: np.ndarray, nw: np.ndarray, eps: float) -> np.ndarray:
    """TVM's rms_norm in float64, rounded to float16 as its kernel writes it."""
    x64 = x.astype(np.float64).reshape(-1)
    v = x64 / np.sqrt(np.mean(x64 * x64) + eps) * nw.astype(np.float64)
    return v.astype(np.float16)


def _int8_expected(v, w, s, extras, epilogue: str, gate: bool, width: int = 32) -> np.ndarray:
    """float64 reference of the int8 kernel on the vector ``v``: its int8 rounding (a scale per
    ``width`` values), the GEMV, the epilogue (bias before the float16 cast, residual after it) and
    the SiLU gate of the two halves."""
    expected = q4_matmul64(_int8_rounded(v, width)[0], w, s)[None]
    if epilogue == "bias":
        expected = (expected + extras[0].astype(np.float64)).astype(np.float16).astype(np.float64)
    elif epilogue == "res":
        expected = expected.astype(np.float16).astype(np.float64) + extras[0].astype(np.float64)
    if gate:
        half = expected.shape[-1] // 2
        g, u = expected[..., :half].astype(np.float16), expected[..., half:].astype(np.float16)
        g64 = g.astype(np.float64)
        expected = (g64 / (1 + np.exp(-g64))).astype(np.float16).astype(np.float64) * u.astype(np.float64)
    return expected


@pytest.mark.parametrize(
    ("k", "n", "epilogue", "norm", "gate"),
    FUSED_CASES,
    ids=[f"{c[0]}x{c[1]}-{c[2]}{'-norm' if c[3] else ''}{'-silu' if c[4] else ''}" for c in FUSED_CASES],
)
def test_int8_kernel_with_the_norm_and_the_gate_matches_float64_on_vulkan(
    k, n, epilogue, norm, gate, tmp_path
):
    """The RMSNorm before and the SiLU gate after a GEMV, computed by the int8 kernel itself
    (``fused_gemv``): one dispatch, what numpy computes in float64 from the same int8 rounding."""
    import tvm

    from app.inference.pipelines.wgsl_q4_gemv import fused_gemv

    need_vulkan()
    eps = 1e-5
    func = q4_matmul_func(k, n, epilogue)
    silu_out = tvm.tirx.decl_buffer((1, 1, n // 2), "float16", name="gated") if gate else None
    new = fused_gemv(func, eps if norm else None, silu_out, 32768)
    assert new is not None, "the int8 kernel did not take the GEMV"
    run = _matmul_run(k, n, epilogue, 1, seed=k + 3 * n)
    x, w, s = run.args[:3]
    x = (x.astype(np.float32) * 3).astype(np.float16)  # a norm far from 1
    nw = (1 + 0.25 * np.random.default_rng(k).standard_normal(k)).astype(np.float16)
    v = _rms64(x, nw, eps).reshape(x.shape) if norm else x
    extras = run.args[3:-1]
    expected = _int8_expected(v, w, s, extras, epilogue, gate)
    out = np.zeros(expected.shape, run.args[-1].dtype)
    args = [x, *([nw] if norm else []), w, s, *extras, out]
    got = _run_on_vulkan(new, args, tmp_path, name="fused")
    what = f"fused k={k} n={n} {epilogue} norm={norm} gate={gate}"
    _close(got, expected, MATMUL_TOL, what)
    bad = got.copy()
    bad[0, 0, -1] += np.float32(0.05) * max(1.0, float(np.abs(got).max()))
    with pytest.raises(AssertionError):
        _close(bad, expected, MATMUL_TOL, what)


def test_the_preload_switch_sets_q4_autos_layout(monkeypatch):
    from app.errors import LlmchatError
    from app.inference.pipelines import wgsl_q4_gemv

    assert wgsl_q4_gemv.choose(4096, 4096).preload == wgsl_q4_gemv.PRELOAD
    monkeypatch.setenv(wgsl_q4_gemv.PRELOAD_ENV, "4")
    assert wgsl_q4_gemv.choose(4096, 4096).name == "q4-r2-l32-t256-dp4a-pre4"
    monkeypatch.setenv(wgsl_q4_gemv.PRELOAD_ENV, "0")
    with pytest.raises(LlmchatError, match="LLMCHAT_WGSL_Q4_PRELOAD"):
        wgsl_q4_gemv.choose(4096, 4096)


def test_the_workgroups_switch_sets_the_rows_a_set(monkeypatch):
    """``q4-auto`` takes the most rows a set (4, 2, 1) that still give :data:`MIN_WORKGROUPS`
    workgroups; ``LLMCHAT_WGSL_MIN_WORKGROUPS`` moves that line for A/B runs and is part of the
    library key; a number that is not a power of two from 32 to 4,096 is refused."""
    from app.errors import LlmchatError
    from app.inference.compile.cache import _kernel_switches
    from app.inference.pipelines import wgsl_q4_gemv

    choose = wgsl_q4_gemv.choose
    assert choose(4096, 4096).name == "q4-r2-l32-t256-dp4a"  # 256 workgroups
    assert choose(4096, 12288).name == "q4-r4-l32-t256-dp4a"  # 384
    monkeypatch.setenv(wgsl_q4_gemv.MIN_WORKGROUPS_ENV, "512")
    assert choose(4096, 4096).name == "q4-r1-l32-t256-dp4a"  # 512
    assert choose(4096, 12288).name == "q4-r2-l32-t256-dp4a"  # 768
    assert _kernel_switches()[wgsl_q4_gemv.MIN_WORKGROUPS_ENV] == "512"
    monkeypatch.setenv(wgsl_q4_gemv.MIN_WORKGROUPS_ENV, "128")
    assert choose(4096, 4096).name == "q4-r4-l32-t256-dp4a"  # 128
    for bad in ("100", "8192", "many"):
        monkeypatch.setenv(wgsl_q4_gemv.MIN_WORKGROUPS_ENV, bad)
        with pytest.raises(LlmchatError, match="LLMCHAT_WGSL_MIN_WORKGROUPS"):
            choose(4096, 4096)


def test_the_gate_layout_switch_sets_the_pairs_layout(monkeypatch):
    """gate_up's layout (SiLU pairs): 4 or 2 rows a set by the workgroup count; where a
    workgroup's 32 outputs are quantized as one group, 4 rows a set of 16 lanes; ``r8`` / ``l16``
    for A/B runs."""
    from app.errors import LlmchatError
    from app.inference.pipelines import wgsl_q4_gemv

    choose = wgsl_q4_gemv.choose
    assert choose(4096, 22016, pairs=True).name == "q4-r4-l32-t256-dp4a"  # 688 workgroups
    assert choose(896, 9728, pairs=True).name == "q4-r4-l32-t256-dp4a"  # 304 workgroups
    assert choose(896, 4864, pairs=True).name == "q4-r2-l32-t256-dp4a"  # 304 rather than 152
    assert choose(896, 9728, pairs=True, group_out=True).name == "q4-r4-l16-t256-dp4a"
    assert choose(896, 9720, pairs=True, group_out=True) is None  # 4,860 outputs: not in groups of 32
    monkeypatch.setenv(wgsl_q4_gemv.GATE_LAYOUT_ENV, "l16")
    assert choose(4096, 22016, pairs=True).name == "q4-r4-l16-t256-dp4a"
    assert choose(4096, 22016, pairs=True, group_out=True).name == "q4-r4-l16-t256-dp4a"
    assert choose(4096, 4096).name == "q4-r2-l32-t256-dp4a"  # not pairs: unchanged
    monkeypatch.setenv(wgsl_q4_gemv.GATE_LAYOUT_ENV, "r8")
    assert choose(4096, 22016, pairs=True).name == "q4-r8-l32-t256-dp4a"
    assert choose(4096, 22016, pairs=True, group_out=True).name == "q4-r8-l32-t256-dp4a"
    monkeypatch.setenv(wgsl_q4_gemv.GATE_LAYOUT_ENV, "wide")
    with pytest.raises(LlmchatError, match="LLMCHAT_WGSL_GATE_LAYOUT"):
        choose(4096, 22016, pairs=True)


Q8_CASES = [
    # k, n, epilogue, SiLU gate after: the vector quantized once (q8_norm), then the GEMV reading it
    (4096, 512, "res", False),  # a 7B row: 128 groups, half the staging threads idle
    (4096, 1024, "f16", True),  # Llama's gate_up
    (2048, 512, "f32", False),  # the logits: float32 out
    (896, 1152, "bias", False),  # 28 groups: lanes past the last group
    (11008, 256, "f16", False),  # 344 groups: two staging steps, a partial second one
]


@pytest.mark.parametrize(
    ("k", "n", "epilogue", "gate"),
    Q8_CASES,
    ids=[f"{c[0]}x{c[1]}-{c[2]}{'-silu' if c[3] else ''}" for c in Q8_CASES],
)
def test_the_vector_quantized_once_gives_what_the_norm_inside_the_gemv_gives(k, n, epilogue, gate, tmp_path):
    """``q8_norm`` (the RMSNorm and the int8 quantization, one workgroup) then the GEMV reading its
    words (``fused_gemv(q8=True)``): bit for bit what the int8 kernel computing the norm in every
    workgroup writes (the same sums in the same order), and within the float64 reference's
    tolerance; a wrong word in the quantized vector changes the result."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines.wgsl_q4_gemv import fused_gemv, q8_norm, q8_words

    need_vulkan()
    eps = 1e-5
    func = q4_matmul_func(k, n, epilogue)
    silu_out = tvm.tirx.decl_buffer((1, 1, n // 2), "float16", name="gated") if gate else None
    read = fused_gemv(func, None, silu_out, 32768, q8=True)
    inside = fused_gemv(func, eps, silu_out, 32768)
    assert read is not None and inside is not None, "the int8 kernel did not take the GEMV"
    run = _matmul_run(k, n, epilogue, 1, seed=k + 5 * n)
    x, w, s = run.args[:3]
    x = (x.astype(np.float32) * 3).astype(np.float16)
    nw = (1 + 0.25 * np.random.default_rng(k).standard_normal(k)).astype(np.float16)
    extras = run.args[3:-1]
    shape = (1, 1, n // 2) if gate else run.args[-1].shape
    target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile="wgsl-f16-wg32768-t256"))
    funcs = {"norm": q8_norm(k, eps), "gemv": read, "inside": inside}
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    tvm.compile(mod, target=target).export_library(str(tmp_path / "q8.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "q8.so"))
    dev = webgpu.device(0)
    t = [tvm.runtime.tensor(a, dev) for a in (x, nw, w, s, *extras)]
    q = tvm.runtime.tensor(np.zeros(q8_words(k), np.uint32), dev)
    out_q8 = tvm.runtime.tensor(np.zeros(shape, run.args[-1].dtype), dev)
    out_inside = tvm.runtime.tensor(np.zeros(shape, run.args[-1].dtype), dev)
    lib["norm"](t[0], t[1], q)
    lib["gemv"](q, *t[2:], out_q8)
    lib["inside"](*t, out_inside)
    got, want = out_q8.numpy(), out_inside.numpy()
    np.testing.assert_array_equal(got, want)
    expected = _int8_expected(_rms64(x, nw, eps).reshape(x.shape), w, s, extras, epilogue, gate)
    _close(got, expected, MATMUL_TOL, f"q8 k={k} n={n} {epilogue} gate={gate}")
    # the GEMV reads the words: one group's scale doubled moves the rows that group feeds
    words = q.numpy()
    words[k // 32 * 8] = (words[k // 32 * 8 : k // 32 * 8 + 1].view(np.float32) * 2).view(np.uint32)[0]
    lib["gemv"](tvm.runtime.tensor(words, dev), *t[2:], out_q8)
    assert not np.array_equal(out_q8.numpy(), want)


GATED_Q8_CASES = [
    # k, intermediate, down's rows, the norm inside gate_up, LLMCHAT_WGSL_GATE_LAYOUT: gate_up
    # writes its gated output quantized, the down projection reads those words
    (1024, 512, 256, False, ""),  # 16 groups
    (896, 4864, 896, True, ""),  # the 0.5B's MLP: 152 groups, the norm of short rows inside gate_up
    (1024, 512, 256, False, "r8"),  # 8 rows a set of 32 lanes
]


@pytest.mark.parametrize(
    ("k", "inter", "n_down", "norm", "layout"),
    GATED_Q8_CASES,
    ids=[
        f"{c[0]}x{c[1]}x{c[2]}{'-norm' if c[3] else ''}{'-' + c[4] if c[4] else ''}" for c in GATED_Q8_CASES
    ],
)
def test_the_gated_output_written_quantized_gives_what_the_down_projection_stages(
    k, inter, n_down, norm, layout, tmp_path, monkeypatch
):
    """gate_up with the SiLU gate writing its output already quantized (``q8_out``: a workgroup's
    32 values one group) and the down projection reading those words (``q8``): bit for bit what
    the gate_up writing float16 and the down projection quantizing that in each workgroup give,
    within the float64 reference's tolerance; a wrong word changes the result."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines import wgsl_q4_gemv
    from app.inference.pipelines.wgsl_q4_gemv import fused_gemv, q8_words

    need_vulkan()
    monkeypatch.setenv(wgsl_q4_gemv.GATE_LAYOUT_ENV, layout)
    eps = 1e-5
    up_func, down_func = q4_matmul_func(k, 2 * inter, "f16"), q4_matmul_func(inter, n_down, "res")
    gated = tvm.tirx.decl_buffer((1, 1, inter), "float16", name="gated")
    funcs = {
        "up_f16": fused_gemv(up_func, eps if norm else None, gated, 32768),
        "up_q8": fused_gemv(up_func, eps if norm else None, gated, 32768, q8_out=True),
        "down_stage": fused_gemv(down_func, None, None, 32768),
        "down_q8": fused_gemv(down_func, None, None, 32768, q8=True),
    }
    assert all(f is not None for f in funcs.values()), "the int8 kernel did not take a GEMV"
    up, down = (
        _matmul_run(k, 2 * inter, "f16", 1, seed=k + inter),
        _matmul_run(inter, n_down, "res", 1, seed=n_down),
    )
    x = (up.args[0].astype(np.float32) * 3).astype(np.float16)
    nw = (1 + 0.25 * np.random.default_rng(k).standard_normal(k)).astype(np.float16)
    wu, su = up.args[1:3]
    wd, sd, res = down.args[1:4]
    target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile="wgsl-f16-wg32768-t256"))
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    tvm.compile(mod, target=target).export_library(str(tmp_path / "gated.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "gated.so"))
    dev = webgpu.device(0)
    t = {
        name: tvm.runtime.tensor(a, dev)
        for name, a in dict(x=x, nw=nw, wu=wu, su=su, wd=wd, sd=sd, res=res).items()
    }
    head = [t["x"], t["nw"]] if norm else [t["x"]]
    g16 = tvm.runtime.tensor(np.zeros((1, 1, inter), np.float16), dev)
    q = tvm.runtime.tensor(np.zeros(q8_words(inter), np.uint32), dev)
    out_stage = tvm.runtime.tensor(np.zeros((1, 1, n_down), np.float16), dev)
    out_q8 = tvm.runtime.tensor(np.zeros((1, 1, n_down), np.float16), dev)
    lib["up_f16"](*head, t["wu"], t["su"], g16)
    lib["down_stage"](g16, t["wd"], t["sd"], t["res"], out_stage)
    lib["up_q8"](*head, t["wu"], t["su"], q)
    lib["down_q8"](q, t["wd"], t["sd"], t["res"], out_q8)
    got, want = out_q8.numpy(), out_stage.numpy()
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)
    v = _rms64(x, nw, eps).reshape(x.shape) if norm else x
    gated64 = _int8_expected(v, wu, su, [], "f16", True)
    expected = _int8_expected(gated64.astype(np.float16), wd, sd, [res], "res", False)
    _close(got, expected, MATMUL_TOL, f"gated q8 k={k} inter={inter} n={n_down} norm={norm}")
    # the down projection reads the words: one group's scale doubled moves its rows
    words = q.numpy()
    groups = inter // 32
    words[groups * 8] = (words[groups * 8 : groups * 8 + 1].view(np.float32) * 2).view(np.uint32)[0]
    lib["down_q8"](tvm.runtime.tensor(words, dev), t["wd"], t["sd"], t["res"], out_q8)
    assert not np.array_equal(out_q8.numpy(), want)


NORM_OUT_CASES = [
    # producer k -> n (residual out), the GEMV after the norm n -> n2 (its epilogue, SiLU gate
    # after it), LLMCHAT_WGSL_NORM_OUT_LAYOUT: the producer writes x * w quantized and the groups'
    # sums of x^2, the GEMV after the norm applies the norm's scale
    (4096, 4096, 512, "res", False, ""),  # the 7B's o projection, then a residual GEMV
    (4096, 4096, 1024, "f16", True, "r2"),  # ... then Llama's gate_up
    (11008, 2048, 512, "f32", False, "r1"),  # the 3B's down projection, then the logits (16 sets)
    (2048, 2048, 256, "bias", False, ""),  # Qwen's q/k/v with a bias after the norm
    (896, 896, 128, "res", False, ""),  # 56 half groups: threads past the last of them
    (4096, 4096, 1024, "f16", True, "r4l64"),  # 4 rows a set of 64 lanes (2 steps a lane)
    (11008, 2048, 512, "res", False, "r8l128"),  # 8 rows of 128 lanes: a partial last step
]


@pytest.mark.parametrize(
    ("k", "n", "n2", "epilogue", "gate", "layout"),
    NORM_OUT_CASES,
    ids=[f"{c[0]}x{c[1]}x{c[2]}-{c[3]}{'-silu' if c[4] else ''}-{c[5] or 'default'}" for c in NORM_OUT_CASES],
)
def test_the_norm_folded_into_the_gemvs_around_it_matches_float64(
    k, n, n2, epilogue, gate, layout, tmp_path, monkeypatch
):
    """The RMSNorm between two GEMVs without a kernel of its own: the GEMV producing ``x`` writes
    its float16 output (what the int8 kernel writes without this) and ``x * w`` quantized with
    each group's sum of ``x^2`` (``norm_out``); the GEMV after the norm reads those words and
    applies the norm's scale (``read_norm``). Against float64 of the norm then the int8 GEMV; a
    wrong sum of squares or scale in the words changes the result."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines import wgsl_q4_gemv
    from app.inference.pipelines.wgsl_q4_gemv import fused_gemv, q8n_words

    need_vulkan()
    monkeypatch.setenv(wgsl_q4_gemv.NORM_OUT_LAYOUT_ENV, layout)
    eps = 1e-5
    prod_func, next_func = q4_matmul_func(k, n, "res"), q4_matmul_func(n, n2, epilogue)
    silu_out = tvm.tirx.decl_buffer((1, 1, n2 // 2), "float16", name="gated") if gate else None
    funcs = {
        "plain": fused_gemv(prod_func, None, None, 32768),
        "prod": fused_gemv(prod_func, None, None, 32768, norm_out=True),
        "next": fused_gemv(next_func, None, silu_out, 32768, q8=True, read_norm=eps),
    }
    assert all(f is not None for f in funcs.values()), "the int8 kernel did not take a GEMV"
    prod, nxt = _matmul_run(k, n, "res", 1, seed=k + n), _matmul_run(n, n2, epilogue, 1, seed=n2 + 7)
    x, wp, sp, res = prod.args[:4]
    x = (x.astype(np.float32) * 3).astype(np.float16)
    nw = (1 + 0.25 * np.random.default_rng(n).standard_normal(n)).astype(np.float16)
    w2, s2 = nxt.args[1:3]
    extras = nxt.args[3:-1]
    shape = (1, 1, n2 // 2) if gate else nxt.args[-1].shape
    target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile="wgsl-f16-wg32768-t256"))
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    tvm.compile(mod, target=target).export_library(str(tmp_path / "normout.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "normout.so"))
    dev = webgpu.device(0)
    t = {name: tvm.runtime.tensor(a, dev) for name, a in dict(x=x, wp=wp, sp=sp, res=res, nw=nw).items()}
    plain = tvm.runtime.tensor(np.zeros((1, 1, n), np.float16), dev)
    xo = tvm.runtime.tensor(np.zeros((1, 1, n), np.float16), dev)
    words = tvm.runtime.tensor(np.zeros(q8n_words(n), np.uint32), dev)
    lib["plain"](t["x"], t["wp"], t["sp"], t["res"], plain)
    lib["prod"](t["x"], t["wp"], t["sp"], t["res"], t["nw"], xo, words)
    # the float16 output: the int8 GEMV's, within the float64 reference's tolerance
    got_x = xo.numpy()
    _close(got_x, _int8_expected(x, wp, sp, [res], "res", False), MATMUL_TOL, f"producer k={k} n={n}")
    _close(got_x, plain.numpy(), MATMUL_TOL, "producer against the int8 kernel without norm_out")
    groups = n // 32
    wq = words.numpy()
    sums = wq[groups * 12 :].view(np.float32)  # each half group's sum of x^2
    np.testing.assert_allclose(
        sums, (got_x.astype(np.float64).reshape(-1, 16) ** 2).sum(axis=1), rtol=1e-5, atol=1e-6
    )
    t2 = [tvm.runtime.tensor(a, dev) for a in (w2, s2, *extras)]
    out = tvm.runtime.tensor(np.zeros(shape, nxt.args[-1].dtype), dev)
    lib["next"](words, *t2, out)
    got = out.numpy()
    assert np.abs(got).max() > 0
    # the norm's vector rounded to int8 with a scale per 16 values (a producing workgroup's rows)
    normed = _rms64(got_x, nw, eps).reshape(got_x.shape)
    expected = _int8_expected(normed, w2, s2, extras, epilogue, gate, width=16)
    what = f"norm folded k={k} n={n} n2={n2} {epilogue} gate={gate}"
    _close(got, expected, MATMUL_TOL, what)
    # the GEMV after the norm reads the sums of squares (one half group's times 4 moves every row)
    # and both scales of a group (the second half's doubled moves the result)
    for at in (groups * 12 + 2 * groups - 1, groups * 8 + 1):
        bad = wq.copy()
        bad[at] = (bad[at : at + 1].view(np.float32) * 4 + 1).view(np.uint32)[0]
        lib["next"](tvm.runtime.tensor(bad, dev), *t2, out)
        assert not np.array_equal(out.numpy(), got), at


@pytest.mark.parametrize(
    ("k", "n", "layout"),
    [(4096, 4096, "r2"), (896, 896, "r2"), (11008, 2048, "r1")],
    ids=["7b-o", "896", "r1"],
)
def test_the_norm_vector_quantized_by_several_threads_is_bit_for_bit_one_threads(
    k, n, layout, tmp_path, monkeypatch
):
    """``LLMCHAT_WGSL_NORM_OUT_LAYOUT=r2p`` / ``r1p``: the GEMV writing a norm's vector quantizes
    each half group with four threads packing a word each and two more the int8 sum, the sum of
    squares and the scale; its output and every word are those of one thread doing it all."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines import wgsl_q4_gemv
    from app.inference.pipelines.wgsl_q4_gemv import fused_gemv, q8n_words

    need_vulkan()
    prod_func = q4_matmul_func(k, n, "res")
    funcs = {}
    for name, value in (("one", layout), ("par", layout + "p")):
        monkeypatch.setenv(wgsl_q4_gemv.NORM_OUT_LAYOUT_ENV, value)
        assert wgsl_q4_gemv.norm_out_parallel() == (name == "par")
        funcs[name] = fused_gemv(prod_func, None, None, 32768, norm_out=True)
    assert funcs["one"] is not None and funcs["par"] is not None
    assert funcs["one"].script() != funcs["par"].script()
    run = _matmul_run(k, n, "res", 1, seed=k + 3 * n)
    x, wp, sp, res = run.args[:4]
    x = (x.astype(np.float32) * 3).astype(np.float16)
    nw = (1 + 0.25 * np.random.default_rng(n).standard_normal(n)).astype(np.float16)
    target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile="wgsl-f16-wg32768-t256"))
    mod = tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()})
    tvm.compile(mod, target=target).export_library(str(tmp_path / "par.so"))
    lib = tvm.runtime.load_module(str(tmp_path / "par.so"))
    dev = webgpu.device(0)
    t = [tvm.runtime.tensor(a, dev) for a in (x, wp, sp, res, nw)]
    got = {}
    for name in funcs:
        xo = tvm.runtime.tensor(np.zeros((1, 1, n), np.float16), dev)
        words = tvm.runtime.tensor(np.full(q8n_words(n), 0xDEADBEEF, np.uint32), dev)
        lib[name](*t, xo, words)
        got[name] = (xo.numpy(), words.numpy())
    np.testing.assert_array_equal(got["par"][0], got["one"][0])
    np.testing.assert_array_equal(got["par"][1], got["one"][1])
    assert not (got["one"][1] == 0xDEADBEEF).any()  # every word written


def test_the_norm_out_layout_switch_sets_the_producers_layout(monkeypatch):
    """A GEMV writing a norm's vector takes 16 rows a workgroup (one half group): 2 rows of 32
    lanes by default, 1 row of 16 lanes with ``r1``; a bad value names the switch; the switch is
    part of the library key."""
    from app.errors import LlmchatError
    from app.inference.compile.cache import library_key
    from app.inference.engine.random_model import preset_config
    from app.inference.pipelines import wgsl_q4_gemv

    choose = wgsl_q4_gemv.choose
    assert choose(4096, 4096, group_out=True).name == "q4-r2-l32-t256-dp4a"
    assert choose(4096, 4096, group_out=True).rows_per_workgroup == 16
    assert choose(4096, 4096).name == "q4-r2-l32-t256-dp4a"  # other GEMVs: unchanged
    cfg = preset_config("tiny-llama", "q4f16_1")
    default_key = library_key(cfg, "vulkan", "wgsl-f16-wg49152-t256").digest()
    monkeypatch.setenv(wgsl_q4_gemv.NORM_OUT_LAYOUT_ENV, "r1")
    assert choose(2048, 2048, group_out=True).name == "q4-r1-l16-t256-dp4a"
    assert library_key(cfg, "vulkan", "wgsl-f16-wg49152-t256").digest() != default_key
    monkeypatch.setenv(wgsl_q4_gemv.NORM_OUT_LAYOUT_ENV, "r4")
    with pytest.raises(LlmchatError, match="LLMCHAT_WGSL_NORM_OUT_LAYOUT"):
        choose(2048, 2048, group_out=True)
