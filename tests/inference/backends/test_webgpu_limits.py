"""What an adapter cannot do: no shader-f16 (float32 weights and compute instead), weights or KV
buffers larger than it binds (said before loading), another adapter profile (another library)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.errors import LlmchatError
from tests.inference.backends.vulkan_env import need_vulkan

ROOT = Path(__file__).resolve().parents[3]


def test_an_adapter_without_f16_runs_float16_models_in_float32(tiny_model_dir, tmp_path):
    """LLMCHAT_WEBGPU_F16=0 makes the adapter one without shader-f16 (a fresh process: adapters are
    read once): the q4f16_1 model is compiled as its float32 twin, its float16 weights widened at
    load, and it matches the CPU engine (which computes float16 models in float32 too)."""
    need_vulkan()
    model_dir = tiny_model_dir("llama", "q4f16_1")
    script = textwrap.dedent(f"""
        import numpy as np
        from app.inference.backends import webgpu
        from app.inference.engine.tvm_engine import load_engine
        a = webgpu.adapters()[0]
        assert not a.shader_f16, "the override did not take"
        assert webgpu.fingerprint(0).startswith("wgsl-f32"), webgpu.fingerprint(0)
        vk = load_engine({str(model_dir)!r}, device="vulkan")
        assert vk.runtime.model_dtype == "float32", vk.runtime.model_dtype
        cpu = load_engine({str(model_dir)!r}, device="cpu")
        prompt = list(range(3, 40))
        a, b = vk.runtime.prefill(prompt), cpu.runtime.prefill(prompt)
        rel = float(np.abs(a - b).max() / np.abs(b).max())
        for tok in (5, 6, 7):
            x, y = vk.runtime.decode(tok), cpu.runtime.decode(tok)
            rel = max(rel, float(np.abs(x - y).max() / np.abs(y).max()))
        print("REL", rel)
    """)
    env = dict(os.environ, LLMCHAT_WEBGPU_F16="0", LLMCHAT_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel = float(proc.stdout.split("REL")[-1])
    assert rel < 1e-4, rel


def test_a_weight_larger_than_a_binding_is_refused_before_loading():
    need_vulkan()
    from app.inference.backends import webgpu

    a = webgpu.adapters()[0]
    limit = min(a.max_binding_bytes, a.max_buffer_bytes)
    huge = [{"name": "lm_head.q_weight", "shape": [limit // 4 + 1024, 1], "dtype": "uint32"}]
    with pytest.raises(LlmchatError, match=r"lm_head\.q_weight") as err:
        webgpu.check_fits(0, huge, 1024, 2048)
    assert "--device cpu" in err.value.fix
    # a KV cache whose per-layer buffer would not fit: shortened, or refused when asked for
    per_token = 64 * 1024
    fits = webgpu.check_fits(0, [], per_token, 10**7)
    assert 64 <= fits < 10**7 and fits * per_token <= limit
    with pytest.raises(LlmchatError, match="context window"):
        webgpu.check_fits(0, [], per_token, 10**7, explicit=True)
    assert webgpu.check_fits(0, [], per_token, 512) == 512


def test_another_adapter_profile_is_another_library(tiny_model_dir):
    """A library built for other adapter features is not reused: the profile is in the cache key."""
    need_vulkan()
    from app.inference.compile import cache, targets
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.store.config import ModelConfig

    cfg = ModelConfig.load(tiny_model_dir("llama", "q4f16_1"))
    dev = DeviceSpec("vulkan", 0)
    here = targets.device_fingerprint(dev)
    other = targets.device_fingerprint(dev, "wgsl-f16-wg16384-t256")
    assert here != other
    assert cache.cache_key(cfg, "vulkan", here) != cache.cache_key(cfg, "vulkan", other)
    with pytest.raises(LlmchatError, match="profile"):
        targets.device_fingerprint(dev, "gfx1100")
