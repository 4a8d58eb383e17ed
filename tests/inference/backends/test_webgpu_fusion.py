"""WGSL kernel fusion (``pipelines/wgsl_fusion``): the RMSNorm and SiLU-gate kernels folded into
the GEMV after them. One kernel launch instead of two, the GEMV scheduled by the pipeline's own
rules (staged in workgroup memory by llmchat's GEMV rule, or dlight's GEMV), and on a real Vulkan
driver (lavapipe in CI) the fused kernel computes what numpy computes in float64 on edge shapes
(one output row, odd row counts, an odd width with float16 weights, residual adds); the
kernel launches counted from the scheduled module are the ones the device API dispatches."""

from __future__ import annotations

import numpy as np
import pytest
import tvm

from app.inference.pipelines import gpu, wgsl_fusion
from app.inference.pipelines.kernel_count import decode_step_kernels, kernel_launches, scheduled_module
from tests.inference.backends.vulkan_env import need_vulkan

WEBGPU = {
    "kind": "webgpu",
    "max_num_threads": 256,
    "max_shared_memory_per_block": 49152,
    "thread_warp_size": 1,
    "supports_subgroups": False,
    "host": {"kind": "llvm"},
}
EPS = 1e-5


def _target():
    return tvm.target.Target(WEBGPU)


def _pair_module(kind: str, fmt_name: str, k: int, n: int, residual: bool):
    """``decode(x[, r])``: the prologue (``rms`` of a ``[1, 1, k]`` row with a float16 weight, or
    ``silu`` gate of a ``[1, 1, 2k]`` row), then a ``k -> n`` linear layer in ``fmt_name``
    (plus ``r``), through TVM's fusion passes as the pipeline runs them."""
    from tvm import relax
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    from app.inference.quantization import get_format

    fmt = get_format(fmt_name)

    class Pair(nn.Module):
        def __init__(self) -> None:
            self.norm = nn.Parameter((k,), "float16")
            self.proj = fmt.linear(k, n, bias=False, dtype="float16")

        def decode(self, x, r):
            if kind == "rms":
                v = op.rms_norm(x, self.norm, axes=[-1], epsilon=EPS)
            else:
                gate, up = op.split(x, 2, axis=-1)
                v = op.silu(gate) * up
            y = self.proj(v)
            return y + r if residual else y

    width = k if kind == "rms" else 2 * k
    spec = {
        "decode": {
            "x": nn.spec.Tensor([1, 1, width], "float16"),
            "r": nn.spec.Tensor([1, 1, n], "float16"),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }
    }
    mod, named = Pair().export_tvm(spec=spec)
    target = _target()
    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FoldConstant(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                gpu.fast_decode_pass(),
            ]
        )(mod)
    return fmt, mod, named


def _decode_calls(mod):
    from app.inference.pipelines.tir_facts import tir_call

    calls = []
    for block in mod["decode"].body.blocks:
        for binding in block.bindings:
            call = tir_call(binding.value)
            if call is not None:
                calls.append((call[0].name_hint, mod[call[0]]))
    return calls


def _f16_gemv(k: int, n: int, residual: bool):
    """``x[1, 1, k] @ W[n, k].T`` with float16 weights (any width), accumulated in float32
    (+ a float16 residual)."""
    from tvm import te

    one, k_, n_ = (tvm.tirx.const(v, "int64") for v in (1, k, n))
    x = te.placeholder((one, one, k_), "float16", name="x")
    w = te.placeholder((n_, k_), "float16", name="weight")
    red = te.reduce_axis((tvm.tirx.const(0, "int64"), k_), name="k")
    acc = te.compute(
        (one, one, n_),
        lambda b, i, j: te.sum(x[b, i, red].astype("float32") * w[j, red].astype("float32"), axis=red),
        name="matmul",
    )
    out = te.compute((one, one, n_), lambda b, i, j: acc[b, i, j].astype("float16"), name="out")
    if not residual:
        return te.create_prim_func([x, w, out])
    r = te.placeholder((one, one, n_), "float16", name="r")
    added = te.compute((one, one, n_), lambda b, i, j: out[b, i, j] + r[b, i, j], name="add")
    return te.create_prim_func([x, w, r, added])


