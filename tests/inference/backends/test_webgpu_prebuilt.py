"""A WGSL library bundle (target webgpu) built by `llmchat build --device vulkan --arch PROFILE` on a
machine with no Vulkan adapter at all, published on the loopback Hub and loaded on lavapipe through
the same prebuilt path as the CPU's: same logits and greedy tokens as the library compiled here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from app.inference.compile import build, prebuilt, targets
from app.inference.engine.tvm_engine import load_engine
from app.inference.store import downloads
from tests.hub_server import HubServer, use_hub
from tests.inference.backends.vulkan_env import need_vulkan
from tests.inference.test_prebuilt import MODEL_ID, MODEL_REPO, answers, bundle_files, model_files, registry

ROOT = Path(__file__).resolve().parents[3]


def test_wgsl_bundle_built_without_an_adapter_loads_on_vulkan(tiny_model_dir, tmp_path, monkeypatch):
    need_vulkan()
    from app.inference.backends import webgpu

    model = tiny_model_dir("llama", "q4f32_1")
    profile = webgpu.fingerprint(0)  # the adapter here (lavapipe in CI)
    # the build machine: no Vulkan driver, so no adapter (the loader finds no ICD)
    env = {**os.environ, "VK_ICD_FILENAMES": str(tmp_path / "no-such-icd.json")}
    for name in ("VK_DRIVER_FILES", "VK_ADD_DRIVER_FILES"):  # they would win over VK_ICD_FILENAMES
        env.pop(name, None)
    probe = subprocess.run(
        [sys.executable, "-c", "from app.inference.backends import webgpu; print(webgpu.problem(0))"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "no Vulkan adapter" in probe.stdout, probe.stdout + probe.stderr
    out = tmp_path / "bundles"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "build",
            str(model),
            "--device",
            "vulkan",
            "--arch",
            profile,
            "--out",
            str(out),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    folder = Path(built.stdout.strip().splitlines()[-1])
    manifest = prebuilt.parse_manifest((folder / prebuilt.MANIFEST).read_bytes())
    assert manifest.key.target == f"vulkan-{profile}" and manifest.key.host_cpu == targets.cpu_levels()[0]
    assert "webgpu" in manifest.target and f"vulkan-{profile}" in built.stderr

    # the library compiled here (the build above put it in this session's cache under the same key)
    local = load_engine(model, device="vulkan")
    try:
        ref_logits, ref_tokens = answers(local)
    finally:
        local.close()

    server = HubServer().start()
    try:
        use_hub(server, tmp_path / "fresh", monkeypatch)  # a fresh machine: empty cache
        (tmp_path / "fresh" / "config" / "models_registry.toml").write_text(registry())
        server.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(folder)})
        downloads.download_model(MODEL_ID)
        before = build.COMPILE_COUNT
        events = []
        engine = load_engine(MODEL_ID, device="vulkan", progress=events.append)
        try:
            logits, tokens = answers(engine)
        finally:
            engine.close()
    finally:
        server.stop()
    assert before == build.COMPILE_COUNT
    assert any("using the prebuilt library for vulkan-" in e.message for e in events)
    np.testing.assert_array_equal(logits, ref_logits)
    assert tokens == ref_tokens
