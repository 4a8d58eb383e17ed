"""Subgroups on WGSL and the decode GEMV family for WGSL.

- Adapter profiles with a fixed subgroup size (``-sg32``): parsed, printed, refused when TVM's
  shuffles could not use them; the subgroup size chosen only when the adapter reports one size.
- Compiled for a ``-sg32`` profile, the decode GEMV reduces with subgroup shuffles, and the
  broadcast of a row's sum reads a lane inside the subgroup (TVM passes the leader's thread index
  in the workgroup, ``threadIdx.y * 32``, which WGSL leaves undefined beyond the subgroup size).
- On the real Vulkan driver here (lavapipe in CI, which offers no subgroups): what the adapter
  reports agrees between the add-on's device attributes and the profile; the GEMV variants of
  ``pipelines/wgsl_gemv`` compute what numpy computes, including the unpadded ``u32``-load ones
  that reach the 11008-wide down projection.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm

from app.errors import LlmchatError
from app.inference.backends import webgpu
from app.inference.pipelines import gpu, gpu_gemv, wgsl_gemv, wgsl_subgroups
from tests.inference.backends.vulkan_env import need_vulkan

SG32 = "wgsl-f16-wg49152-t256-sg32"
PLAIN = "wgsl-f16-wg49152-t256"


def _adapter(**kw) -> webgpu.Adapter:
    base = {
        "index": 0,
        "name": "x",
        "vendor": "v",
        "device_type": "DiscreteGPU",
        "backend": "Vulkan",
        "driver": "d",
        "shader_f16": True,
        "limits": {
            "max_compute_workgroup_storage_size": 49152,
            "max_compute_invocations_per_workgroup": 1024,
        },
    }
    return webgpu.Adapter(**{**base, **kw})


def _target(profile: str) -> tvm.target.Target:
    return tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile=profile))


def test_profiles_with_a_subgroup_size_round_trip_and_old_ones_still_parse():
    p = webgpu.Profile.parse(SG32)
    assert (p.f16, p.workgroup_bytes, p.threads, p.subgroup) == (True, 49152, 256, 32)
    assert str(p) == SG32
    old = webgpu.Profile.parse("wgsl-f16-wg32768-t256")
    assert old.subgroup == 0 and str(old) == "wgsl-f16-wg32768-t256"
    assert str(webgpu.Profile.parse("wgsl-f32-wg16384-t128-sg32")) == "wgsl-f32-wg16384-t128-sg32"
    for bad in ("wgsl-f16-wg49152-t256-sg48", "wgsl-f16-wg49152-t256-sg0", "wgsl-f16-wg49152-t256-sg8"):
        with pytest.raises(LlmchatError) as err:
            webgpu.Profile.parse(bad)
        assert "subgroups of" in str(err.value) and "-sgN" in err.value.fix
    with pytest.raises(LlmchatError) as err:
        webgpu.Profile.parse("wgsl-f16-wg49152-t256-sg")
    assert "not a WGSL adapter profile" in str(err.value) and "-sgN" in err.value.fix


def test_the_subgroup_size_is_used_only_when_the_adapter_reports_one_size(monkeypatch):
    monkeypatch.delenv("LLMCHAT_WGSL_SUBGROUPS", raising=False)
    fixed = _adapter(subgroups=True, subgroup_min_size=32, subgroup_max_size=32)
    assert webgpu.subgroup_size(fixed) == 32
    assert str(webgpu.Profile.of(fixed)) == SG32
    # RDNA reports 32..64 (wave32 or wave64 at the driver's choice), Intel 8..32: not fixed
    assert webgpu.subgroup_size(_adapter(subgroups=True, subgroup_min_size=32, subgroup_max_size=64)) == 0
    assert (
        str(webgpu.Profile.of(_adapter(subgroups=True, subgroup_min_size=8, subgroup_max_size=32))) == PLAIN
    )
    assert webgpu.subgroup_size(_adapter(subgroups=False, subgroup_min_size=32, subgroup_max_size=32)) == 0
    assert webgpu.subgroup_size(_adapter(subgroups=True, subgroup_min_size=2, subgroup_max_size=2)) == 0
    # one fixed size but not 32 (lavapipe's subgroups are 8 wide): TVM's lowering assumes 32
    assert webgpu.subgroup_size(_adapter(subgroups=True, subgroup_min_size=8, subgroup_max_size=8)) == 0
    # wgpu-native 29 offers subgroups without their size (lavapipe, NVIDIA): not used
    assert webgpu.subgroup_size(_adapter(subgroups=True)) == 0
    monkeypatch.setenv("LLMCHAT_WGSL_SUBGROUPS", "0")
    assert webgpu.subgroup_size(fixed) == 0 and str(webgpu.Profile.of(fixed)) == PLAIN


def test_targets_use_subgroups_only_for_a_sg_profile():
    sg = webgpu.target_dict(0, {"kind": "llvm"}, profile=SG32)
    assert sg["thread_warp_size"] == 32 and sg["supports_subgroups"] is True
    plain = webgpu.target_dict(0, {"kind": "llvm"}, profile=PLAIN)
    assert plain["thread_warp_size"] == 1 and plain["supports_subgroups"] is False
    assert wgsl_subgroups.tir_pipeline(_target(SG32)) == wgsl_subgroups.PIPELINE
    assert wgsl_subgroups.tir_pipeline(_target(PLAIN)) == "default"
    # --arch with -sgN: the library's fingerprint (cache key, prebuilt label) carries the size
    from app.inference.compile import targets
    from app.inference.hardware.device_spec import DeviceSpec

    assert targets.device_fingerprint(DeviceSpec("vulkan", 0), SG32) == SG32
    assert targets.device_fingerprint(DeviceSpec("vulkan", 0), PLAIN) == PLAIN


def _decode_gemv(in_f: int, out_f: int):
    """The decode PrimFunc of one q4f16_1 linear layer, as the GPU pipeline fuses it."""
    from tvm import relax

    from tests.inference.test_dequant_prefill import _kernel_of, _module

    fmt, _dtype, mod, named = _module("q4f16_1", in_f=in_f, out_f=out_f)
    with tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(
            [
                relax.transform.LegalizeOps(),
                relax.transform.AnnotateTIROpPattern(),
                relax.transform.FuseOps(),
                relax.transform.FuseTIR(),
                gpu.fast_decode_pass(),
            ]
        )(mod)
    return fmt, _kernel_of(mod, "decode"), named


def _wgsl(func, target, pipeline: str) -> str:
    lib = tvm.compile(
        tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target, tir_pipeline=pipeline
    )
    return "\n".join(m.inspect_source() for m in lib.mod.imports)


@pytest.mark.parametrize("threads_per_row", [32, 16])
def test_sg32_gemv_reduces_with_shuffles_and_broadcasts_from_a_lane_of_the_subgroup(threads_per_row):
    target = _target(SG32)
    _fmt, func, _named = _decode_gemv(1024, 512)
    with target:
        sch = gpu_gemv.DecodeGEMV(max_threads_per_row=threads_per_row, min_blocks=16).apply(
            func, target, False
        )
    assert sch is not None
    scheduled = sch.mod["main"]
    src = _wgsl(scheduled, target, wgsl_subgroups.tir_pipeline(target))
    assert "enable subgroups;" in src
    assert len(re.findall(r"subgroupShuffleDown\(", src)) == int(np.log2(threads_per_row))
    broadcasts = re.findall(r"subgroupShuffle\((.*)\);", src)
    assert broadcasts, src[-1500:]
    rows = 256 // threads_per_row
    for lane in broadcasts:
        # row y's sum sits in the first lane of its threads: linear thread y * t, which is lane
        # (y * t) % 32 of its subgroup; TVM's lane expression, fixed, must give exactly that
        assert _lanes(lane, rows) == [(y * threads_per_row) % 32 for y in range(rows)], lane
    # TVM's own pipeline leaves the workgroup-wide index there: the lane fix is what changes it
    unfixed = _wgsl(scheduled, target, "default")
    assert any(max(_lanes(lane, rows)) >= 32 for lane in re.findall(r"subgroupShuffle\((.*)\);", unfixed))
    # the profile without subgroups: a workgroup-memory reduction, no subgroup code
    plain = _target(PLAIN)
    with plain:
        plain_sch = gpu_gemv.DecodeGEMV(max_threads_per_row=threads_per_row, min_blocks=16).apply(
            func, plain, False
        )
    plain_src = _wgsl(plain_sch.mod["main"], plain, wgsl_subgroups.tir_pipeline(plain))
    assert "subgroup" not in plain_src and "var<workgroup> red_buf" in plain_src


def _lanes(call_args: str, rows: int, cols: int = 1, depth: int = 1) -> list[int]:
    """The lanes a ``subgroupShuffle(value, lane)`` reads for every thread of a workgroup of
    (cols, rows, depth) threads, in threadIdx.y-major order for threadIdx.x = z = 0 first (the
    lanes that write the outputs), by evaluating its WGSL integer expression."""
    expr = call_args.split(",", 1)[1].strip()
    assert re.fullmatch(r"[\w().*&%+>< -]+", expr), expr
    py = re.sub(r"\b(u32|i32)\(", "(", expr)
    py = re.sub(r"(\d+)[iu]\b", r"\1", py)
    py = py.replace("threadIdx.x", "x").replace("threadIdx.y", "y").replace("threadIdx.z", "z")
    return [
        int(eval(py, {"__builtins__": {}}, {"x": x, "y": y, "z": z}))
        for z in range(depth)
        for x in range(cols)
        for y in range(rows)
    ][: rows if cols == depth == 1 else None]


def test_the_model_compiled_for_a_sg32_profile_has_every_broadcast_inside_the_subgroup(tmp_path):
    """The tiny Llama through llmchat's real compile path (``--arch`` with ``-sg32``), WGSL checked."""
    from app.inference.compile import build, targets
    from app.inference.compile.build import export_model
    from app.inference.engine.random_model import preset_config
    from app.inference.hardware.device_spec import DeviceSpec

    target = targets.make_target(DeviceSpec("vulkan", 0), arch=SG32)
    assert int(target.attrs["thread_warp_size"]) == 32
    mod, _ = export_model(preset_config("tiny-llama", "q4f16_1"), target)
    out = tmp_path / "lib.so"
    build._build(mod, target, gpu.gpu_pipeline(target), out, None)
    # the library embeds its WGSL as text (read without loading: lavapipe has no subgroups)
    src = out.read_bytes().decode("latin-1")
    assert "enable subgroups;" in src
    kernels = re.split(r"@compute @workgroup_size\(", src)[1:]
    checked = 0
    for kernel in kernels:  # every broadcast of every kernel reads a lane inside the subgroup
        cols, rows, depth = (int(v) for v in re.match(r"(\d+), (\d+), (\d+)\)", kernel).groups())
        for lane in re.findall(r"subgroupShuffle\((.*)\);", kernel.split("@compute")[0]):
            assert max(_lanes(lane, rows, cols, depth)) < 32, (lane, cols, rows, depth)
            checked += 1
    assert checked