class _F16:
    """The float16 "format" of :func:`_f16_gemv`: the weight as it is."""

    @staticmethod
    def quantize(w):
        return {"weight": w.astype(np.float16)}

    @staticmethod
    def dequantize(enc):
        return enc["weight"].astype(np.float64)


def _fused(kind: str, fmt_name: str, k: int, n: int, residual: bool):
    """(format, named params, the unfused calls, the fused PrimFunc)."""
    if fmt_name == "f16":
        from app.inference.pipelines.cuda_rms_norm import reference_rms_norm
        from app.inference.pipelines.cuda_silu_gate import reference_silu_gate

        prologue = reference_rms_norm(k, EPS) if kind == "rms" else reference_silu_gate(k)
        name = "rms_norm" if kind == "rms" else "fused_split_silu_multiply"
        gemv = _f16_gemv(k, n, residual)
        fmt, named = _F16, [("proj.weight", gemv.params[1])]
        calls = [(name, prologue), ("gemv", gemv)]
    else:
        fmt, mod, named = _pair_module(kind, fmt_name, k, n, residual)
        calls = _decode_calls(mod)
    assert len(calls) == 2, [c[0] for c in calls]
    (p_name, prologue), (_, gemv) = calls
    assert wgsl_fusion.prologue_kind(p_name, prologue) == ("rms_norm" if kind == "rms" else "silu_gate")
    target = _target()
    fused = wgsl_fusion.fused_func(prologue, gemv, gpu.schedule_rules(target), target)
    return fmt, named, calls, fused


def _run(func, args, out_shape, tmp_path):
    from app.inference.backends import webgpu

    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=_target())
    lib.export_library(str(tmp_path / "fused.so"))  # the add-on loads exported WGSL modules
    lib = tvm.runtime.load_module(str(tmp_path / "fused.so"))
    dev = webgpu.device(0)
    dargs = [tvm.runtime.tensor(a, dev) for a in args]
    out = tvm.runtime.empty(out_shape, "float16", dev)
    lib["main"](*dargs, out)
    return out.numpy().astype(np.float64)


def _reference(kind: str, x: np.ndarray, norm: np.ndarray, weight: np.ndarray, r: np.ndarray | None):
    """float64, with the float16 rounding of the prologue's output that TVM's kernels keep."""
    x = x.astype(np.float64).reshape(-1)
    if kind == "rms":
        v = x / np.sqrt(np.mean(x * x) + EPS) * norm.astype(np.float64)
    else:
        half = x.size // 2
        gate = x[:half].astype(np.float16)
        silu = (gate * (1 / (1 + np.exp(-gate.astype(np.float64)))).astype(np.float16)).astype(np.float16)
        v = silu.astype(np.float64) * x[half:]
    y = weight @ v.astype(np.float16).astype(np.float64)
    return y + (r.reshape(-1).astype(np.float64) if r is not None else 0.0)


CASES = [
    # prologue, weights, in features (per half for silu), out features, residual add
    ("rms", "q4f16_1", 896, 1152, False),  # Qwen2.5-0.5B q/k/v: dlight's GEMV
    ("rms", "q4f16_1", 4096, 4096, True),  # a 7B projection: llmchat's GEMV, staged in workgroup memory
    ("rms", "q4f16_1", 96, 1, False),  # one output row
    ("rms", "q4f16_1", 160, 7, True),  # an odd row count
    ("rms", "f16", 67, 33, False),  # an odd width (float16 weights)
    ("silu", "q4f16_1", 4864, 896, True),  # the 0.5B down projection
    ("silu", "q4f16_1", 64, 1, False),
    ("silu", "f16", 45, 13, True),
]


