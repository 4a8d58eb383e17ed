"""How many kernels one decode step launches, counted from the scheduled module (not timed).

On Vulkan every dispatch has a fixed cost, so the count per step is what :mod:`.wgsl_fusion`
cuts. A step of llmchat's runtime calls ``embed`` (the new token), ``decode`` (every layer; the
KV cache's attention call runs TVM's split-rotary, append and decode-attention kernels for one
token) and, when greedy on the device, ``argmax``. :func:`decode_step_kernels` walks those Relax
functions in order and counts the kernel launches of every PrimFunc they call (a PrimFunc may
launch several: the split decode attention launches two, its merge only past one chunk).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from app.inference.pipelines.tir_facts import tir_call

#: the KV cache's packed call that attends over one layer, and the PrimFuncs it runs for one
#: decoded token (TVM 0.27's PagedAttentionKVCache: split q/k/v with RoPE, append k/v, attend)
ATTENTION_CALL = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
ATTENTION_KERNELS = ("fused_rope", "tir_kv_cache_transpose_append", "batch_decode_paged_kv")
#: the Relax functions a greedy decode step calls, in order
STEP_FUNCTIONS = ("embed", "decode", "argmax")
_THREAD_TAGS = ("blockIdx.", "threadIdx.")


def kernel_launches(func: Any) -> int:
    """The kernels ``func`` (a scheduled PrimFunc) launches: its outermost thread-bound loops or
    ``thread_extent`` scopes (what the lowering splits off as device kernels). A launch under a
    host-side ``if`` (the split decode attention's merge, run only when more than one chunk
    covers the sequence: over 128 keys) is not counted: the count is a short-context step's."""
    import tvm_ffi
    from tvm import tirx

    count = 0

    def launch(node: Any) -> Any:
        nonlocal count
        if isinstance(node, tirx.IfThenElse):
            return tvm_ffi.WalkResult.SKIP
        if isinstance(node, tirx.For):
            binding = node.thread_binding
            is_launch = binding is not None and str(binding.thread_tag).startswith(_THREAD_TAGS)
        else:
            is_launch = str(node.attr_key) == "thread_extent"
        if is_launch:
            count += 1
            return tvm_ffi.WalkResult.SKIP
        return tvm_ffi.WalkResult.ADVANCE

    tvm_ffi.structural_walk(func.body, [((tirx.For, tirx.AttrStmt, tirx.IfThenElse), launch)], order="pre")
    return count


def _is_view(func: Any) -> bool:
    """Whether the backend turns a call of ``func`` into a view (a reshape: no kernel)."""
    from tvm import relax

    try:
        return bool(relax.analysis.has_reshape_pattern(func))
    except Exception:  # a body that is not one root block: a hand-written kernel, no view
        return False


def _extern_name(value: Any) -> str | None:
    from tvm import relax

    if isinstance(value, relax.Call) and value.args and isinstance(value.args[0], relax.ExternFunc):
        return str(value.args[0].global_symbol)
    return None


def _calls(func: Any) -> list[Any]:
    """The bound values of ``func``'s body, in order."""
    from tvm import relax

    if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
        return []
    return [b.value for block in func.body.blocks for b in block.bindings]


def decode_step_kernels(mod: Any) -> Counter[str]:
    """Kernel launches per greedy decode step by PrimFunc name, from ``mod`` after the
    schedules (``gpu.schedule_passes``). Reshapes that the backend turns into views count 0."""
    from tvm import tirx

    names = {gv.name_hint: gv for gv in mod.functions}
    counts: Counter[str] = Counter()

    def add(name: str) -> None:
        func = mod[names[name]]
        if isinstance(func, tirx.PrimFunc) and not _is_view(func):
            launches = kernel_launches(func)
            if launches:
                counts[name] += launches

    for fname in STEP_FUNCTIONS:
        if fname not in names:
            continue
        for value in _calls(mod[names[fname]]):
            call = tir_call(value)
            if call is not None:
                add(call[0].name_hint)
            elif _extern_name(value) == ATTENTION_CALL:
                for kernel in ATTENTION_KERNELS:
                    if kernel in names:
                        add(kernel)
    return counts


def scheduled_module(cfg: Any, target: Any) -> Any:
    """The model of ``cfg`` through llmchat's GPU passes up to scheduled kernels for ``target``."""
    import tvm

    from app.inference.compile.build import export_model
    from app.inference.pipelines.gpu import schedule_passes

    mod, _ = export_model(cfg, target)
    with target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(schedule_passes(target))(mod)