def test_gemv_variants_are_named_and_an_unknown_one_is_refused(monkeypatch):
    monkeypatch.delenv(wgsl_gemv.ENV, raising=False)
    target = _target(PLAIN)
    default = [r for r in gpu.schedule_rules(target) if isinstance(r, gpu_gemv.DecodeGEMV)]
    # the sweep's choice: 8 threads per row, 16-byte loads; u32 loads for rows those do not tile
    assert [(r.load_bytes, r.max_threads_per_row, r.min_blocks, r.pad_shared) for r in default] == [
        (16, 8, 128, True),
        (4, 8, 128, False),
    ]
    assert default[1].min_reduction == 8192  # rows of 8192 or more only (the 7B down projection)
    monkeypatch.setenv(wgsl_gemv.ENV, wgsl_gemv.PREVIOUS)
    (previous,) = [r for r in gpu.schedule_rules(target) if isinstance(r, gpu_gemv.DecodeGEMV)]
    assert (previous.load_bytes, previous.max_threads_per_row, previous.min_blocks) == (16, 32, 512)
    monkeypatch.setenv(wgsl_gemv.ENV, "t32-b128-l4-u4-mb128-nopad, T16-b256-l16-u4")
    chosen = [r for r in gpu.schedule_rules(target) if isinstance(r, gpu_gemv.DecodeGEMV)]
    assert [(r.load_bytes, r.max_threads_per_row, r.pad_shared) for r in chosen] == [
        (4, 32, False),
        (16, 16, True),
    ]
    assert all(r.stage_vector_lanes <= 4 for r in chosen)
    monkeypatch.setenv(wgsl_gemv.ENV, "t7-fast")
    with pytest.raises(LlmchatError) as err:
        gpu.schedule_rules(target)
    assert "t7-fast" in str(err.value) and "t32-b256-l16-u4" in err.value.fix
    # the switch is part of the library's cache key
    from app.inference.compile import cache

    assert wgsl_gemv.ENV in cache.KERNEL_SWITCHES