@pytest.mark.parametrize(
    ("kind", "weights", "k", "n", "residual"),
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}{'-residual' if c[4] else ''}" for c in CASES],
)
def test_fused_kernel_matches_float64_on_vulkan(kind, weights, k, n, residual, tmp_path):
    fmt, named, _calls, fused = _fused(kind, weights, k, n, residual)
    assert fused is not None, "the prologue should fold into this GEMV"
    assert kernel_launches(fused) == 1
    need_vulkan()
    rng = np.random.default_rng(k * 31 + n)
    w = rng.standard_normal((n, k)) / np.sqrt(k)
    enc = fmt.quantize(w)
    weight_args = [
        np.ascontiguousarray(enc[name.rpartition(".")[2]]).astype(str(p.dtype))
        for name, p in named
        if name.startswith("proj.")
    ]
    x = (rng.standard_normal((1, 1, k if kind == "rms" else 2 * k)) * 2).astype(np.float16)
    norm = (1 + 0.25 * rng.standard_normal(k)).astype(np.float16)
    r = rng.standard_normal((1, 1, n)).astype(np.float16) if residual else None
    args = [x, *([norm] if kind == "rms" else []), *weight_args, *([r] if residual else [])]
    got = _run(fused, args, (1, 1, n), tmp_path).reshape(-1)
    want = _reference(kind, x, norm, fmt.dequantize(enc), r)
    np.testing.assert_allclose(got, want, rtol=4e-3, atol=4e-3 * np.abs(want).max())


def test_both_gemv_schedules_are_covered():
    """The cases above run the prologue inside workgroup-memory staging (llmchat's GEMV) and
    inside the reduction (dlight's GEMV, short rows)."""
    target = _target()
    staged = {}
    for k, n in ((4096, 4096), (896, 1152)):
        _fmt, mod, _named = _pair_module("rms", "q4f16_1", k, n, False)
        gemv = _decode_calls(mod)[1][1]
        scheduled = wgsl_fusion.schedule_alone(gemv, gpu.schedule_rules(target), target)
        staged[(k, n)] = wgsl_fusion._staged(scheduled, scheduled.params[0])
    assert staged == {(4096, 4096): True, (896, 1152): False}


def test_a_costly_recompute_keeps_two_kernels(monkeypatch):
    """A GEMV that reads its vector inside the reduction recomputes the prologue per row: over
    MAX_RECOMPUTED_WEIGHTS (the tied logits GEMV of a 150k vocabulary) the prologue stays apart."""
    target = _target()
    _fmt, mod, _named = _pair_module("rms", "q4f16_1", 896, 16000, False)
    (_, prologue), (_, gemv) = _decode_calls(mod)
    rules = gpu.schedule_rules(target)
    assert wgsl_fusion.fused_func(prologue, gemv, rules, target) is not None
    old = wgsl_fusion.MAX_RECOMPUTED_WEIGHTS
    try:
        wgsl_fusion.MAX_RECOMPUTED_WEIGHTS = 896 * 16000 - 1
        assert wgsl_fusion.fused_func(prologue, gemv, rules, target) is None
        monkeypatch.setenv(wgsl_fusion.FUSION_ENV, "all")  # no limit: fused again
        assert wgsl_fusion.fused_func(prologue, gemv, rules, target) is not None
    finally:
        wgsl_fusion.MAX_RECOMPUTED_WEIGHTS = old


def test_only_tvms_own_prologues_are_recognised():
    from tvm.script import tirx as T

    @T.prim_func(private=True, s_tir=True)
    def scale(
        x: T.Buffer((1, 1, 64), "float16"), w: T.Buffer((64,), "float16"), y: T.Buffer((1, 1, 64), "float16")
    ):
        for i in range(64):
            with T.sblock("s"):
                v = T.axis.spatial(64, i)
                y[0, 0, v] = x[0, 0, v] * w[v]

    assert wgsl_fusion.prologue_kind("rms_norm", scale) is None
    assert wgsl_fusion.prologue_kind("fused_split_silu_multiply", scale) is None


def layers_of_tiny() -> int:
    from app.inference.engine.random_model import preset_config

    return preset_config("tiny-llama", "q4f16_1").num_hidden_layers


def _tiny_counts(monkeypatch, fusion: str):
    from app.inference.compile.targets import make_target
    from app.inference.engine.random_model import preset_config
    from app.inference.hardware.device_spec import DeviceSpec

    monkeypatch.setenv(wgsl_fusion.FUSION_ENV, fusion)
    target = make_target(DeviceSpec("vulkan", 0), "wgsl-f16-wg49152-t256")
    return decode_step_kernels(scheduled_module(preset_config("tiny-llama", "q4f16_1"), target))


