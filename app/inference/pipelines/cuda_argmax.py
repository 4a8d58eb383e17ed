"""dlight-style rule: the exported ``argmax`` (``device_ops.argmax_te``) on CUDA runs
``llmchat::argmax_f32`` (``cuda_kernels.cu``): one block of 1024 threads over the vocabulary."""

from __future__ import annotations

from typing import Any

from app.inference.device_ops import OP_ANNOTATION
from app.inference.pipelines.cuda_kernels import KernelRule, launch
from app.inference.pipelines.tir_facts import root_blocks, static_shape

THREADS = 1024


def _argmax_buffers(func: Any) -> tuple[Any, Any, int] | None:
    """(logits, output, vocab) when ``func`` is the annotated argmax over ``[1, 1, V]`` float32."""
    blocks = root_blocks(func)
    if len(blocks) != 1 or str(blocks[0].annotations.get(OP_ANNOTATION, "")) != "argmax":
        return None
    if len(func.params) != 2:
        return None
    logits, out = func.params
    shape = static_shape(logits)
    if (str(logits.dtype) != "float32" or shape is None or len(shape) != 3 or shape[:2] != [1, 1]
            or str(out.dtype) != "int32"):
        return None
    return logits, out, shape[2]


class CudaArgmax(KernelRule):
    """Replace the annotated argmax PrimFunc's body by a launch of ``llmchat::argmax_f32``."""

    def replace(self, func: Any) -> Any | None:
        from tvm import tirx

        found = _argmax_buffers(func)
        if found is None:
            return None
        logits, out, vocab = found
        call = tirx.call_extern("int32", f"llmchat::argmax_f32<{vocab}>", logits.data, out.data)
        return func.with_body(launch(call, {"blockIdx.x": 1}, {"threadIdx.x": THREADS}))
