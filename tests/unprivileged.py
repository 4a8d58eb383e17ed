"""Run Python code as an unprivileged user, also when the tests run as root (as CI does).

Root opens a mode-000 file anyway and can do what a user cannot, so a check of what happens
*without* a permission runs in a child process that has dropped to the user ``nobody`` (uid and gid
65534) before it starts. That user cannot read the test's tmp dirs (pytest makes them 0700 under
root) or, often, the interpreter and the checkout (e.g. under /root), hence :func:`shared_dir`, a
world-readable directory with a copy of the ``app`` package, and a search for an interpreter that
``nobody`` can run (the system's Python is enough: the code run this way uses the standard library
only).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _drop_to_nobody() -> None:  # preexec_fn: in the child, before exec
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A world-readable temporary directory holding a copy of the ``app`` package (``app/``)."""
    path = Path(tempfile.mkdtemp(prefix="llmchat-unprivileged-"))
    try:
        path.chmod(0o755)
        shutil.copytree(REPO / "app", path / "app", ignore=shutil.ignore_patterns("__pycache__"))
        for sub in path.rglob("*"):
            sub.chmod(0o755 if sub.is_dir() else 0o644)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pythons() -> list[str]:
    """Interpreters to try: this one, then the system's."""
    found = [sys.executable, shutil.which("python3"), "/usr/bin/python3", "/usr/local/bin/python3"]
    return list(dict.fromkeys(p for p in found if p))


def run_python(
    code: str, workdir: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str] | None:
    """Run ``code`` with ``workdir`` (a :func:`shared_dir`) as its working directory and import
    path, as ``nobody`` when this process is root, else as this user. None when no interpreter
    can be run by that user (the caller skips with that reason; CI installs Debian's python3)."""
    child_env = {
        "HOME": str(workdir),
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(workdir),
        "PYTHONDONTWRITEBYTECODE": "1",
        **(env or {}),
    }
    preexec = _drop_to_nobody if is_root() else None
    for python in pythons():
        try:
            out = subprocess.run(
                [python, "-c", code],
                cwd=workdir,
                env=child_env,
                preexec_fn=preexec,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except (PermissionError, FileNotFoundError):
            continue
        if out.returncode != 0 and (
            "Permission denied" in out.stderr
            or "No module named" in out.stderr
            or "Could not find platform" in out.stderr
        ):
            continue  # this interpreter's own files are out of the user's reach
        return out
    return None