def test_fusion_cuts_three_launches_per_layer_and_one_for_the_logits(monkeypatch):
    off = _tiny_counts(monkeypatch, "off")
    on = _tiny_counts(monkeypatch, "on")
    layers = 2  # the tiny-llama preset
    assert off["rms_norm"] == 2 * layers + 1 and off["fused_split_silu_multiply"] == layers
    assert "rms_norm" not in on and "fused_split_silu_multiply" not in on
    assert sum(off.values()) - sum(on.values()) == 3 * layers + 1
    fused = [name for name in on if name.endswith(("_rms_norm", "_fused_split_silu_multiply"))]
    assert sum(on[name] for name in fused) == 3 * layers + 1  # each fused pair: one launch


def test_the_default_int8_fusion_cuts_the_same_launches(monkeypatch):
    """By default the int8 GEMV kernel computes the norm before q/k/v, gate_up and the logits and
    the SiLU gate after gate_up: the same three launches a layer and one for the logits fewer,
    with the gate_up GEMV taking both its norm and its gate (one launch for three kernels)."""
    off = _tiny_counts(monkeypatch, "off")
    default = _tiny_counts(monkeypatch, "")
    layers = 2
    assert wgsl_fusion.use_int8_fusion(_target())
    assert "rms_norm" not in default and "fused_split_silu_multiply" not in default
    assert sum(off.values()) - sum(default.values()) == 3 * layers + 1
    triple = [
        name
        for name in default
        if name.startswith("rms_norm_") and name.endswith("_fused_split_silu_multiply_q8out")
    ]
    assert len(triple) == 1 and default[triple[0]] == layers
    assert sum(v for name, v in default.items() if name.startswith("rms_norm_")) == 2 * layers + 1
    monkeypatch.setenv("LLMCHAT_WGSL_GEMV", "t8-b256-l16-u4-mb128")  # no int8 kernel: no fusion
    assert not wgsl_fusion.use_int8_fusion(_target())


def test_the_quantized_vector_keeps_the_norms_launch_and_feeds_the_gemvs(monkeypatch):
    """By default (``int8-q8``) a norm of a row longer than :data:`~wgsl_fusion.INT8_NORM_MAX_K`
    (here every norm: the limit set to 0) writes the vector quantized (``q8_norm``) and the GEMVs
    after it read that; the SiLU gate stays inside gate_up. The launches are ``int8-noq8``'s plus
    the norms'; rows up to the limit keep the norm inside the GEMV."""
    off = _tiny_counts(monkeypatch, "off")
    default = _tiny_counts(monkeypatch, "int8-q8")
    assert _tiny_counts(monkeypatch, "int8-noq8") == default  # the tiny rows are under the limit
    monkeypatch.setattr(wgsl_fusion, "INT8_NORM_MAX_K", 0)
    q8 = _tiny_counts(monkeypatch, "int8-q8")
    noq8 = _tiny_counts(monkeypatch, "int8-noq8")
    assert noq8["rms_norm"] == 2 * layers_of_tiny() + 1 and not any(name.endswith("_q8") for name in noq8)
    layers = 2
    norms = [name for name in q8 if name.endswith("_q8") and "rms_norm" in name]
    assert sum(q8[name] for name in norms) == 2 * layers + 1 and "rms_norm" not in q8
    readers = [name for name in q8 if name.endswith("_q8") and name not in norms]
    assert sum(q8[name] for name in readers) == 2 * layers + 1  # q/k/v, gate_up, the logits
    assert sum(off.values()) - sum(q8.values()) == layers  # only the gates' launches


