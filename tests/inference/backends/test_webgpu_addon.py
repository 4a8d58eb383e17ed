"""llmchat's WebGPU device API on a real Vulkan driver (lavapipe in CI): memory, copies of odd
sizes and offsets, kernels TVM compiled for WGSL (a grid over 65,535 workgroups among them),
loading a module from a cached library in a fresh process, and the errors a user can meet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.inference.backends.vulkan_env import need_vulkan

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def dev():
    need_vulkan()
    from app.inference.backends import webgpu

    return webgpu.device(0)


def _child(script: str, **env: str) -> str:
    """Run ``script`` in a fresh Python process (the add-on reads its switches when a device is
    first made) with ``env`` added; its standard output, after checking it exited cleanly."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **env),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _scale_module(tmp_path: Path, block: int = 64) -> Path:
    """TVM compiles B[i] = A[i] * 2 + 1 (any n) for the webgpu target and exports it."""
    import tvm
    from tvm import s_tir, te

    n = te.var("n")
    a = te.placeholder((n,), name="A", dtype="float32")
    b = te.compute((n,), lambda i: a[i] * 2.0 + 1.0, name="B")
    mod = tvm.IRModule({"scale": te.create_prim_func([a, b]).with_attr("global_symbol", "scale")})
    sch = s_tir.Schedule(mod)
    sch.work_on("scale")
    (i,) = sch.get_loops(sch.get_sblock("B"))
    bx, tx = sch.split(i, [None, block])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    lib = tvm.compile(sch.mod, target=tvm.target.Target({"kind": "webgpu", "host": "llvm"}))
    path = tmp_path / "scale.so"
    lib.export_library(str(path))
    return path


def test_adapters_are_listed_with_their_limits(dev):
    from app.inference.backends import webgpu

    found = webgpu.adapters()
    assert found, "wgpu found no adapter"
    a = found[0]
    assert a.name and a.backend == "Vulkan"
    assert a.limits["max_storage_buffers_per_shader_stage"] >= 8
    assert a.limits["max_compute_workgroup_storage_size"] >= 16384
    assert dev.exist and dev.device_name == a.name


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "uint8", "int32"])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 1000, 4097])
def test_copies_round_trip_exactly(dev, dtype, n):
    import tvm

    rng = np.random.default_rng(n)
    host = (rng.standard_normal(n) * 50).astype(dtype)
    t = tvm.runtime.tensor(host, dev)
    assert np.array_equal(t.numpy(), host)
    # device -> device into a fresh buffer
    u = tvm.runtime.empty((n,), dtype, dev)
    t.copyto(u)
    assert np.array_equal(u.numpy(), host)


def test_views_at_odd_offsets_read_and_write_only_their_bytes(dev):
    """Copies into and out of 1- and 2-byte views at unaligned offsets keep the neighbours."""
    import tvm

    base = np.arange(64, dtype="uint8")
    t = tvm.runtime.tensor(base, dev)
    for offset, size in [(1, 1), (3, 2), (5, 7), (13, 31), (62, 2), (0, 3)]:
        view = t._create_view((size,), "uint8", offset)
        assert np.array_equal(view.numpy(), base[offset : offset + size])
        patch = (200 + np.arange(size)).astype("uint8")
        view.copyfrom(patch)
        base[offset : offset + size] = patch
        assert np.array_equal(t.numpy(), base), f"neighbours changed at offset {offset}, size {size}"
    # half-precision views at an offset of one element (2 bytes)
    h = np.linspace(-3, 3, 33).astype("float16")
    th = tvm.runtime.tensor(h, dev)
    v = th._create_view((5,), "float16", 2)
    assert np.array_equal(v.numpy(), h[1:6])
    dst = tvm.runtime.empty((5,), "float16", dev)
    v.copyto(dst)
    assert np.array_equal(dst.numpy(), h[1:6])


