"""llmchat's CUDA kernels (``cuda_kernels.cu``) and how TIR functions launch them.

A PrimFunc replaced by :mod:`.cuda_gemv` or :mod:`.cuda_attention` has a body that only sets
the launch dimensions and calls a ``__device__`` function of ``cuda_kernels.cu`` through
``call_extern``; :func:`add_device_helpers` puts that source in front of the CUDA module TVM
generates (the build hook in ``cuda_support`` calls it), so the kernels are compiled with the
module, into its fatbin.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

NAMESPACE = "llmchat::"
SOURCE_PATH = Path(__file__).with_name("cuda_kernels.cu")


@cache
def kernel_source() -> str:
    """The CUDA source of llmchat's device functions."""
    return SOURCE_PATH.read_text()


def add_device_helpers(source: str) -> str:
    """``source`` with llmchat's kernel source in front when it calls one of them."""
    return kernel_source() + "\n" + source if NAMESPACE in source else source


def launch(call: Any, grid: dict[str, Any], block: dict[str, int]) -> Any:
    """A TIR statement that launches ``call`` (an extern call) on ``grid`` x ``block`` threads."""
    import tvm
    from tvm import tirx

    body: Any = tirx.Evaluate(call)
    for tag, extent in [*block.items(), *grid.items()]:
        ext = tirx.IntImm("int32", extent) if isinstance(extent, int) else extent
        var = tirx.Var(tag, ext.dtype if hasattr(ext, "dtype") else "int32")
        iv = tirx.IterVar(tvm.ir.Range(0, ext), var, tirx.IterVar.ThreadIndex, tag)
        body = tirx.AttrStmt(iv, "thread_extent", ext, body)
    return body
