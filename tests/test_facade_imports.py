"""The UI and the CLI reach ``app/inference/`` through one door: outside it, the front ends (the
commands, the screens, the widgets, the OpenAI server and the app's top-level modules) import only
``app.inference.api`` (the types) and ``app.inference.services`` (the facade). Read from the real
files with ``ast``: imports inside functions and ``TYPE_CHECKING`` blocks count too."""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[1] / "app"
ALLOWED = {"app.inference", "app.inference.api", "app.inference.services"}
FRONT_ENDS = ("commands", "screens", "widgets", "serve")


def front_end_files() -> list[Path]:
    files = sorted(APP.glob("*.py"))
    for folder in FRONT_ENDS:
        files += sorted((APP / folder).rglob("*.py"))
    return files


def module_of(path: Path) -> str:
    parts = list(path.relative_to(APP.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source``; ``from X import Y`` counts as X.Y as well (Y may
    be a submodule), relative imports resolved against ``module``; ``importlib.import_module`` and
    ``__import__`` with a constant name count too."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    bad: dict[tuple[int, str], str] = {}
    for line, name in imported_modules(source, module, is_package):
        inside = name.startswith("app.inference.")  # the bare package holds nothing
        allowed = any(name == ok or name.startswith(ok + ".") for ok in ALLOWED - {"app.inference"})
        if inside and not allowed and (line, name.rpartition(".")[0]) not in bad:  # once per import
            bad[(line, name)] = f"{module}:{line} imports {name}"
    return list(bad.values())


def test_the_front_ends_import_only_the_facade_and_the_types():
    files = front_end_files()
    names = {module_of(path) for path in files}
    # the scan reads the real front ends (a moved folder must not make it pass by reading nothing)
    assert {
        "app.cli",
        "app.chat_app",
        "app.settings",
        "app.commands.doctor",
        "app.commands.build",
        "app.commands.ask",
        "app.screens.add_server",
        "app.screens.loading",
        "app.screens.chat",
        "app.widgets.servers_panel",
        "app.serve.server",
    } <= names
    bad = []
    for path in files:
        bad += violations(path.read_text(encoding="utf-8"), module_of(path), path.name == "__init__.py")
    assert bad == [], "go through app.inference.services (or app.inference.api for types):\n" + "\n".join(bad)


def test_the_check_sees_every_way_of_importing():
    """Each form of reaching past the facade is caught; the facade and the types are not."""
    forbidden = {
        "from app.inference.hardware import probe": "app.inference.hardware",
        "import app.inference.compile.prebuilt": "app.inference.compile.prebuilt",
        "from app.inference import store": "app.inference.store",
        "from ..inference.engine import sampling": "app.inference.engine",
        "def f():\n    from app.inference.engine.remote import list_models": "app.inference.engine.remote",
        "if TYPE_CHECKING:\n    from app.inference.store.saved_servers import SavedServer": "saved_servers",
        "importlib.import_module('app.inference.backends.webgpu')": "app.inference.backends.webgpu",
    }
    for source, needle in forbidden.items():
        found = violations(source, "app.screens.example")
        assert found and needle in found[0], (source, found)
    for source in (
        "from app.inference.api import Engine, SavedServer",
        "from app.inference.services import LocalServices",
        "import app.inference.services",
        "from app.inference import api, services",
        "from ..inference import services",
    ):
        assert violations(source, "app.screens.example") == [], source