def test_kernels_run_exactly_including_a_grid_over_65535_workgroups(dev, tmp_path):
    import tvm

    lib = tvm.runtime.load_module(str(_scale_module(tmp_path)))
    for n in (1, 63, 64, 65, 10_000, 64 * 70_001 + 3):  # the last: 70,002 workgroups, folded into z
        a = np.random.default_rng(n).standard_normal(n).astype("float32")
        ta, tb = tvm.runtime.tensor(a, dev), tvm.runtime.tensor(np.full(n, -7, "float32"), dev)
        lib["scale"](ta, tb)
        assert np.array_equal(tb.numpy(), a * np.float32(2) + np.float32(1)), f"wrong result for n={n}"


def test_the_next_launch_reads_the_recorded_buffer_in_place_of_an_argument(dev, tmp_path):
    """``llmchat.webgpu.substitute_next`` (the fused RoPE and append of the decode attention):
    the next launch binds the buffer ``record_qkv`` recorded in place of the argument named,
    that launch only; once the recorded buffer is freed, asking for it is a clear error."""
    import tvm

    lib = tvm.runtime.load_module(str(_scale_module(tmp_path)))
    record = tvm.get_global_func("llmchat.webgpu.record_qkv")
    substitute = tvm.get_global_func("llmchat.webgpu.substitute_next")
    a = np.arange(100, dtype="float32")
    c = np.arange(200, dtype="float32")[::-1].copy()
    ta, tb, tc = (tvm.runtime.tensor(x, dev) for x in (a, np.zeros(100, "float32"), c))
    record(tc)
    substitute(ta, 0)
    lib["scale"](ta, tb)
    assert np.array_equal(tb.numpy(), c[:100] * np.float32(2) + np.float32(1))  # read C, not A
    lib["scale"](ta, tb)
    assert np.array_equal(tb.numpy(), a * np.float32(2) + np.float32(1))  # that launch only
    del tc  # freed: nothing recorded any more
    substitute(ta, 0)
    with pytest.raises(Exception, match="no q/k/v projection was recorded"):
        lib["scale"](ta, tb)
    substitute(ta, 5)
    with pytest.raises(Exception, match="no buffer argument 5 to substitute"):
        lib["scale"](ta, tb)
    lib["scale"](ta, tb)  # and the device still works afterwards
    assert np.array_equal(tb.numpy(), a * np.float32(2) + np.float32(1))


def test_a_grid_of_exactly_65536_workgroups_does_not_write_past_the_end(dev, tmp_path):
    """packGridDimX: the folded grid has padding workgroups that must do nothing."""
    import tvm

    lib = tvm.runtime.load_module(str(_scale_module(tmp_path, block=1)))
    n = 65_537  # 65,537 one-thread workgroups: x folds to 32,769 x z 2 = 65,538, one too many
    a = np.arange(n, dtype="float32")
    big = tvm.runtime.tensor(np.full(n + 64, -1, "float32"), dev)
    out = big._create_view((n,), "float32", 0)
    lib["scale"](tvm.runtime.tensor(a, dev), out)
    got = big.numpy()
    assert np.array_equal(got[:n], a * 2 + 1)
    assert np.all(got[n:] == -1), "a padding workgroup wrote past the end"


def test_dispatches_are_batched_into_few_submits(dev, tmp_path):
    """Launches are recorded into one encoder: 50 kernels, one read back, one or two submits."""
    import tvm

    from app.inference.backends import webgpu

    lib = tvm.runtime.load_module(str(_scale_module(tmp_path)))
    a = tvm.runtime.tensor(np.ones(256, "float32"), dev)
    b = tvm.runtime.empty((256,), "float32", dev)
    lib["scale"](a, b)
    lib["scale"](b, a)  # both bind groups made once here
    tvm.runtime.tensor(np.ones(256, "float32"), dev).copyto(a)
    b.numpy()
    before = webgpu.stats(0)
    for _ in range(25):
        lib["scale"](a, b)
        lib["scale"](b, a)
    result = a.numpy()
    after = webgpu.stats(0)
    assert after["dispatches"] - before["dispatches"] == 50
    assert after["submits"] - before["submits"] <= 2
    assert after["bind_group_misses"] == before["bind_group_misses"], "bind groups were not reused"
    expected = np.ones(256, "float32")
    for _ in range(25):
        expected = (expected * 2 + 1) * 2 + 1
    assert np.array_equal(result, expected)


