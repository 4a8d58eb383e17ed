"""What the Vulkan tests need: llmchat's WebGPU add-on and at least one adapter (lavapipe in CI).

On a machine without a Vulkan loader or driver the tests skip with the reason; CI installs Mesa's
lavapipe (`.ci/run`) and fails on any skip (LLMCHAT_NO_SKIP=1), so there they always run."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _why_not() -> str | None:
    from app.inference.backends import webgpu

    return webgpu.problem(0)


def need_vulkan() -> None:
    why = _why_not()
    if why:
        pytest.skip(f"no Vulkan here: {why} (Debian: apt install libvulkan1 mesa-vulkan-drivers)")