def test_the_gated_output_quantized_by_gate_up_feeds_the_down_projection(monkeypatch):
    """``int8-q8s`` (and the default, on the tiny rows under the norm's limit): gate_up (its norm
    and its SiLU gate inside) writes the gated output quantized and the down projection reads
    those words: ``int8-q8``'s launches, the gate_up and down kernels replaced one for one."""
    default = _tiny_counts(monkeypatch, "int8-q8")
    q8s = _tiny_counts(monkeypatch, "int8-q8s")
    assert q8s == _tiny_counts(monkeypatch, "")  # the tiny rows keep the norm inside the GEMVs
    layers = layers_of_tiny()
    assert sum(q8s.values()) == sum(default.values())
    gate_up = [name for name in q8s if name.endswith("_fused_split_silu_multiply_q8out")]
    assert len(gate_up) == 1 and q8s[gate_up[0]] == layers
    assert gate_up[0].removesuffix("_q8out") in default
    downs = [name for name in q8s if name.endswith("_add_q8")]
    assert len(downs) == 1 and q8s[downs[0]] == layers and downs[0].removesuffix("_q8") in default
    # with the norm's own kernel writing q/k/v's and gate_up's vector, gate_up reads it and writes
    # its output quantized: the quantized vector in, the quantized vector out
    monkeypatch.setattr(wgsl_fusion, "INT8_NORM_MAX_K", 0)
    both = _tiny_counts(monkeypatch, "int8-q8s")
    assert sum(both.values()) == sum(_tiny_counts(monkeypatch, "int8-q8").values())
    assert any(name.endswith("_fused_split_silu_multiply_q8_q8out") for name in both), both


def test_the_quantized_vector_gives_the_logits_of_the_norm_inside_every_gemv(tiny_model_dir, monkeypatch):
    """On Vulkan (lavapipe in CI) a tiny llama with every norm quantizing once (``int8-q8``, the
    limit at 0) decodes the same logits, bit for bit, as with the norm recomputed inside every
    GEMV workgroup (``int8``): the same sums in the same order; so does gate_up writing its gated
    output quantized for the down projection (``int8-q8s``); and the dispatches of a step are the
    ones counted (no device argmax: the logits are read back)."""
    need_vulkan()
    from app.inference.backends import webgpu
    from app.inference.compile.targets import make_target
    from app.inference.engine.tvm_engine import load_engine
    from app.inference.hardware.device_spec import DeviceSpec

    model_dir = tiny_model_dir("llama", "q4f16_1")
    monkeypatch.setattr(wgsl_fusion, "INT8_NORM_MAX_K", 0)
    logits = {}
    for fusion in ("int8", "int8-q8", "int8-q8s"):
        monkeypatch.setenv(wgsl_fusion.FUSION_ENV, fusion)
        engine = load_engine(model_dir, device="vulkan")
        try:
            rt = engine.runtime
            token = int(np.argmax(rt.prefill([5, 6, 7])))
            steps = []
            before = webgpu.stats(rt.device.index)
            for _ in range(4):
                steps.append(rt.decode(token))
                token = int(np.argmax(steps[-1]))
            after = webgpu.stats(rt.device.index)
            counted = decode_step_kernels(
                scheduled_module(engine.config, make_target(DeviceSpec("vulkan", 0)))
            )
        finally:
            engine.close()
        logits[fusion] = np.stack(steps)
        step = sum(v for name, v in counted.items() if not name.startswith("argmax"))  # logits read
        assert (after["dispatches"] - before["dispatches"]) / 4 == step, (fusion, counted)
    assert np.isfinite(logits["int8"]).all() and np.abs(logits["int8"]).max() > 0
    np.testing.assert_array_equal(logits["int8-q8"], logits["int8"])
    np.testing.assert_array_equal(logits["int8-q8s"], logits["int8"])


def test_rope_and_append_move_into_the_decode_attention(monkeypatch):
    """By default a decoded token's split-rotary and KV append launch nothing (the v2 attention
    does both, :mod:`~app.inference.pipelines.wgsl_rope_append`): two launches a layer fewer than
    with ``LLMCHAT_WGSL_ROPE_APPEND=off``; the switch is part of the library key."""
    from app.inference.compile.cache import _kernel_switches
    from app.inference.pipelines.wgsl_rope_append import SWITCH

    layers = 2
    default = _tiny_counts(monkeypatch, "")
    monkeypatch.setenv(SWITCH, "off")
    off = _tiny_counts(monkeypatch, "")
    assert off["fused_rope"] == layers and off["tir_kv_cache_transpose_append"] == layers
    assert "fused_rope" not in default and "tir_kv_cache_transpose_append" not in default
    assert sum(off.values()) - sum(default.values()) == 2 * layers
    assert _kernel_switches()[SWITCH] == "off"


