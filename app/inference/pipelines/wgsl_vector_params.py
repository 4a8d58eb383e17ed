"""Vector loads and stores in WGSL: a kernel parameter accessed only by aligned vector ramps.

TVM's WebGPU code generator declares every buffer parameter as ``array<T>`` of its scalar type
and prints a vector load ``w[ramp(i, 1, 4)]`` as four scalar loads, ``vec4<u32>(w[i + 0], w[i +
1], w[i + 2], w[i + 3])`` (a vector store as four scalar stores): WGSL has no pointer casts. On the
H200 NVIDIA's Vulkan driver did not merge them: Llama-2-7B decode went 404.4 / 406.1 -> 460.5 /
458.3 tok/s with this pass (benchmarks/results/h200-2026-12-04-s22/callC).

:func:`retype_func` does it in the WGSL instead, on the device functions after TVM's passes: a
parameter whose every access (load or store) is a ramp of one width L (2 or 4) from an index the
arithmetic analyzer proves a multiple of L becomes a pointer to L-wide vectors (the binding
``array<vec4<u32>>``) and each access ``w[i / L]``: one instruction. Any other access (a scalar
one, an unaligned or mixed-width ramp) leaves the parameter as it is. Either way the kernel
reads and writes the same bytes; an access in bounds before is in bounds after (the vector count
is the scalar count over L, rounded down, and an aligned ramp in bounds ends inside it). The
host function keeps the scalar buffer: the tensors passed in and their checks do not change.

:func:`install` puts the pass in front of TVM's WebGPU code generator (``target.build.webgpu``),
once per process, so every WebGPU build (the model's, a test's) gets it.
"""

from __future__ import annotations

from typing import Any

_installed = False


def _pointer_dtype(var: Any) -> str | None:
    import tvm

    ann = getattr(var, "ty", None)
    if isinstance(ann, tvm.ir.PointerType) and isinstance(ann.element_type, tvm.ir.PrimType):
        return str(ann.element_type.dtype)
    return None


def _ramp(index: Any) -> Any | None:
    from tvm import tirx

    return index if isinstance(index, tirx.Ramp) else None


def _lanes(ramp: Any) -> int:
    return int(ramp.lanes) if hasattr(ramp.lanes, "__int__") else -1


def _owners(func: Any, params: list[Any]) -> list[tuple[Any, Any]]:
    """(buffer, parameter) of each buffer ``func`` declares over one of ``params``."""
    import tvm_ffi
    from tvm import tirx

    owners: list[tuple[Any, Any]] = []

    def _decl(decl: Any) -> Any:
        for p in params:
            if decl.data.same_as(p):
                owners.append((decl.buffer, p))
        return decl

    tvm_ffi.structural_map(func.body, (tirx.DeclBuffer, _decl))
    return owners


def _owner(owners: list[tuple[Any, Any]], buf: Any) -> Any | None:
    for b, p in owners:
        if b.same_as(buf):
            return p
    return None


def vector_widths(func: Any) -> dict[Any, int]:
    """The parameters of ``func`` it accesses (loads and stores) only by aligned ramps of one
    width, through the buffers it declares over them and nothing else: parameter -> width (2
    or 4)."""
    return _analyze(func)[0]


def _analyze(func: Any) -> tuple[dict[Any, int], list[tuple[Any, Any]]]:
    """:func:`vector_widths` and the (buffer, parameter) declarations of those parameters."""
    import tvm
    import tvm_ffi
    from tvm import tirx
    from tvm.sym.analyzer import Analyzer

    scalar = [(p, _pointer_dtype(p)) for p in func.params]
    params = [p for p, dt in scalar if dt is not None and dt != "bool" and "x" not in dt]
    owners = _owners(func, params)
    widths: dict[Any, set[int]] = {p: set() for p in params}
    bad: set[Any] = set()
    analyzer = Analyzer()

    def _access(buf: Any, indices: Any) -> None:
        p = _owner(owners, buf)
        if p is None:
            return
        ramp = _ramp(indices[0]) if len(indices) == 1 else None
        lanes = _lanes(ramp) if ramp is not None else -1
        stride = getattr(ramp.stride, "value", None) if ramp is not None else None
        if lanes not in (2, 4) or stride != 1 or str(buf.dtype) != _pointer_dtype(p):
            bad.add(p)
            return
        mod = analyzer.modular_set(ramp.base)
        if int(mod.coeff) % lanes or int(mod.base) % lanes:
            bad.add(p)
            return
        widths[p].add(lanes)

    def _load(load: Any) -> Any:
        _access(load.source, load.indices)
        return load

    def _store(store: Any) -> Any:
        _access(store.buffer, store.indices)
        return store

    uses: dict[Any, int] = {p: 0 for p in params}

    def _use(var: Any) -> Any:
        for p in params:
            if var.same_as(p):
                uses[p] += 1
        return var

    tvm_ffi.structural_map(
        func.body, [(tvm.ir.TensorLoad, _load), (tirx.BufferStore, _store), (tvm.ir.Var, _use)]
    )
    for p in params:  # a use besides its buffers' declarations (a pointer passed on, say)
        if uses[p] != sum(1 for _, q in owners if q.same_as(p)):
            bad.add(p)
    good = {p: next(iter(w)) for p, w in widths.items() if p not in bad and len(w) == 1}
    return good, [(b, p) for b, p in owners if any(p.same_as(q) for q in good)]


