"""PinnedReadback's bookkeeping, run against a stand-in for the CUDA runtime (named as such: this
machine has no GPU) whose calls copy host memory with ctypes; on the H200 the real runtime's
copies are checked by ``benchmarks/gpu_decode.py run`` (generation's token ids against numpy's)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from app.inference.engine.cuda_readback import PinnedReadback


class CudaRuntimeStandIn:
    """The five cudart calls PinnedReadback makes, on host memory; records them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._buffers: list[ctypes.Array] = []

    def cudaHostAlloc(self, ptr, size, _flags):
        buf = ctypes.create_string_buffer(size.value)
        self._buffers.append(buf)
        ptr._obj.value = ctypes.addressof(buf)
        self.calls.append("alloc")
        return 0

    def cudaEventCreateWithFlags(self, event, _flags):
        event._obj.value = 1
        return 0

    def cudaMemcpyAsync(self, dst, src, size, kind, stream):
        assert kind == 2 and stream is None  # device to host, on the default stream
        ctypes.memmove(dst, src, size.value)
        self.calls.append("copy")
        return 0

    def cudaEventRecord(self, _event, stream):
        assert stream is None
        self.calls.append("record")
        return 0

    def cudaEventSynchronize(self, _event):
        self.calls.append("wait")
        return 0

    def cudaEventDestroy(self, _event):
        self.calls.append("destroy")
        return 0

    def cudaFreeHost(self, _ptr):
        self.calls.append("free")
        return 0


class _Tensor:
    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def data_ptr(self) -> int:
        return self.values.ctypes.data


def test_copies_the_ids_behind_an_event_and_waits_for_it_only():
    rt = CudaRuntimeStandIn()
    readback = PinnedReadback(rt, 8)
    ids = np.array([7, -1, 123456, 4, 5, 6, 7, 8], dtype=np.int32)
    readback.start(_Tensor(ids), 3)
    assert rt.calls == ["alloc", "copy", "record"]
    assert readback.result() == [7, -1, 123456]
    assert rt.calls[-1] == "wait"
    with pytest.raises(ValueError, match="do not fit"):
        readback.start(_Tensor(ids), 9)
    readback.close()
    assert rt.calls[-2:] == ["destroy", "free"]


def test_a_failing_cuda_call_is_an_error():
    rt = CudaRuntimeStandIn()
    rt.cudaHostAlloc = lambda *_a: 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaHostAlloc failed with CUDA error 2"):
        PinnedReadback(rt, 8)
