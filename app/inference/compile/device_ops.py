"""Small functions a model library exports besides the model itself.

``argmax``: greedy decoding on the device. On CUDA the decode step then copies one int32 to the
host instead of the whole logits vector (128 KB for a 32k vocabulary, 600 KB for Qwen's 152k)
and numpy's argmax disappears from the per-token path. The TE definition below is what every
target could compile; on CUDA the pipeline swaps its body for ``llmchat::argmax_f32``
(``pipelines/cuda_kernels.cu``), one block that scans the vocabulary.
"""

from __future__ import annotations

from typing import Any

#: block annotation that marks the argmax reduction (pipelines match on it)
OP_ANNOTATION = "llmchat_op"


def has_device_argmax(target: Any) -> bool:
    """Whether libraries for ``target`` export ``argmax`` (CUDA: measured to pay off; WebGPU:
    a read back is a submit and a wait, so greedy steps chain on the device; on the CPU the
    logits are in host memory already)."""
    return target is not None and target.kind.name in ("cuda", "webgpu")


def argmax_te(logits: Any) -> Any:
    """TE: ``int32 [1]`` index of the maximum of ``logits [1, 1, V]``, the lowest index on ties."""
    from tvm import te, tirx

    vocab = int(logits.shape[-1])  # an int32 reduction axis: no casts inside the reducer's pattern

    # the form of TVM's own argmax reducer (topi), which its schedules recognise for
    # cross-thread reductions (the WGSL argmax is one workgroup reducing in shared memory)
    def combine(a: Any, b: Any) -> tuple[Any, Any]:
        take_a = tirx.Or(a[1] > b[1], tirx.And(a[1] == b[1], a[0] < b[0]))
        return tirx.Select(take_a, a[0], b[0]), tirx.Select(a[1] > b[1], a[1], b[1])

    def identity(t0: Any, t1: Any) -> tuple[Any, Any]:
        return tirx.const(-1, t0), tirx.min_value(t1)

    reducer = te.comm_reducer(combine, identity, name="argmax")
    k = te.reduce_axis((0, vocab), name="k")
    index, _value = te.compute(
        (1,),
        lambda _i: reducer((k.var.astype("int32"), logits[0, 0, k]), axis=k),
        name="argmax",
        attrs={OP_ANNOTATION: "argmax"},
    )
    return index
