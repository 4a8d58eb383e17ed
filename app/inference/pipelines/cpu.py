"""The compiler pipeline for CPUs (llvm targets): TVM's CPU passes plus llmchat's own kernels.

TVM's generic CPU pipeline legalizes and fuses the model into PrimFuncs but leaves every loop nest
serial and scalar. ``cpu_pipeline`` adds, right after fusion:

* ``FuseTransposeMatmul`` (as MLC does), so ``x @ W.T`` reads ``W`` in place instead of writing
  a transposed copy of the weight on every call;
* :func:`ScheduleCPUKernels`, which gives every matrix product whose reduction runs along the
  weight's last axis a kernel: decode GEMVs in the formats with one scale and offset per 32 values
  the group-factored GEMV of :mod:`.cpu_gemv`; prompt GEMMs in block formats the register-blocked
  GEMM of :mod:`.cpu_gemm` (``LLMCHAT_CPU_GEMM=tvm``: the generic schedule instead); every other
  one (q0 ``NT`` matmuls, tied lm_heads, the other dequantize-in-reduction products) the generic
  schedule of :mod:`.cpu_schedule`;
* vectorized, parallel attention kernels over the paged KV cache (prompt and decode) in place of
  TVM's scalar ones (:mod:`app.inference.pipelines.cpu_attention`).

After relax's own passes, :func:`MarkNoAlias` marks every PrimFunc ``noalias`` (without it TVM's
LLVM code generator treats every buffer of the library as possibly aliased).

Small kernels (RMSNorm, SiLU, reshapes: a few microseconds per token) stay serial: a parallel
launch would cost more than they do. Kernels that arrive scheduled (the KV-cache kernels carry
``tirx.is_scheduled``) are left alone, and a kernel no rule fits keeps TVM's loop nest, so a model
always compiles. TVM sizes its thread pool from ``TVM_NUM_THREADS``, which
:mod:`app.inference.engine.cpu_threads` sets to the number of physical cores before the first
kernel runs.
"""

from __future__ import annotations

from typing import Any

from app.inference.pipelines.cpu_attention import ATTENTION_SYMBOLS, replacement_kernel
from app.inference.pipelines.cpu_gemm import replace_prefill_gemm
from app.inference.pipelines.cpu_gemv import replace_block_gemv
from app.inference.pipelines.cpu_schedule import SCHEDULED_ATTR, CPUScheduleConfig, schedule_prim_func


def cpu_pipeline(target: Any, config: CPUScheduleConfig | None = None) -> Any:
    """The relax pipeline for an llvm ``target``: TVM's CPU passes with llmchat's kernel schedules."""
    import tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

    cfg = config or CPUScheduleConfig()

    @tvm.transform.module_pass(opt_level=0, name="LlmchatCPUPipeline")
    def _pipeline(mod: Any, _ctx: Any) -> Any:
        with target:
            seq = tvm.transform.Sequential(
                _schedule_passes(target, cfg)
                + cpu_generic.dataflow_lower_passes(target)
                + cpu_generic.finalize_passes(target)
                + [MarkNoAlias()]
            )
            mod = seq(mod)
        return mod

    return _pipeline


def MarkNoAlias() -> Any:
    """A module pass giving ``tirx.noalias`` to every PrimFunc of the library that lacks it.

    TVM's LLVM code generator does not keep the ``noalias`` state per function: one function of the
    module without the attribute (relax's ``shape_func``, the KV cache's kernels) made every kernel
    of the library tag its buffers as possibly aliased, so LLVM kept register-blocked accumulators in
    memory (a store per FMA: the prompt GEMM of SmolLM2's gate_up ran at half speed). The kernels
    are called with distinct arrays for the buffers they write (relax allocates every output; the
    KV cache passes its pages, temporaries and read-only index arrays), which is what the
    attribute promises."""
    import tvm
    from tvm import tirx

    @tvm.transform.module_pass(opt_level=0, name="MarkNoAlias")
    def _mark(mod: Any, _ctx: Any) -> Any:
        updates = {}
        for gvar, func in mod.functions_items():
            marked = func.attrs is not None and "tirx.noalias" in func.attrs
            if isinstance(func, tirx.PrimFunc) and not marked:
                updates[gvar] = func.with_attr("tirx.noalias", True)
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    return _mark


def scheduled_module(mod: Any, target: Any, config: CPUScheduleConfig | None = None) -> Any:
    """``mod`` after the pipeline's fusion and scheduling passes (for inspection and tests)."""
    import tvm

    with target:
        return tvm.transform.Sequential(_schedule_passes(target, config or CPUScheduleConfig()))(mod)


def _schedule_passes(target: Any, cfg: CPUScheduleConfig) -> list[Any]:
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

    return [
        *cpu_generic.library_dispatch_passes(target),
        relax.transform.FuseTransposeMatmul(),  # x @ W.T without materialising W.T
        *cpu_generic.legalize_passes(target),
        ScheduleCPUKernels(target, cfg),
    ]


def ScheduleCPUKernels(target: Any, config: CPUScheduleConfig | None = None) -> Any:
    """A module pass that schedules every unscheduled PrimFunc of a module for the CPU."""
    import tvm

    cfg = config or CPUScheduleConfig()

    @tvm.transform.module_pass(opt_level=0, name="ScheduleCPUKernels")
    def _schedule(mod: Any, _ctx: Any) -> Any:
        from tvm import tirx

        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if cfg.replace_attention and _global_symbol(func) in ATTENTION_SYMBOLS:
                fast = replacement_kernel(func, target)
                if fast is not None:
                    updates[gvar] = fast
                continue
            if _is_scheduled(func):
                continue
            if cfg.factored_block_gemv:
                factored = replace_block_gemv(func)
                if factored is not None:
                    updates[gvar] = factored
                    continue
            if cfg.prefill_gemm:
                gemm = replace_prefill_gemm(func, target)
                if gemm is not None:
                    updates[gvar] = gemm
                    continue
            scheduled = schedule_prim_func(func, target, cfg)
            if scheduled is not None:
                updates[gvar] = scheduled
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod

    return _schedule


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _is_scheduled(func: Any) -> bool:
    return func.attrs is not None and SCHEDULED_ATTR in func.attrs and bool(func.attrs[SCHEDULED_ATTR])


def _global_symbol(func: Any) -> str | None:
    if func.attrs is None or "global_symbol" not in func.attrs:
        return None
    return str(func.attrs["global_symbol"])
