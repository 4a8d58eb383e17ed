"""dlight-style rule: the exported ``argmax`` (``device_ops.argmax_te``) on CUDA runs
``llmchat::argmax_f32`` (``cuda_kernels.cu``): one block of 1024 threads over the vocabulary."""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.cuda_kernels import KernelRule, launch
from app.inference.pipelines.tir_facts import argmax_buffers

THREADS = 1024


class CudaArgmax(KernelRule):
    """Replace the annotated argmax PrimFunc's body by a launch of ``llmchat::argmax_f32``."""

    def replace(self, func: Any) -> Any | None:
        from tvm import tirx

        found = argmax_buffers(func)
        if found is None:
            return None
        logits, out, vocab = found
        call = tirx.call_extern("int32", f"llmchat::argmax_f32<{vocab}>", logits.data, out.data)
        return func.with_body(launch(call, {"blockIdx.x": 1}, {"threadIdx.x": THREADS}))