def retype_func(func: Any) -> Any:
    """``func`` with each parameter of :func:`vector_widths` a pointer to vectors, its buffers
    vectors and each access one vector."""
    import tvm
    import tvm_ffi
    from tvm import tirx
    from tvm.sym.analyzer import Analyzer

    widths, owners = _analyze(func)
    if not widths:
        return func
    analyzer = Analyzer()
    new_var: dict[Any, Any] = {}
    for p, lanes in widths.items():
        scope = p.ty.storage_scope or "global"
        vec = tvm.ir.PrimType(f"{_pointer_dtype(p)}x{lanes}")
        new_var[p] = tirx.Var(p.name, tvm.ir.PointerType(vec, scope))
    views: list[tuple[Any, Any]] = []  # old buffer -> its vector view

    def _view(buf: Any) -> Any:
        for old, new in views:
            if old.same_as(buf):
                return new
        p = _owner(owners, buf)
        lanes = widths[p]
        extent = 1
        for dim in buf.shape:
            extent = extent * dim
        view = tirx.decl_buffer(
            (analyzer.simplify(tirx.floordiv(extent, lanes)),),
            f"{buf.dtype}x{lanes}",
            name=buf.name,
            data=new_var[p],
        )
        views.append((buf, view))
        return view

    def _load(load: Any) -> Any:
        p = _owner(owners, load.source)
        if p is None or p not in widths:
            return load
        base = _vector_index(analyzer, load.indices[0].base, widths[p])
        return tirx.BufferLoad(_view(load.source), [base])

    def _store(store: Any) -> Any:
        p = _owner(owners, store.buffer)
        if p is None or p not in widths:
            return store
        base = _vector_index(analyzer, store.indices[0].base, widths[p])
        return tirx.BufferStore(_view(store.buffer), store.value, [base])

    def _decl(decl: Any) -> Any:
        p = _owner(owners, decl.buffer)
        if p is None or p not in widths:
            return decl
        return tirx.DeclBuffer(_view(decl.buffer), data=new_var[p])

    def _var(var: Any, _kind: Any) -> Any:
        for old, new in new_var.items():
            if var.same_as(old):
                return new
        return var

    body = tvm_ffi.structural_map(
        func.body, [(tvm.ir.TensorLoad, _load), (tirx.BufferStore, _store), (tirx.DeclBuffer, _decl)]
    )
    return tvm_ffi.structural_map(func.with_body(body), (), (tvm.ir.Var, _var))


def _vector_index(analyzer: Any, base: Any, lanes: int) -> Any:
    """``base / lanes`` for a base known to be a non-negative multiple of ``lanes``: simplified
    where that leaves no floor division (TVM lowered those before this pass, and its WGSL code
    generator prints none), else a shift."""
    import tvm_ffi
    from tvm import tirx

    out = analyzer.simplify(tirx.floordiv(base, lanes))
    found: list[Any] = []

    def _floor(node: Any) -> Any:
        found.append(node)
        return node

    tvm_ffi.structural_map(out, [((tirx.FloorDiv, tirx.FloorMod), _floor)])
    if not found:
        return out
    return tirx.shift_right(base, tirx.const(lanes.bit_length() - 1, str(base.ty)))


def retype_vector_params(mod: Any) -> Any:
    """:func:`retype_func` on every PrimFunc of a device module. A kernel the pass cannot
    analyze (an error inside it) is left as TVM made it, with a line in the debug log: the pass
    only makes loads wider, never a build fail."""
    from tvm import tirx

    from app.debug_log import log

    updates = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            try:
                new = retype_func(func)
            except Exception as err:  # an optimization: TVM's kernel stays
                log.info("wgsl_vector_params left %s: %s: %s", gv.name_hint, type(err).__name__, err)
                continue
            if not new.same_as(func):
                updates[gv] = new
    for gv, func in updates.items():
        mod.update_func(gv, func)
    return mod


def install() -> None:
    """Run :func:`retype_vector_params` before TVM's WebGPU code generator (idempotent)."""
    global _installed
    if _installed:
        return
    import tvm_ffi

    original = tvm_ffi.get_global_func("target.build.webgpu")

    def build(mod: Any, target: Any) -> Any:
        return original(retype_vector_params(mod), target)

    tvm_ffi.register_global_func("target.build.webgpu", build, override=True)
    _installed = True
