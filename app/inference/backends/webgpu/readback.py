"""Token ids from the GPU to the host behind queued work, on Vulkan (llmchat's WebGPU add-on).

The same contract as :class:`app.inference.engine.cuda_readback.PinnedReadback`: ``start`` queues the
copy of a device tensor's first int32 values behind the work recorded so far (and submits it),
``result`` waits for that submission only — the batch of decode steps queued after it keeps the
GPU busy while the host reads these ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class WebGPUReadback:
    """Up to ``capacity`` int32 values read back through one of the add-on's read-back slots."""

    def __init__(self, device: Any, slot: int, capacity: int) -> None:
        import tvm

        self._index = int(device.index)
        self._slot = slot
        self.capacity = capacity
        self._count = 0
        self._start = tvm.get_global_func("llmchat.webgpu.readback_start")
        self._wait = tvm.get_global_func("llmchat.webgpu.readback_wait")

    def start(self, device_tensor: Any, count: int) -> None:
        if count > self.capacity:
            raise ValueError(f"{count} values do not fit the {self.capacity} of this buffer")
        self._start(self._index, self._slot, device_tensor.data_ptr(), 4 * count)
        self._count = count

    def result(self) -> list[int]:
        raw = bytes(self._wait(self._index, self._slot))
        return [int(v) for v in np.frombuffer(raw, dtype="<i4", count=self._count)]

    def close(self) -> None:
        """Nothing to free: the staging buffers belong to the device."""
