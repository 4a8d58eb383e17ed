"""Drive a compiled model library: weights, the paged KV cache, prefill and decode steps.

Uses only TVM's runtime API (``tvm.runtime.load_module`` + ``tvm.runtime.vm.VirtualMachine`` and
the ``vm.builtin.*`` KV-state functions), so a runtime-only TVM install can run cached libraries.
One sequence (id 0) holds the conversation.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

from app.errors import LlmchatError

PAGE_SIZE = 16
SEQ_ID = 0
#: DLPack's device types of CUDA GPUs and of WebGPU (llmchat's Vulkan path)
CUDA_DEVICE_TYPE = 2
WEBGPU_DEVICE_TYPE = 15
#: token ids one greedy call gathers on the device before they are copied back (more: grown)
PICKED_CAPACITY = 64


def _configure_cpu_threads(device: Any) -> None:
    """Size TVM's CPU thread pool to the physical cores before the first kernel runs
    (app.inference.engine.cpu_threads owns the policy; TVM's default uses half the logical CPUs)."""
    if int(device.dlpack_device_type()) != 1:  # kDLCPU
        return
    from app.inference.engine.cpu_threads import configure_cpu_threads

    configure_cpu_threads()


def _load_module(lib_path: str, device: Any) -> Any:
    """Load a model library; CUDA libraries through app.inference.compile.cuda_support when present."""
    import tvm

    if int(device.dlpack_device_type()) == 2:  # kDLCUDA
        try:
            from app.inference.compile.cuda_support import load_cuda_library
        except ImportError:
            pass
        else:
            return load_cuda_library(lib_path)
    return tvm.runtime.load_module(lib_path)


def _optional_function(vm: Any, name: str) -> Any | None:
    """``vm[name]``, or None when the library does not export it."""
    try:
        return vm[name]
    except Exception as err:  # TVM raises its own error type for a missing function
        from app.debug_log import log

        log.debug("the model library has no %s (%s)", name, type(err).__name__)
        return None


class ModelRuntime:
    """A loaded model library with its weights and one KV-cache sequence."""

    def __init__(
        self,
        lib_path: str,
        device: Any,
        params: list[Any],
        *,
        hidden_size: int,
        model_dtype: str,
        context_window: int,
        prefill_chunk: int,
        kv_bytes_per_token: int,
        weight_bytes: int,
    ) -> None:
        import tvm
        from tvm.runtime import ShapeTuple
        from tvm.runtime.vm import VirtualMachine

        self.device = device
        self.params = params
        self.hidden_size = hidden_size
        self.model_dtype = model_dtype
        self.context_window = int(context_window)
        self.prefill_chunk = max(1, min(int(prefill_chunk), self.context_window))
        self.weight_bytes = weight_bytes
        pages = math.ceil(self.context_window / PAGE_SIZE) + 1
        self.kv_bytes = pages * PAGE_SIZE * kv_bytes_per_token
        self._ShapeTuple = ShapeTuple
        _configure_cpu_threads(device)
        try:
            self.vm = VirtualMachine(_load_module(lib_path, device), device)
            self._f_embed = self.vm["embed"]
            self._f_prefill = self.vm["prefill"]
            self._f_decode = self.vm["decode"]
            self._f_argmax = _optional_function(self.vm, "argmax")
            self.kv = self.vm["create_paged_kv_cache"](
                ShapeTuple([1]),
                ShapeTuple([self.context_window]),
                ShapeTuple([self.prefill_chunk]),
                ShapeTuple([PAGE_SIZE]),
                ShapeTuple([0]),
            )
        except LlmchatError:
            raise
        except Exception as err:
            raise LlmchatError(
                f"Could not start the model library {lib_path}: {err}",
                "delete the compiled-library cache (it is rebuilt) or check device memory",
            ) from err
        get = tvm.get_global_func
        self._f_add = get("vm.builtin.kv_state_add_sequence")
        self._f_remove = get("vm.builtin.kv_state_remove_sequence")
        self._f_begin = get("vm.builtin.kv_state_begin_forward")
        self._f_end = get("vm.builtin.kv_state_end_forward")
        self._f_popn = get("vm.builtin.kv_state_popn")
        self._f_len = get("vm.builtin.attention_kv_cache_get_sequence_length")
        self._f_reshape = get("vm.builtin.reshape")
        self._seq = ShapeTuple([SEQ_ID])
        self._one = ShapeTuple([1])
        self._decode_shape = ShapeTuple([1, 1, hidden_size])
        self._ids1 = np.zeros(1, dtype=np.int32)
        self._ids1_dev = tvm.runtime.empty((1,), "int32", device)  # decode's input, reused every step
        self._last_pick: tuple[int | None, Any] | None = None  # the last greedy pick: (id, device id)
        self._picked: Any = None  # decode_greedy_ahead's ids, gathered on the device: one copy back
        self._picked_slots: list[Any] = []  # its elements as one-id views (made once, not per step)
        self._readbacks: list[Any] | None = None  # pinned host buffers for them (CUDA)
        self._fence: Any = None  # CUDA: each forward step waits for the previous one (made on first use)
        self._f_add(self.kv, SEQ_ID)
        self._length = 0

    # -- KV state --------------------------------------------------------------------------
    @property
    def sequence_length(self) -> int:
        """Tokens held in the KV cache for the conversation."""
        return self._length

    def kv_sequence_length(self) -> int:
        """The KV cache's own count (for tests)."""
        return int(self._f_len(self.kv, SEQ_ID))

    def clear(self) -> None:
        """Drop every cached token."""
        self._f_remove(self.kv, SEQ_ID)
        self._f_add(self.kv, SEQ_ID)
        self._length = 0

    def popn(self, n: int) -> None:
        """Roll the last ``n`` tokens back."""
        if n <= 0:
            return
        if n >= self._length:
            self.clear()
            return
        self._f_popn(self.kv, SEQ_ID, n)
        self._length -= n

    # -- steps -----------------------------------------------------------------------------
    def _embed(self, ids: np.ndarray) -> Any:
        import tvm

        return self._f_embed(tvm.runtime.tensor(ids, device=self.device), self.params)

    def prefill(self, ids: Sequence[int], cancel: threading.Event | None = None) -> np.ndarray | None:
        """Append ``ids`` to the sequence (in chunks); logits after the last one, float32 [vocab].

        ``cancel`` is checked between chunks: once set, the prefill stops there and returns None
        (the chunks done stay in the KV cache: ``sequence_length`` says how far it got)."""
        steps = self.prefill_steps(ids, cancel)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def prefill_steps(
        self, ids: Sequence[int], cancel: threading.Event | None = None
    ) -> Generator[int, None, np.ndarray | None]:
        """:meth:`prefill` one chunk per step: yields the tokens done after each chunk but the last;
        returns what :meth:`prefill` returns (the logits, or None when cancelled)."""
        if not ids:
            raise ValueError("prefill needs at least one token")
        if self._length + len(ids) > self.context_window:
            raise LlmchatError(
                f"{self._length + len(ids)} tokens do not fit the context window of {self.context_window}.",
                "start a new conversation or use a shorter prompt",
            )
        if len(ids) == 1:  # a one-token prefill is a decode step (its kernels are the faster ones)
            return self.decode(int(ids[0]))
        arr = np.asarray(ids, dtype=np.int32)
        logits = None
        for start in range(0, len(arr), self.prefill_chunk):
            if start:
                yield start
                if cancel is not None and cancel.is_set():
                    return None
            chunk = arr[start : start + self.prefill_chunk]
            n = len(chunk)
            emb = self._f_reshape(self._embed(chunk), self._ShapeTuple([1, n, self.hidden_size]))
            self._step_begins()
            self._f_begin(self.kv, self._seq, self._ShapeTuple([n]))
            logits, self.kv = self._f_prefill(emb, self.kv, self.params)
            self._f_end(self.kv)
            self._step_ended()
            self._length += n
        return logits.numpy().reshape(-1)

    def _decode_step(self, token: int) -> Any:
        """Append one token; its logits as a device tensor ``[1, 1, vocab]``."""
        if self._length + 1 > self.context_window:
            raise LlmchatError(
                f"The context window of {self.context_window} tokens is full.", "start a new conversation"
            )
        self._ids1[0] = token
        self._ids1_dev.copyfrom(self._ids1)
        return self._decode_device_id(self._ids1_dev)

    def _decode_device_id(self, ids: Any) -> Any:
        """Append the token whose id is in the device tensor ``ids`` (int32 ``[1]``); its logits."""
        emb = self._f_reshape(self._f_embed(ids, self.params), self._decode_shape)
        self._step_begins()
        self._f_begin(self.kv, self._seq, self._one)
        logits, self.kv = self._f_decode(emb, self.kv, self.params)
        self._f_end(self.kv)
        self._step_ended()
        self._length += 1
        return logits

    def _step_begins(self) -> None:
        """Before a forward step: on CUDA, wait for the previous one (see cuda_readback.StepFence)."""
        if self._fence is None:
            self._fence = self._make_fence()
        if self._fence:
            self._fence.wait()

    def _step_ended(self) -> None:
        if self._fence:
            self._fence.mark()

    def _make_fence(self) -> Any:
        """A StepFence on TVM's CUDA runtime; False elsewhere: the twin and llmchat's ROCm runtime
        create the KV cache's copy stream as a blocking stream (ordered after the kernels queued on
        the default stream), the CPU and WebGPU caches copy in order."""
        if int(self.device.dlpack_device_type()) != CUDA_DEVICE_TYPE:
            return False
        if os.environ.get("LLMCHAT_GPU_RUNTIME", "").strip().lower() == "twin":
            return False
        from app.inference.compile.cuda_support import load_cudart
        from app.inference.engine.cuda_readback import StepFence

        return StepFence(load_cudart())

    def decode(self, token: int) -> np.ndarray:
        """Append one token; its logits, float32 [vocab]."""
        return self._decode_step(token).numpy().reshape(-1)

    @property
    def reads_behind_queued_work(self) -> bool:
        """Whether greedy ids are read back without waiting for work queued after them (CUDA's
        pinned read-backs, the Vulkan add-on's read-back slots), so a second batch may be queued
        before the first is read."""
        return self._f_argmax is not None and bool(self._readback_pair())

    @property
    def has_device_argmax(self) -> bool:
        """Whether :meth:`decode_greedy` picks the token on the device (CUDA libraries)."""
        return self._f_argmax is not None

    def decode_greedy(self, token: int) -> int:
        """Append one token; the id of its largest logit (the first on ties). Only the id is
        copied to the host when the library exports ``argmax``; otherwise numpy's argmax."""
        logits = self._decode_step(token)
        if self._f_argmax is None:
            return int(np.argmax(logits.numpy().reshape(-1)))
        return int(self._f_argmax(logits).numpy()[0])

    def decode_greedy_ahead(self, token: int, steps: int) -> list[int]:
        """Append ``token`` and the greedy tokens after it, ``steps`` decode steps in all; the
        ``steps`` greedy tokens (the last one not appended yet, as with :meth:`decode_greedy`).
        A caller that stops early rolls the tokens it did not use back with :meth:`popn`."""
        return self.start_greedy_ahead(token, steps)()

    def start_greedy_ahead(self, token: int | None, steps: int) -> Callable[[], list[int]]:
        """Queue the steps of :meth:`decode_greedy_ahead` and return at once a function that waits
        for their token ids; ``token=None`` continues after the previous call's last token, which
        may still be on its way (so a caller can queue the next batch before reading this one).

        With :attr:`has_device_argmax` every step's token id goes from the library's argmax
        straight into the next step's embedding, on the device; the ids are gathered into one
        device buffer and copied to the host once per call, on CUDA behind the queued work
        (:class:`~app.inference.engine.cuda_readback.PinnedReadback`): the GPU does not wait for the
        host between steps, nor between calls when the next one is queued before the wait."""
        if steps < 1:
            raise ValueError("decode_greedy_ahead needs at least one step")
        if self._length + steps > self.context_window:
            raise LlmchatError(
                f"The context window of {self.context_window} tokens is full.", "start a new conversation"
            )
        if token is None and self._last_pick is None:
            raise ValueError("start_greedy_ahead(None) needs an earlier call to continue from")
        if self._f_argmax is None:  # the host's argmax, one step at a time
            token = self._last_pick[0] if token is None else token
            out = []
            for _ in range(steps):
                token = self.decode_greedy(token)
                out.append(token)
            self._last_pick = (token, None)
            return lambda: out
        import tvm

        if self._last_pick is not None and (token is None or self._last_pick[0] == token):
            ids = self._last_pick[1]  # the previous call's last pick, still on the device
        else:
            self._ids1[0] = token
            self._ids1_dev.copyfrom(self._ids1)
            ids = self._ids1_dev
        if self._picked is None or self._picked.shape[0] < steps:
            size = max(steps, PICKED_CAPACITY)
            self._picked = tvm.runtime.empty((size,), "int32", self.device)
            self._picked_slots = [self._picked._create_view((1,), "int32", 4 * i) for i in range(size)]
        for slot in self._picked_slots[:steps]:
            ids = self._f_argmax(self._decode_device_id(ids))
            ids.copyto(slot)  # on the device, in order
        last = ids
        self._last_pick = (None, last)  # its value is known once the ids are read
        readback = self._readback(steps)

        def wait() -> list[int]:
            if readback is not None:
                tokens = readback.result()
            else:
                tokens = [int(t) for t in self._picked._create_view((steps,), "int32", 0).numpy()]
            if self._last_pick is not None and self._last_pick[1] is last:
                self._last_pick = (tokens[-1], last)
            return tokens

        if readback is not None:
            readback.start(self._picked, steps)
        return wait

    def _readback_pair(self) -> list[Any] | None:
        """Two readbacks that wait for their own copy only (made once): pinned buffers on CUDA,
        the add-on's read-back slots on Vulkan; None elsewhere, in the CUDA twin (no libcudart),
        or where the runtime does not offer them (the ids are then read with a synchronous copy)."""
        kind = int(self.device.dlpack_device_type())
        if kind not in (CUDA_DEVICE_TYPE, WEBGPU_DEVICE_TYPE):
            return None
        if kind == CUDA_DEVICE_TYPE and os.environ.get("LLMCHAT_GPU_RUNTIME", "").strip().lower() == "twin":
            return None  # the CUDA twin runs without libcudart (synchronous copies)
        if self._readbacks is None and kind == WEBGPU_DEVICE_TYPE:
            from app.inference.backends.webgpu.readback import WebGPUReadback

            self._readbacks = [WebGPUReadback(self.device, slot, PICKED_CAPACITY) for slot in range(2)]
        if self._readbacks is None:
            try:
                from app.inference.compile.cuda_support import load_cudart
                from app.inference.engine.cuda_readback import PinnedReadback

                cudart = load_cudart()
                self._readbacks = [PinnedReadback(cudart, PICKED_CAPACITY) for _ in range(2)]
            except Exception as err:  # no pinned memory: synchronous copies still work
                from app.debug_log import log

                log.info(
                    "no pinned read-back buffers (greedy ids copied synchronously): %s: %s",
                    type(err).__name__,
                    err,
                )
                self._readbacks = []
        return self._readbacks or None

    def _readback(self, steps: int) -> Any:
        """The next of the two readbacks of :meth:`_readback_pair` (None: a synchronous copy)."""
        pair = self._readback_pair() if steps <= PICKED_CAPACITY else None
        if not pair:
            return None
        pair.reverse()  # alternate: one batch may be in flight while the other is read
        return pair[0]

    # -- memory ----------------------------------------------------------------------------
    def memory_in_use_bytes(self) -> int:
        """Weights + the KV cache pages (what this runtime allocated on the device)."""
        return self.weight_bytes + self.kv_bytes

    def close(self) -> None:
        """Release the device memory (weights, KV cache, VM)."""
        self.params = []
        self.kv = None
        self.vm = None
        self._f_embed = self._f_prefill = self._f_decode = self._f_argmax = None
        for readback in self._readbacks or []:
            readback.close()
        self._readbacks = None
        if self._fence:
            self._fence.close()
        self._fence = None