def test_submitting_every_n_dispatches_keeps_results_and_scalars_exact(dev, tmp_path):
    """LLMCHAT_WEBGPU_SUBMIT_EVERY=3: the pending work is submitted every 3 dispatches (a step's
    first kernels run while the host records the rest); chained kernels still see each other's
    results, and launches of two sizes keep their own scalars in the uniform ring across
    submissions and past its wrap (over 4,096 slots)."""
    lib_path = _scale_module(tmp_path)
    script = textwrap.dedent(f"""
        import json, numpy as np, tvm
        from app.inference.backends import webgpu
        dev = webgpu.device(0)
        lib = tvm.runtime.load_module({str(lib_path)!r})
        a = tvm.runtime.tensor(np.ones(256, "float32"), dev)
        b = tvm.runtime.empty((256,), "float32", dev)
        lib["scale"](a, b); b.numpy()
        before = webgpu.stats(0)
        for _ in range(25):
            lib["scale"](a, b)
            lib["scale"](b, a)
        chained = a.numpy().tolist()
        mid = webgpu.stats(0)
        x = tvm.runtime.tensor(np.arange(256, dtype="float32"), dev)
        y = tvm.runtime.tensor(np.full(256, -7, "float32"), dev)
        u = tvm.runtime.tensor(np.arange(200, dtype="float32") * 3, dev)
        v = tvm.runtime.tensor(np.full(200, -7, "float32"), dev)
        wrong = 0
        for i in range(2100):
            lib["scale"](x, y)
            lib["scale"](u, v)
            if i % 700 == 699:
                wrong += int(not np.array_equal(y.numpy(), np.arange(256, dtype="float32") * 2 + 1))
                wrong += int(not np.array_equal(v.numpy(), np.arange(200, dtype="float32") * 6 + 1))
        after = webgpu.stats(0)
        print(json.dumps(dict(chained=chained, submits=mid["submits"] - before["submits"],
                              wrong=wrong, dispatches=after["dispatches"] - mid["dispatches"])))
    """)
    out = json.loads(_child(script, LLMCHAT_WEBGPU_SUBMIT_EVERY="3").strip().splitlines()[-1])
    expected = np.ones(256, "float32")
    for _ in range(25):
        expected = (expected * 2 + 1) * 2 + 1
    assert np.array_equal(np.array(out["chained"], "float32"), expected)
    assert out["submits"] >= 50 // 3, out  # every 3 dispatches, not once at the read back
    assert out["dispatches"] == 4200 and out["wrong"] == 0, out


