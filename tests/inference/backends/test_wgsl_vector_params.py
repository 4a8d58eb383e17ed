"""WebGPU kernel parameters accessed only by aligned vector ramps are bound as vectors
(app/inference/pipelines/wgsl_vector_params.py): the WGSL TVM generates, and the kernels run on
lavapipe with the same results."""

from __future__ import annotations

import numpy as np

from tests.gpu.kernels import q4_matmul_func
from tests.inference.backends.vulkan_env import need_vulkan


def _compile(funcs: dict, tmp_path, name: str):
    """(WGSL source, loaded library) of ``funcs`` built for the webgpu target with the pass."""
    import tvm

    from app.inference.backends import webgpu
    from app.inference.pipelines.wgsl_vector_params import install

    install()
    target = tvm.target.Target(webgpu.target_dict(0, {"kind": "llvm"}, profile="wgsl-f16-wg32768-t256"))
    mod = tvm.IRModule({n: f.with_attr("global_symbol", n) for n, f in funcs.items()})
    lib = tvm.compile(mod, target=target)
    src = "\n".join(m.inspect_source() for m in lib.mod.imports)
    lib.export_library(str(tmp_path / f"{name}.so"))
    return src, tvm.runtime.load_module(str(tmp_path / f"{name}.so"))


def _kernels():
    """copy4: B[i, 0:4] = A[i, 0:4] (vector load and store); shift: B[i, 0:4] = A[i, 1:5]
    (a load from an index one past a multiple of 4); mixed: B[i] = A[i, 0:4] summed + A[i, 0]
    (a vector load and a scalar load of the same parameter)."""
    from tvm.script import tirx as T

    @T.prim_func
    def copy4(a: T.Buffer((4096,), "float32"), b: T.Buffer((4096,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", 16)
        tx = T.launch_thread("threadIdx.x", 64)
        b[T.ramp((bx * 64 + tx) * 4, 1, 4)] = a[T.ramp((bx * 64 + tx) * 4, 1, 4)]

    @T.prim_func
    def shift(a: T.Buffer((4100,), "float32"), b: T.Buffer((4096,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", 16)
        tx = T.launch_thread("threadIdx.x", 64)
        b[T.ramp((bx * 64 + tx) * 4, 1, 4)] = a[T.ramp((bx * 64 + tx) * 4 + 1, 1, 4)]

    @T.prim_func
    def mixed(a: T.Buffer((4096,), "float32"), b: T.Buffer((1024,), "float32")):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        bx = T.launch_thread("blockIdx.x", 16)
        tx = T.launch_thread("threadIdx.x", 64)
        v = T.decl_buffer((4,), "float32", scope="local")
        v[0:4] = a[T.ramp((bx * 64 + tx) * 4, 1, 4)]
        b[bx * 64 + tx] = v[0] + v[1] + v[2] + v[3] + a[(bx * 64 + tx) * 4]

    return {"copy4": copy4, "shift": shift, "mixed": mixed}


def _binding(src: str, kernel: str, param: str) -> str:
    """The WGSL type of ``param``'s binding in ``kernel``'s shader."""
    start = src.index(f"fn {kernel}_kernel(")
    head = src[:start].rsplit("enable", 1)[-1] if "enable" in src[:start] else src[:start]
    for line in reversed(head.splitlines()):
        if f" {param}_ptr : " in line or f" {param} : " in line:
            return line.split(" : ", 1)[1].rstrip(";")
    raise AssertionError(f"no binding {param} before {kernel}")


def test_aligned_ramps_bind_as_vectors_and_the_rest_stays_scalar(tmp_path):
    """copy4's two parameters become ``array<vec4<f32>>`` (one load and one store a row);
    shift's unaligned load, and the parameter mixed reads both ways, stay ``array<f32>``; all
    three compute what numpy does on lavapipe."""
    import tvm

    from app.inference.backends import webgpu

    need_vulkan()
    src, lib = _compile(_kernels(), tmp_path, "vec")
    assert _binding(src, "copy4", "a") == "array<vec4<f32>>"
    assert _binding(src, "copy4", "b") == "array<vec4<f32>>"
    assert "a_ptr[" in src.split("fn copy4_kernel(")[1].split("\n}\n")[0]
    assert _binding(src, "shift", "a") == "array<f32>"
    assert _binding(src, "shift", "b") == "array<vec4<f32>>"  # its store is aligned
    assert _binding(src, "mixed", "a") == "array<f32>"
    dev = webgpu.device(0)
    rng = np.random.default_rng(3)
    a = rng.standard_normal(4096).astype("float32")
    b = tvm.runtime.empty((4096,), "float32", dev)
    lib["copy4"](tvm.runtime.tensor(a, dev), b)
    np.testing.assert_array_equal(b.numpy(), a)
    a2 = rng.standard_normal(4100).astype("float32")
    b2 = tvm.runtime.empty((4096,), "float32", dev)
    lib["shift"](tvm.runtime.tensor(a2, dev), b2)
    np.testing.assert_array_equal(b2.numpy(), a2[1:4097])
    a3 = rng.standard_normal(4096).astype("float32")
    b3 = tvm.runtime.empty((1024,), "float32", dev)
    lib["mixed"](tvm.runtime.tensor(a3, dev), b3)
    r = a3.reshape(-1, 4)
    np.testing.assert_allclose(b3.numpy(), r.sum(axis=1) + r[:, 0], rtol=1e-6, atol=1e-6)


def test_the_int8_gemv_reads_its_weights_16_bytes_a_load(tmp_path):
    """The decode GEMV's weights (``uint32x4`` words) and its float16 vector (4 values a load)
    are bound as vectors: one WGSL load per word, not four."""
    from app.inference.pipelines.wgsl_q4_gemv import fused_gemv

    need_vulkan()
    func = fused_gemv(q4_matmul_func(4096, 4096, "res"), None, None, 32768, norm_out=True)
    src, _ = _compile({"o": func}, tmp_path, "o")
    assert _binding(src, "o", "w") == "array<vec4<u32>>"
    assert _binding(src, "o", "x") == "array<vec4<f16>>"
    assert "vec4<u32>(w_ptr[" not in src


def test_a_model_compiled_for_vulkan_gets_vector_bindings_in_a_fresh_process(tiny_model_dir, tmp_path):
    """The product's compile path installs the pass itself (compile/build.py's hooks, for WebGPU
    targets only), and a tiny q4f16_1 model compiled for Vulkan in a new process has its GEMV
    weights bound as ``array<vec4<u32>>`` and no weight word split into four loads."""
    import subprocess
    import sys
    import textwrap

    model_dir = tiny_model_dir("llama", "q4f16_1")
    script = textwrap.dedent(f"""
        from pathlib import Path
        from app.inference.pipelines import wgsl_vector_params
        from app.inference.compile.compiler import get_library
        from app.inference.hardware.device_spec import DeviceSpec
        from app.inference.store.config import ModelConfig
        import tvm
        from app.inference.backends import webgpu
        from app.inference.compile.build import _build_hooks
        assert not wgsl_vector_params._installed
        with _build_hooks(tvm.target.Target({{"kind": "llvm"}})):
            assert not wgsl_vector_params._installed  # a CPU build leaves TVM's code generators
        target = webgpu.target_dict(0, {{"kind": "llvm"}}, profile="wgsl-f16-wg32768-t256")
        with _build_hooks(tvm.target.Target(target)):
            assert wgsl_vector_params._installed  # every WebGPU build installs it
        cfg = ModelConfig.load(Path({str(model_dir)!r}))
        lib = get_library(cfg, DeviceSpec("vulkan", 0), arch="wgsl-f16-wg32768-t256")
        data = lib.lib_path.read_bytes()
        print(data.count(b"array<vec4<u32>>"), data.count(b"vec4<u32>(w_ptr["))
    """)
    env = {**__import__("os").environ, "LLMCHAT_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    vec, split = (int(v) for v in out.stdout.split()[-2:])
    assert vec >= 4 and split == 0, out.stdout


def test_a_kernel_the_pass_cannot_analyze_is_left_as_tvm_made_it(monkeypatch, tmp_path):
    """An error inside the pass leaves that kernel's WGSL scalar (and says so in the debug log);
    the build goes on."""
    from app.inference.pipelines import wgsl_vector_params

    need_vulkan()

    def broken(func):
        raise RuntimeError("cannot analyze")

    monkeypatch.setattr(wgsl_vector_params, "retype_func", broken)
    src, _ = _compile({"copy4": _kernels()["copy4"]}, tmp_path, "broken")
    assert _binding(src, "copy4", "a") == "array<f32>"
    assert "vec4<f32>(a_ptr[" in src