def test_the_adapter_here_reports_its_subgroups_consistently():
    """lavapipe (CI) offers subgroups through wgpu-native 29 but reports no size: its profile has
    no -sgN and the add-on tells TVM a warp size of 1; an adapter with one fixed size gets that
    size in both."""
    need_vulkan()
    a = webgpu.adapters()[0]
    size = webgpu.subgroup_size(a)
    profile = webgpu.fingerprint(0)
    assert profile.endswith(f"-sg{size}") if size else "-sg" not in profile
    if a.subgroups and a.subgroup_min_size == a.subgroup_max_size > 0:
        assert webgpu.device(0).warp_size == a.subgroup_min_size
    else:
        assert webgpu.device(0).warp_size == 1


SHAPES = [
    # variant, in features, out features (11008: the 7B down projection's width, which
    # 16-byte loads by 32 threads do not tile); the first two are the default
    ("t8-b256-l16-u4-mb128", 1024, 4096),
    ("t8-b256-l4-u4-mb128-nopad-k8192-n4096", 11008, 4096),
    ("t32-b256-l16-u4", 1024, 4096),
    ("t32-b256-l4-u4-nopad", 1024, 4096),
    ("t32-b128-l4-u4-mb128-nopad", 11008, 1024),
    ("t16-b256-l8-u4-mb128", 2048, 2048),
]


