"""The roofline's copy bandwidth on Vulkan (lavapipe in CI): the add-on's buffer-to-buffer copy,
timed as on any device, kept under the adapter's name and driver."""

from __future__ import annotations

import json

from tests.inference.backends.vulkan_env import need_vulkan


def test_copy_bandwidth_of_a_vulkan_adapter(tmp_path, monkeypatch):
    need_vulkan()
    from app.inference.backends import webgpu
    from app.inference.hardware import copy_bandwidth

    file = tmp_path / "copy_bandwidth.json"
    monkeypatch.setattr(copy_bandwidth, "path", lambda: file)
    dev = webgpu.device(0)
    adapter = webgpu.adapters()[0]
    key = copy_bandwidth.device_key(dev)
    assert key.startswith(f"vulkan: {adapter.name} (driver ") and key != copy_bandwidth.device_key(None)
    before = webgpu.stats(0)
    got = copy_bandwidth.cached(dev, 64 << 20, repeats=2)
    after = webgpu.stats(0)
    assert got.device == key and got.copy_bytes == 64 << 20 and len(got.runs) == 2
    assert 1e7 < got.bytes_per_s < 1e13 and not got.cached
    assert after["syncs"] >= before["syncs"] + 3  # the warm-up and each timed copy waited for the GPU
    assert after["peak_bytes"] >= 2 * (64 << 20)  # two buffers on the device, not in host memory
    assert json.loads(file.read_text())["devices"][key]["bytes_per_s"] == got.bytes_per_s
    assert copy_bandwidth.cached(dev).cached  # kept: not measured again
    # the adapter's largest buffer bounds the copy
    assert copy_bandwidth.copy_size(dev, 1 << 40) <= adapter.max_buffer_bytes
