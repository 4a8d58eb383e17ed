"""The default model (SmolLM2-135M-Instruct, from PyPI) on Vulkan (lavapipe in CI): the same
greedy tokens as llmchat's CPU engine, `llmchat ask --device vulkan` end to end, and `doctor`
showing the adapter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.inference.api import Message
from app.inference.store.default_model import ensure_default_model, wheels_dir
from tests.inference.backends.vulkan_env import need_vulkan
from tests.inference.test_default_model import _use, smollm2_env, smollm2_wheel  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[3]
PROMPTS = ["What is the capital of Japan?", "What is 2 plus 2?", "Write a haiku about the sea."]
STEPS = 24


@pytest.fixture
def default_model(smollm2_wheel, smollm2_env, monkeypatch):  # noqa: F811
    need_vulkan()
    _use(smollm2_env, monkeypatch)
    wheels_dir().mkdir(parents=True, exist_ok=True)
    if not (wheels_dir() / smollm2_wheel.name).exists():
        shutil.copy2(smollm2_wheel, wheels_dir() / smollm2_wheel.name)
    return ensure_default_model()


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["", "f16"], ids=["default", "f16-prompt-gemm"])
def test_default_model_on_vulkan_picks_the_cpu_engines_tokens(default_model, gemm, monkeypatch):
    """Also with the prompt GEMM's fp16 sums (``LLMCHAT_WGSL_GEMM=f16``, part of the library's key)."""
    from app.inference.engine.tvm_engine import load_engine

    if gemm:
        monkeypatch.setenv("LLMCHAT_WGSL_GEMM", gemm)

    prompts = {}
    cpu = load_engine(default_model, device="cpu")
    try:
        for p in PROMPTS:
            prompts[p] = cpu._encode([Message("user", p)])
            prompts[p] = (prompts[p], *_greedy_ids(cpu, prompts[p]))
    finally:
        cpu.close()
    vk = load_engine(default_model, device="vulkan")
    try:
        assert vk.info.backend == "vulkan"
        for p, (ids, cpu_tokens, cpu_logits) in prompts.items():
            vk_tokens, _ = _greedy_ids(vk, ids)
            for step, (a, b) in enumerate(zip(vk_tokens, cpu_tokens, strict=True)):
                if a != b:  # allowed only at a near-tie of the CPU's logits, and the gap is shown
                    top2 = np.sort(cpu_logits[step])[-2:]
                    gap = float(top2[1] - top2[0])
                    assert gap < 0.05, f"{p!r}: token {step} differs ({a} vs {b}); CPU top-2 gap {gap:.4f}"
                    break
    finally:
        vk.close()


def _greedy_ids(engine, ids: list[int]) -> tuple[list[int], list[np.ndarray]]:
    rt = engine.runtime
    rt.clear()
    logits = rt.prefill(ids)
    out, seen = [], []
    for _ in range(STEPS):
        seen.append(logits)
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = rt.decode(tok)
    rt.clear()
    return out, seen


@pytest.mark.slow
def test_llmchat_ask_on_vulkan_end_to_end(default_model, smollm2_env):  # noqa: F811
    env = {**os.environ, **smollm2_env}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "ask",
            "--device",
            "vulkan",
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "What is the capital of Japan?",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Tokyo" in proc.stdout
    assert "vulkan" in proc.stderr.lower()


def test_doctor_json_shows_the_vulkan_adapter():
    need_vulkan()
    from app.inference.backends import webgpu

    name = webgpu.adapters()[0].name
    proc = subprocess.run(
        [sys.executable, "-m", "app", "doctor", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    adapters = report["runtimes"]["vulkan"]["adapters"]
    assert any(a["name"] == name and a["backend"] == "Vulkan" for a in adapters), adapters
    assert "vulkan" in report["runtimes"]["tvm"]["available"]