def test_rope_and_append_move_into_the_attention_for_wide_heads_too(monkeypatch):
    """head_dim 128 (Qwen2.5-3B, Llama-2-7B): fused by default like the narrow heads (the kernel
    without a branch around its page loads measured faster on the H200); ``off`` keeps the
    split-rotary and append launches."""
    from app.inference.compile.targets import make_target
    from app.inference.engine import random_model
    from app.inference.engine.random_model import preset_config
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.pipelines.wgsl_rope_append import SWITCH

    wide = dict(
        random_model.PRESETS["tiny-llama"], hidden_size=256, num_attention_heads=2, num_key_value_heads=1
    )
    monkeypatch.setitem(random_model.PRESETS, "tiny-llama-d128", wide)
    config = preset_config("tiny-llama-d128", "q4f16_1")
    assert config.hidden_size // config.num_attention_heads == 128
    target = make_target(DeviceSpec("vulkan", 0), "wgsl-f16-wg49152-t256")
    monkeypatch.delenv(SWITCH, raising=False)
    default = decode_step_kernels(scheduled_module(config, target))
    monkeypatch.setenv(SWITCH, "off")
    off = decode_step_kernels(scheduled_module(config, target))
    layers = config.num_hidden_layers
    assert off["fused_rope"] == layers and off["tir_kv_cache_transpose_append"] == layers
    assert "fused_rope" not in default and sum(off.values()) - sum(default.values()) == 2 * layers


def test_static_count_equals_the_dispatches_of_a_greedy_step_on_vulkan(tiny_model_dir, monkeypatch):
    """The kernel launches counted from the scheduled module of a tiny model are the dispatches
    llmchat's device API records per greedy decode step (fusion on, then off with the RoPE and
    append kernels launched, then int8)."""
    need_vulkan()

    model_dir = tiny_model_dir("llama", "q4f16_1")
    for fusion, rope_append in (("on", ""), ("off", "off"), ("int8", "")):
        monkeypatch.setenv(wgsl_fusion.FUSION_ENV, fusion)
        monkeypatch.setenv("LLMCHAT_WGSL_ROPE_APPEND", rope_append)
        dispatched, counted = _greedy_dispatches(model_dir)
        assert dispatched == sum(counted.values()), (fusion, counted)


def _greedy_dispatches(model_dir, steps: int = 6) -> tuple[float, dict]:
    """(dispatches a greedy decode step records on Vulkan, the launches counted from the
    scheduled module) of the model in ``model_dir``."""
    from app.inference.backends import webgpu
    from app.inference.compile.targets import make_target
    from app.inference.engine.tvm_engine import load_engine
    from app.inference.hardware.device_spec import DeviceSpec

    engine = load_engine(model_dir, device="vulkan")
    try:
        rt = engine.runtime
        token = int(np.argmax(rt.prefill([5, 6, 7])))
        before = webgpu.stats(rt.device.index)
        rt.decode_greedy_ahead(token, steps)
        after = webgpu.stats(rt.device.index)
        counted = decode_step_kernels(scheduled_module(engine.config, make_target(DeviceSpec("vulkan", 0))))
    finally:
        engine.close()
    return (after["dispatches"] - before["dispatches"]) / steps, counted


