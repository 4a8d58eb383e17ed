"""Token ids from the GPU to the host behind queued work (CUDA runtime through ctypes).

TVM's Python API copies a tensor to the host synchronously: the copy waits for everything queued
on the device, so a generation loop that reads a batch of greedy token ids while the next batch is
already queued would wait for that batch too. :class:`PinnedReadback` instead queues the copy
(``cudaMemcpyAsync`` into page-locked host memory, on the default stream TVM launches its kernels
and CUDA graphs on) with an event behind it, and waits for that event only: the GPU goes on with
the work queued after it.
"""

from __future__ import annotations

import ctypes
from typing import Any

#: cudaMemcpyKind cudaMemcpyDeviceToHost, cudaEventDisableTiming
_DEVICE_TO_HOST = 2
_DISABLE_TIMING = 2


class PinnedReadback:
    """Up to ``capacity`` int32 values copied from a device tensor to pinned host memory."""

    def __init__(self, cudart: Any, capacity: int) -> None:
        self._rt = cudart
        self.capacity = capacity
        self._host = ctypes.c_void_p()
        self._event = ctypes.c_void_p()
        self._check(
            cudart.cudaHostAlloc(ctypes.byref(self._host), ctypes.c_size_t(4 * capacity), 0), "cudaHostAlloc"
        )
        self._check(
            cudart.cudaEventCreateWithFlags(ctypes.byref(self._event), _DISABLE_TIMING),
            "cudaEventCreateWithFlags",
        )
        self._count = 0

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise RuntimeError(f"{call} failed with CUDA error {code}")

    def start(self, device_tensor: Any, count: int) -> None:
        """Queue the copy of the first ``count`` int32 values of ``device_tensor`` (after all the
        work queued so far)."""
        if count > self.capacity:
            raise ValueError(f"{count} values do not fit the {self.capacity} of this buffer")
        src = ctypes.c_void_p(device_tensor.data_ptr())
        self._check(
            self._rt.cudaMemcpyAsync(self._host, src, ctypes.c_size_t(4 * count), _DEVICE_TO_HOST, None),
            "cudaMemcpyAsync",
        )
        self._check(self._rt.cudaEventRecord(self._event, None), "cudaEventRecord")
        self._count = count

    def result(self) -> list[int]:
        """Wait for the copy (not for the work queued after it); the values."""
        self._check(self._rt.cudaEventSynchronize(self._event), "cudaEventSynchronize")
        values = (ctypes.c_int32 * self._count).from_address(self._host.value)
        return list(values)

    def close(self) -> None:
        """Free the pinned memory and the event."""
        if self._event:
            self._rt.cudaEventDestroy(self._event)
            self._event = ctypes.c_void_p()
        if self._host:
            self._rt.cudaFreeHost(self._host)
            self._host = ctypes.c_void_p()


class StepFence:
    """Keeps each forward step of TVM's paged KV cache from starting before the previous one ended.

    On CUDA the KV cache copies a step's page tables (positions, page indices, lengths) from one
    page-locked host buffer into one device buffer, on a copy stream of its own that does not wait
    for the kernels queued before it (TVM expects the host to synchronise after every step, as a
    sampler does). A step queued while an earlier one still runs, as greedy batches and chunked
    prompts do, would overwrite the tables that the earlier step's attention reads: wrong attention,
    and past a few thousand tokens of context, reads outside the cache (an illegal address). The
    fence records an event after each step and waits for it before the next one begins; the GPU
    keeps the work of one step queued while the host prepares the next."""

    def __init__(self, cudart: Any) -> None:
        self._rt = cudart
        self._event = ctypes.c_void_p()
        PinnedReadback._check(
            cudart.cudaEventCreateWithFlags(ctypes.byref(self._event), _DISABLE_TIMING),
            "cudaEventCreateWithFlags",
        )
        self._marked = False

    def mark(self) -> None:
        """After a step's kernels are queued (on the default stream, as TVM's)."""
        PinnedReadback._check(self._rt.cudaEventRecord(self._event, None), "cudaEventRecord")
        self._marked = True

    def wait(self) -> None:
        """Before the next step begins: wait until the marked step has run."""
        if self._marked:
            PinnedReadback._check(self._rt.cudaEventSynchronize(self._event), "cudaEventSynchronize")
            self._marked = False

    def close(self) -> None:
        if self._event:
            self._rt.cudaEventDestroy(self._event)
            self._event = ctypes.c_void_p()