def test_a_staged_vector_larger_than_the_workgroup_memory_is_declined_not_a_failed_compile():
    """The down projection's 11008-wide vector in fp32 takes 44 KiB unpadded, 66 KiB in padded
    chunks of 8: a rule that would stage more than the profile's workgroup memory declines it
    (dlight's GEMV then takes it) instead of TVM failing the whole build."""
    _fmt, func, _named = _decode_gemv(11008, 4096)
    for profile, variant, takes in [
        (PLAIN, "t8-b256-l4-u4-mb128-nopad-k8192-n4096", True),
        ("wgsl-f16-wg32768-t256", "t8-b256-l4-u4-mb128-nopad", False),
        (PLAIN, "t32-b256-l4-u4", False),  # padded: 66 KiB
    ]:
        target = _target(profile)
        with target:
            sch = wgsl_gemv.rule(variant).apply(func, target, False)
        assert (sch is not None) == takes, (profile, variant)
        if sch is not None:  # and what it takes compiles within the profile's limit
            src = _wgsl(sch.mod["main"], target, "default")
            assert "var<workgroup>" in src


@pytest.mark.parametrize(("variant", "in_f", "out_f"), SHAPES, ids=[s[0] for s in SHAPES])
def test_gemv_variants_match_numpy_on_vulkan(variant, in_f, out_f, tmp_path):
    need_vulkan()
    target = _target(PLAIN)
    fmt, func, named = _decode_gemv(in_f, out_f)
    with target:
        sch = wgsl_gemv.rule(variant).apply(func, target, False)
    assert sch is not None, f"{variant} did not take a {in_f}->{out_f} GEMV"
    path = tmp_path / "gemv.so"
    tvm.compile(
        tvm.IRModule({"main": sch.mod["main"].with_attr("global_symbol", "main")}), target=target
    ).export_library(str(path))
    lib = tvm.runtime.load_module(str(path))
    rng = np.random.default_rng(in_f + out_f)
    w = rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)
    enc = fmt.quantize(w)
    params = [np.ascontiguousarray(enc[n.rpartition(".")[2]]).astype(str(p.dtype)) for n, p in named]
    x = rng.standard_normal((1, 1, in_f)).astype(np.float16)
    want = fmt.dequantize(enc) @ x.reshape(-1).astype(np.float64)
    dev = webgpu.device(0)
    out = tvm.runtime.empty((1, 1, out_f), "float16", dev)
    lib["main"](tvm.runtime.tensor(x, dev), *[tvm.runtime.tensor(p, dev) for p in params], out)
    got = out.numpy().reshape(-1).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.max(np.abs(want)))