def test_the_switch_is_part_of_the_library_key(monkeypatch):
    """A library compiled with the fusion off is never reused with it on (and back)."""
    from app.inference.compile.cache import library_key
    from app.inference.engine.random_model import preset_config

    cfg = preset_config("tiny-llama", "q4f16_1")
    monkeypatch.setenv(wgsl_fusion.FUSION_ENV, "on")
    on = library_key(cfg, "vulkan", "wgsl-f16-wg49152-t256").digest()
    assert wgsl_fusion.use_wgsl_fusion(_target()) is True
    monkeypatch.setenv(wgsl_fusion.FUSION_ENV, "off")
    off = library_key(cfg, "vulkan", "wgsl-f16-wg49152-t256").digest()
    assert on != off
    assert wgsl_fusion.use_wgsl_fusion(_target()) is False
    monkeypatch.delenv(wgsl_fusion.FUSION_ENV)
    assert wgsl_fusion.use_wgsl_fusion(_target()) is False  # not by default (slower on the H200)
    assert wgsl_fusion.use_int8_fusion(_target()) is True  # the int8 kernel's instead
    default = library_key(cfg, "vulkan", "wgsl-f16-wg49152-t256").digest()
    assert default not in (on, off)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "host": {"kind": "llvm"}})
    assert wgsl_fusion.use_wgsl_fusion(cuda) is False
    assert gpu.fusion_passes(cuda) == []


def test_a_kernel_over_the_workgroup_memory_limit_is_not_made():
    """llmchat's GEMV stages a 4096-wide vector (16 KiB) in workgroup memory: with the fused
    reduction's buffers that fits 48 KiB, but not an adapter limit just above the staging."""
    _fmt, mod, _named = _pair_module("rms", "q4f16_1", 4096, 4096, False)
    (_, prologue), (_, gemv) = _decode_calls(mod)
    target = _target()
    fused = wgsl_fusion.fused_func(prologue, gemv, gpu.schedule_rules(target), target)
    assert fused is not None
    used = wgsl_fusion.shared_bytes(fused)
    assert 4096 * 4 <= used < 49152
    tight = tvm.target.Target({**WEBGPU, "max_shared_memory_per_block": used + 64})
    # llmchat's GEMV would stage the vector in padded chunks (18 KiB), over this limit: it leaves
    # the GEMV to dlight's, which reads the vector in the reduction, and what is fused stays
    # within the limit (no staging)
    tight_fused = wgsl_fusion.fused_func(prologue, gemv, gpu.schedule_rules(tight), tight)
    assert tight_fused is not None and wgsl_fusion.shared_bytes(tight_fused) < 4096 * 4


def test_an_element_wise_consumer_keeps_its_prologue():
    """Only GEMVs take the prologue in: an element-wise kernel reading the norm's output (every
    workgroup would recompute the sum of squares for a few elements) keeps two kernels."""
    from tvm import te

    from app.inference.pipelines.cuda_rms_norm import reference_rms_norm

    one, k = tvm.tirx.const(1, "int64"), tvm.tirx.const(96, "int64")
    x = te.placeholder((one, one, k), "float16", name="x")
    r = te.placeholder((one, one, k), "float16", name="r")
    add = te.compute((one, one, k), lambda a, b, c: x[a, b, c] + r[a, b, c], name="add")
    consumer = te.create_prim_func([x, r, add])
    target = _target()
    assert not wgsl_fusion.is_gemv(consumer)
    assert (
        wgsl_fusion.fused_func(reference_rms_norm(96, EPS), consumer, gpu.schedule_rules(target), target)
        is None
    )
    _fmt, mod, _named = _pair_module("rms", "q4f16_1", 96, 7, False)
    assert wgsl_fusion.is_gemv(_decode_calls(mod)[1][1])


def test_the_norms_scale_is_one_workgroup_value_written_once():
    """The rsqrt of the sum of squares lives in workgroup memory, written by one thread and read
    after a barrier (in a register it aliased the reduction's buffer: a race between threads)."""
    import re

    _fmt, _named, _calls, fused = _fused("rms", "q4f16_1", 896, 1152, False)
    lib = tvm.compile(tvm.IRModule({"main": fused.with_attr("global_symbol", "main")}), target=_target())
    src = "\n".join(m.inspect_source() for m in lib.mod.imports)
    store = re.search(r"if \(i32\(threadIdx\.x\) == 0i\) \{\s*(\w+)\[0i\] = \(1\.0+e\+00f / sqrt", src)
    assert store, src[:3000]
    assert re.search(rf"var<workgroup> {store.group(1)} : array<f32, 1>;", src)
    after = src[store.end() :]
    assert after.index("workgroupBarrier()") < after.index(f"{store.group(1)}[0i]")


