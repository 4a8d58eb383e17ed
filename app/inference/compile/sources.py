"""Which of llmchat's source files end up in a compiled library, and their digest (a field of the
cache key).

The list is derived, not written down: every module reachable by imports from the compile
orchestrator (``compiler.py``, which imports every step of a build) and from the model,
quantization and pipeline packages, plus the kernel sources (``.cu`` …) next to them.  A new
module is covered as soon as one of those imports it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

#: the module that runs a build (it imports every step: targets, key, TVM build, toolchains) and
#: the packages under app/inference whose modules build the IRModule and its kernels: the roots of
#: the import graph the cache key hashes
_ROOT_MODULE = "compiler.py"  # next to this module
_SOURCE_DIRS = ("models", "quantization", "pipelines")
#: suffixes of non-Python files compiled into libraries (read by the modules next to them)
_KERNEL_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".c", ".cc", ".ll")


def _module_file(name: str, root: Path) -> Path | None:
    """The file of module ``app.X.Y`` (``root`` is the ``app`` package directory), or None."""
    parts = name.split(".")
    if parts[0] != "app":
        return None
    base = root.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(path: Path) -> set[str]:
    """``app.*`` modules ``path`` imports (also inside functions) or names as strings
    (``importlib.import_module("app.inference.models.llama")``)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("app.")
            and node.value.replace(".", "").replace("_", "").isalnum()
        ):
            found.add(node.value)
    return {m for m in found if m == "app" or m.startswith("app.")}


def library_sources() -> list[Path]:
    """Every source file whose code can end up in a compiled library: the import closure of the
    compile orchestrator (``compiler.py``) and of the model, quantization and pipeline packages,
    plus kernel sources (``.cu`` …) in the directories of those modules.  Derived from the code,
    so a new module is covered."""
    here = Path(__file__).parent.parent  # app/inference
    app_root = here.parent
    todo = [Path(__file__).with_name(_ROOT_MODULE)]
    for sub in _SOURCE_DIRS:
        todo += sorted((here / sub).rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop().resolve()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported_modules(path):
            found = _module_file(name, app_root)
            if found is not None and found.resolve() not in seen:
                todo.append(found)
    extra = {
        f.resolve()
        for d in {p.parent for p in seen}
        if d.is_relative_to(here.resolve())
        for f in d.iterdir()
        if f.suffix in _KERNEL_SOURCE_SUFFIXES and f.is_file()
    }
    return sorted(seen | extra)


@functools.cache
def digest() -> str:
    """sha256 of the library sources' paths and contents (computed once per process)."""
    app_root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for f in library_sources():
        h.update(str(f.relative_to(app_root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()