def test_doctor_says_what_the_adapter_offers_in_subgroups():
    """``llmchat doctor`` (a real process) shows each adapter's subgroups as the profile uses them
    (lavapipe in CI: offered, size not reported)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    need_vulkan()
    a = webgpu.adapters()[0]
    proc = subprocess.run(
        [sys.executable, "-m", "app", "doctor"],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("[0]") and a.name in x)
    if not a.subgroups:
        assert "subgroups no" in line, line
    elif not a.subgroup_min_size:  # wgpu-native 29 (lavapipe here): offered, size not reported
        assert "subgroups yes, size not reported (not used)" in line, line
    elif a.subgroup_min_size == a.subgroup_max_size:
        assert f"subgroups {a.subgroup_min_size} wide" in line, line
    else:
        assert "not used: the size varies" in line, line


def test_llmchat_build_takes_a_sg_profile(tiny_model_dir, tmp_path, capsys):
    """``llmchat build --device vulkan --arch …-sg32`` (no such adapter needed) writes a bundle
    labelled with the subgroup size; a size TVM cannot use is a clear error, nothing written."""
    from app.cli import main

    model = tiny_model_dir("llama", "q4f16_1")
    bad = tmp_path / "bad"
    assert (
        main(["build", str(model), "--device", "vulkan", "--arch", SG32[:-4] + "sg48", "--out", str(bad)])
        == 1
    )
    err = capsys.readouterr().err
    assert "subgroups of 48" in err and "fix:" in err and "Traceback" not in err
    assert not bad.exists() or list(bad.iterdir()) == []
    out = tmp_path / "bundles"
    assert main(["build", str(model), "--device", "vulkan", "--arch", SG32, "--out", str(out)]) == 0
    (bundle,) = out.iterdir()
    assert f"bundle for vulkan-{SG32}" in capsys.readouterr().err
    assert SG32 in (bundle / "manifest.json").read_text()
    libs = [p for p in bundle.iterdir() if p.suffix == ".so"]
    assert libs and "enable subgroups;" in libs[0].read_bytes().decode("latin-1")


def test_tvm_lowers_wgsl_reductions_for_32_wide_subgroups_whatever_the_target_says():
    """Why only -sg32: for an 8-wide target TVM still reduces 16 threads with a shuffle down by 8
    and wraps the broadcast at 32, which an 8-wide subgroup (lavapipe's) does not have."""
    target = tvm.target.Target(
        {
            **webgpu.target_dict(0, {"kind": "llvm"}, profile=PLAIN),
            "thread_warp_size": 8,
            "supports_subgroups": True,
        }
    )
    _fmt, func, _named = _decode_gemv(1024, 512)
    with target:
        sch = gpu_gemv.DecodeGEMV(max_threads_per_row=16, min_blocks=16).apply(func, target, False)
    src = _wgsl(sch.mod["main"], target, wgsl_subgroups.tir_pipeline(target))
    assert "subgroupShuffleDown(red_buf0[0i], u32(8i))" in src
    with pytest.raises(LlmchatError):
        webgpu.Profile.parse("wgsl-f16-wg49152-t256-sg8")


def test_the_down_projection_rule_leaves_narrower_rows_to_dlight():
    """The default's u32-load rule was measured on 11008-wide rows only: a 896-wide GEMV
    (Qwen2.5-0.5B), which 16-byte loads by 8 threads do not tile either, keeps dlight's GEMV."""
    target = _target(PLAIN)
    _fmt, func, _named = _decode_gemv(896, 4864)
    with target:
        assert wgsl_gemv.rule("t8-b256-l4-u4-mb128-nopad-k8192").apply(func, target, False) is None
        assert wgsl_gemv.rule("t8-b256-l4-u4-mb128-nopad").apply(func, target, False) is not None


def test_the_down_projection_rule_leaves_fewer_rows_to_dlight():
    """The default's u32-load rule gained on Llama-2-7B's 11008 -> 4096 down projection and lost
    on Qwen2.5-3B's 11008 -> 2048 (64 workgroups of 32 rows; H200: 199.8 against 219.4 tok/s):
    fewer than 4096 output rows keep dlight's GEMV."""
    assert "t8-b256-l4-u4-mb128-nopad-k8192-n4096" in wgsl_gemv.DEFAULT
    target = _target(PLAIN)
    rule = wgsl_gemv.rule("t8-b256-l4-u4-mb128-nopad-k8192-n4096")
    with target:
        assert rule.apply(_decode_gemv(11008, 2048)[1], target, False) is None
        assert rule.apply(_decode_gemv(11008, 4096)[1], target, False) is not None