def _accumulate_module(tmp_path: Path) -> Path:
    """B[i] += A[i] (256 values, one workgroup of 64 threads a quarter) for the webgpu target."""
    import tvm
    from tvm.script import tirx as T

    @T.prim_func
    def accumulate(a: T.Buffer((256,), "float32"), b: T.Buffer((256,), "float32")):
        T.func_attr({"global_symbol": "accumulate", "tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", 4)
        tx = T.launch_thread("threadIdx.x", 64)
        b[bx * 64 + tx] = b[bx * 64 + tx] + a[bx * 64 + tx]

    lib = tvm.compile(
        tvm.IRModule({"accumulate": accumulate}), target=tvm.target.Target({"kind": "webgpu", "host": "llvm"})
    )
    path = tmp_path / "accumulate.so"
    lib.export_library(str(path))
    return path


def _scale_then_accumulate(tmp_path: Path, env_name: str) -> dict[str, dict]:
    """For each name of ("no-such-kernel", "scale", "accumulate") as ``env_name``'s value, in a
    fresh process: B = A * 2 + 1 into a B of sevens, then C += A into a C of ones (A = 0..255);
    B, C and the dispatches counted."""
    scale, accumulate = _scale_module(tmp_path), _accumulate_module(tmp_path)
    script = textwrap.dedent(f"""
        import json, numpy as np, tvm
        from app.inference.backends import webgpu
        dev = webgpu.device(0)
        scale = tvm.runtime.load_module({str(scale)!r})
        acc = tvm.runtime.load_module({str(accumulate)!r})
        a = tvm.runtime.tensor(np.arange(256, dtype="float32"), dev)
        b = tvm.runtime.tensor(np.full(256, 7, "float32"), dev)
        c = tvm.runtime.tensor(np.ones(256, "float32"), dev)
        before = webgpu.stats(0)
        scale["scale"](a, b)
        acc["accumulate"](a, c)
        out = dict(b=b.numpy().tolist(), c=c.numpy().tolist())
        out["dispatches"] = webgpu.stats(0)["dispatches"] - before["dispatches"]
        print(json.dumps(out))
    """)
    return {
        name: json.loads(_child(script, **{env_name: name}).strip().splitlines()[-1])
        for name in ("no-such-kernel", "scale", "accumulate")
    }


def test_a_named_kernel_can_be_dispatched_twice_for_a_benchmark(dev, tmp_path):
    """LLMCHAT_WEBGPU_REPEAT=NAME (benchmarks/vulkan_profile.py --repeat): every launch of a kernel
    whose name contains NAME runs twice, back to back, with the same arguments: a kernel writing
    another buffer gives what it gave once (a decode step's kernels all do); one adding into its
    output shows the second run; both dispatches are counted. Another name changes nothing."""
    runs = _scale_then_accumulate(tmp_path, "LLMCHAT_WEBGPU_REPEAT")
    expected_b = np.arange(256, dtype="float32") * 2 + 1
    for name, out in runs.items():
        assert np.array_equal(np.array(out["b"], "float32"), expected_b), name
    ones, ramp = np.ones(256, "float32"), np.arange(256, dtype="float32")
    assert np.array_equal(np.array(runs["no-such-kernel"]["c"], "float32"), ones + ramp)
    assert np.array_equal(np.array(runs["scale"]["c"], "float32"), ones + ramp)
    assert np.array_equal(np.array(runs["accumulate"]["c"], "float32"), ones + 2 * ramp)
    assert [runs[n]["dispatches"] for n in runs] == [2, 3, 3], runs


def test_a_named_kernel_can_be_left_out_for_a_benchmark(dev, tmp_path):
    """LLMCHAT_WEBGPU_SKIP=NAME (benchmarks/vulkan_profile.py --skip): a launch of a kernel whose
    name contains NAME dispatches nothing and is not counted; its output keeps what it held, the
    other kernels run as before. Another name changes nothing."""
    runs = _scale_then_accumulate(tmp_path, "LLMCHAT_WEBGPU_SKIP")
    ramp, ones, sevens = np.arange(256, dtype="float32"), np.ones(256, "float32"), np.full(256, 7, "float32")
    assert np.array_equal(np.array(runs["no-such-kernel"]["b"], "float32"), ramp * 2 + 1)
    assert np.array_equal(np.array(runs["no-such-kernel"]["c"], "float32"), ones + ramp)
    assert np.array_equal(np.array(runs["scale"]["b"], "float32"), sevens)
    assert np.array_equal(np.array(runs["scale"]["c"], "float32"), ones + ramp)
    assert np.array_equal(np.array(runs["accumulate"]["b"], "float32"), ramp * 2 + 1)
    assert np.array_equal(np.array(runs["accumulate"]["c"], "float32"), ones)
    assert [runs[n]["dispatches"] for n in runs] == [2, 1, 1], runs


def test_a_cached_library_loads_and_runs_in_a_fresh_process(dev, tmp_path):
    lib_path = _scale_module(tmp_path)
    script = textwrap.dedent(f"""
        import numpy as np, tvm
        from app.inference.backends import webgpu
        dev = webgpu.device(0)
        lib = tvm.runtime.load_module({str(lib_path)!r})
        a = np.arange(1000, dtype="float32")
        b = tvm.runtime.empty((1000,), "float32", dev)
        lib["scale"](tvm.runtime.tensor(a, dev), b)
        print("OK" if np.array_equal(b.numpy(), a * 2 + 1) else "WRONG")
    """)
    assert _child(script).strip().endswith("OK")


def test_the_profiler_times_every_dispatch_on_the_gpu(dev, tmp_path):
    """LLMCHAT_WEBGPU_PROFILE=1: a GPU timestamp around every dispatch, charged to its kernel;
    a kernel over 4M elements takes longer than over 256; off, nothing is timed."""
    lib_path = _scale_module(tmp_path)
    script = textwrap.dedent(f"""
        import json, numpy as np, tvm
        from app.inference.backends import webgpu
        dev = webgpu.device(0)
        lib = tvm.runtime.load_module({str(lib_path)!r})
        out = {{}}
        for n in (256, 1 << 22):
            a = tvm.runtime.tensor(np.ones(n, "float32"), dev)
            b = tvm.runtime.empty((n,), "float32", dev)
            lib["scale"](a, b)
            webgpu.profile_reset(0)
            for _ in range(10):
                lib["scale"](a, b)
                lib["scale"](b, a)
            ok = bool(np.isfinite(a.numpy()).all())
            out[n] = dict(webgpu.profile(0), ok=ok)
        print(json.dumps(out))
    """)

    def child(profile: str) -> dict:
        return json.loads(_child(script, LLMCHAT_WEBGPU_PROFILE=profile).strip().splitlines()[-1])

    on = child("1")
    small, big = on["256"], on[str(1 << 22)]
    for run in (small, big):
        assert run["ok"] and run["enabled"] and run["error"] == ""
        assert [k["count"] for k in run["kernels"]] == [20], run  # one kernel, every dispatch
        assert "scale" in run["kernels"][0]["name"] and run["kernels"][0]["ns"] > 0
        assert run["total_ns"] == run["kernels"][0]["ns"]
    assert big["total_ns"] > 10 * small["total_ns"], (small, big)
    off = child("0")
    assert not off["256"]["enabled"] and off["256"]["kernels"] == [] and off["256"]["total_ns"] == 0


def test_no_adapter_is_a_clear_error_not_a_crash(tmp_path):
    """With no Vulkan driver at all (an empty ICD list), `--device vulkan` says what is missing."""
    need_vulkan()
    empty = tmp_path / "icd.json"
    icd = {"library_path": str(tmp_path / "nothing.so"), "api_version": "1.3.0"}
    empty.write_text(json.dumps({"file_format_version": "1.0.0", "ICD": icd}))
    env = dict(os.environ, VK_DRIVER_FILES=str(empty), VK_ICD_FILENAMES=str(empty))
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "ask", "--device", "vulkan", "hi"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert "no Vulkan adapter" in proc.stderr and "fix:" in proc.stderr


def test_a_missing_adapter_index_is_a_clear_error(dev):
    from app.errors import LlmchatError
    from app.inference.hardware.device_spec import resolve_device

    with pytest.raises(LlmchatError) as err:
        resolve_device("vulkan:7")
    assert "no Vulkan adapter 7" in str(err.value)
    assert resolve_device("vulkan:0").backend == "vulkan"


def test_a_buffer_larger_than_the_adapter_allows_is_an_error_not_a_crash(dev):
    import tvm

    from app.inference.backends import webgpu

    limit = webgpu.adapters()[0].max_buffer_bytes
    with pytest.raises(Exception, match="larger than this adapter allows"):
        tvm.runtime.empty((limit // 4 + 16,), "float32", dev)
    # and the device still works afterwards
    assert np.array_equal(tvm.runtime.tensor(np.arange(5, dtype="int32"), dev).numpy(), np.arange(5))


def test_a_damaged_function_table_is_an_error_not_a_read_past_the_end(dev):
    """The loaders' shared reader (backends/native/tvm_function_table.h) checks every length."""
    import struct

    import tvm

    load = tvm.get_global_func("ffi.Module.load_from_bytes.webgpu")
    name = b"scale_kernel"
    good = struct.pack("<Q", 1) + struct.pack("<Q", len(name)) + name
    for blob in (b"", b"\x01", struct.pack("<Q", 10**12), good, good + struct.pack("<Q", 1 << 40)):
        with pytest.raises(Exception, match="damaged"):
            load(bytearray(blob))