def test_the_gemv_before_a_norm_writes_its_vector_and_the_norms_launch_goes(monkeypatch):
    """``int8-q8n``: where a norm's input is a GEMV's output (every norm but the first layer's,
    which follows the embedding), that GEMV (the o and the down projections) also writes the
    vector quantized for the norm and the GEMVs after the norm apply its scale: the norm's launch
    goes, two a layer fewer than the default."""
    monkeypatch.setattr(wgsl_fusion, "INT8_NORM_MAX_K", 0)
    default = _tiny_counts(monkeypatch, "int8-q8s")
    q8n = _tiny_counts(monkeypatch, "int8-q8n")
    layers = layers_of_tiny()
    assert sum(default.values()) - sum(q8n.values()) == 2 * layers
    assert sum(v for name, v in q8n.items() if "rms_norm" in name) == 1  # after the embedding
    producers = [name for name in q8n if name.endswith("_q8n_out")]
    assert sum(q8n[name] for name in producers) == 2 * layers  # o and down of every layer
    assert any(name.endswith("_add_q8_q8n_out") for name in producers)  # down reads gate_up's words
    readers = [name for name in q8n if name.endswith(("_q8n", "_q8n_q8out"))]
    # q/k/v after the first layer, every gate_up, the logits
    assert sum(q8n[name] for name in readers) == 2 * layers
    # rows up to the limit keep the norm inside the GEMV, and nothing changes
    monkeypatch.setattr(wgsl_fusion, "INT8_NORM_MAX_K", 1024)
    assert sum(_tiny_counts(monkeypatch, "int8-q8n").values()) == sum(
        _tiny_counts(monkeypatch, "int8-q8s").values()
    )


def test_the_default_folds_the_norm_for_every_row_and_q8ns_up_to_its_limit(monkeypatch):
    """By default the norm folds into the GEMVs around it whatever the row's width (the tiny
    llama's 64 with the norm's own kernel forced, also with the limit below it); ``int8-q8ns``
    only for rows up to :data:`~wgsl_fusion.NORM_OUT_MAX_K`, not over it."""
    monkeypatch.setattr(wgsl_fusion, "INT8_NORM_MAX_K", 0)
    assert wgsl_fusion.NORM_OUT_MAX_K == 2048
    q8n = _tiny_counts(monkeypatch, "int8-q8n")
    assert _tiny_counts(monkeypatch, "") == q8n
    assert _tiny_counts(monkeypatch, "int8-q8ns") == q8n
    monkeypatch.setattr(wgsl_fusion, "NORM_OUT_MAX_K", 32)
    assert _tiny_counts(monkeypatch, "") == q8n
    assert _tiny_counts(monkeypatch, "int8-q8ns") == _tiny_counts(monkeypatch, "int8-q8s")
    assert sum(q8n.values()) < sum(_tiny_counts(monkeypatch, "int8-q8s").values())


@pytest.mark.parametrize(("family", "tol"), [("llama", 2e-2), ("qwen2", 1e-2)])
def test_the_norm_written_by_the_gemv_before_it_matches_float64_on_vulkan(
    tiny_model_dir, monkeypatch, family, tol
):
    """On Vulkan (lavapipe in CI) the tiny models with every norm but the first folded into the
    GEMVs around it (``int8-q8n``, the limit at 0) against the float64 reference (prefill over
    two chunks, then decode steps: the engine tests' tolerances), and each greedy step dispatches
    the launches counted."""
    need_vulkan()
    from tests.inference.backends.test_webgpu_engine import DECODE_STEPS, PROMPT_LEN
    from tests.inference.reference import check_engine_against_reference

    model_dir = tiny_model_dir(family, "q4f16_1")
    monkeypatch.setattr(wgsl_fusion, "INT8_NORM_MAX_K", 0)
    monkeypatch.setenv(wgsl_fusion.FUSION_ENV, "int8-q8n")
    check_engine_against_reference(model_dir, "vulkan", tol, PROMPT_LEN, DECODE_STEPS)
    dispatched, counted = _greedy_dispatches(model_dir)
    assert any(name.endswith("_q8n_out") for name in counted), counted
    assert dispatched == sum(counted.values()), counted
