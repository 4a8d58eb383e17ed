"""Fixtures of the GPU suite (marker ``gpu``; ``make test-gpu`` on a machine with an NVIDIA GPU,
nvcc and the CUDA 13 runtime). Without a GPU its tests skip with the reason, and ``make test-gpu``
sets ``LLMCHAT_NO_SKIP=1``, so that a run on the GPU machine cannot pass by not running."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def cuda() -> Any:
    """(device, target) of CUDA GPU 0: the target the engine compiles for on this GPU."""
    from app.errors import LlmchatError
    from app.inference import cuda_support

    if cuda_support.find_nvcc() is None:
        pytest.skip("nvcc (the CUDA toolkit) is needed to build the kernels")
    try:
        cuda_support.prepare_cuda_runtime()
    except LlmchatError as err:
        pytest.skip(f"no CUDA runtime: {err}")
    import tvm

    from app.inference.compiler import make_target
    from app.inference.devices import DeviceSpec

    device = tvm.cuda(0)
    if not device.exist:
        pytest.skip("no CUDA GPU")
    return device, make_target(DeviceSpec("cuda", 0))
