"""Prebuilt model libraries: build a bundle, find the one that fits this machine, download and verify
it, install it into the compile cache.

A model library is native code (a shared object llmchat loads into its own process), so a prebuilt
one is used only when every check passes, before anything is loaded:

* A **bundle** is a folder named after the library's cache-key digest, ``<digest>/``, holding
  ``manifest.json`` and ``model.so``.  The manifest records the ``LibraryKey`` field by field (model
  config hash, quantization, target and GPU architecture or WGSL adapter profile, host CPU level,
  TVM version, engine version, llmchat's library sources, pipeline, kernel switches) and the size
  and sha256 of every file.  The key is the local compile cache's own (app/inference/compile/cache.py):
  a bundle fits this machine exactly when its key equals the key this machine would compile.
* **Where bundles come from**: a catalog entry's ``prebuilt_libs`` (repo + folder + the manifest's
  sha256, per target), and a model repo's ``libs/<digest>/`` folder (its listing is recorded at
  download time, so the check needs no request).  Files come through the weights' download code
  (app/inference/store/hub.py: resumable ``.part`` files, retries, size and sha256 checked before
  the rename); the manifest's key is compared before any library byte is fetched.
* **Installing** moves the verified library into the cache slot and writes the slot's metadata
  last (with the size and sha256 every later load checks).  Anything rejected is removed; a
  prebuilt library that still fails to load is dropped and compiled here (app/inference/engine/tvm_engine.py).
* ``--no-prebuilt``, ``LLMCHAT_NO_PREBUILT=1`` or ``prebuilt_libraries = false`` in
  ``<config dir>/config.toml`` always compile here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback, ProgressEvent
from app.inference.compile import cache, compiler, targets
from app.inference.compile.cache import CompiledModel, LibraryKey, LibrarySlot

BUNDLE_FORMAT = "llmchat-model-library"
BUNDLE_VERSION = 1
MANIFEST = "manifest.json"
LIBRARY = "model.so"
#: where bundles are assembled in the cache while they download (kept for a resume)
STAGING = ".prebuilt"
NO_PREBUILT_ENV = "LLMCHAT_NO_PREBUILT"
CONFIG_FILE = "config.toml"
CONFIG_KEY = "prebuilt_libraries"
#: a compile's rough length per backend before this machine has compiled one (seconds)
COMPILE_GUESS_S = {"cpu": 30, "cuda": 30, "rocm": 40, "vulkan": 60, "metal": 40}


class BundleRejected(Exception):
    """A bundle that must not be used; the message says why."""


# ------------------------------------------------------------------------------------------
# The switch
# ------------------------------------------------------------------------------------------
def config_path() -> Path:
    return paths.config_dir() / CONFIG_FILE


def prebuilt_allowed(flag: bool | None = None) -> tuple[bool, str]:
    """(allowed, why not): ``flag`` False is ``--no-prebuilt``; then LLMCHAT_NO_PREBUILT, then
    ``prebuilt_libraries = false`` in config.toml."""
    if flag is False:
        return False, "--no-prebuilt"
    if os.environ.get(NO_PREBUILT_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return False, f"{NO_PREBUILT_ENV} is set"
    path = config_path()
    if not path.is_file():
        return True, ""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise LlmchatError(f"cannot read the settings file {path}: {err}", f"fix or remove {path}") from None
    value = data.get(CONFIG_KEY, True)
    if not isinstance(value, bool):
        raise LlmchatError(
            f"{path}: {CONFIG_KEY} must be true or false, got {value!r}",
            f"write `{CONFIG_KEY} = false` (always compile here) or remove the line",
        )
    return (True, "") if value else (False, f"{CONFIG_KEY} = false in {path}")


def compile_estimate_s(backend: str) -> int:
    """About how long a compile takes here: this machine's earlier compiles, else a rough guess."""
    seen = cache.compile_seconds(backend)
    return max(1, round(seen if seen is not None else COMPILE_GUESS_S.get(backend, 40)))


# ------------------------------------------------------------------------------------------
# Manifests
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Manifest:
    key: LibraryKey
    digest: str
    files: dict[str, tuple[int, str]]  # name -> (size, sha256)
    params: list[dict[str, Any]]
    target: str
    compute_dtype: str


def parse_manifest(data: bytes) -> Manifest:
    """A bundle's manifest, checked for shape (BundleRejected when it is not one)."""
    try:
        raw = json.loads(data)
        if raw.get("format") != BUNDLE_FORMAT or raw.get("version") != BUNDLE_VERSION:
            raise BundleRejected(f"not a {BUNDLE_FORMAT} manifest of version {BUNDLE_VERSION}")
        key = LibraryKey.from_dict(raw["key"])
        files = {}
        for name, info in raw["files"].items():
            if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or name == MANIFEST:
                raise BundleRejected(f"the manifest names an unsafe file {name!r}")
            size, sha = int(info["size"]), str(info["sha256"])
            if size < 0 or len(sha) != 64:
                raise BundleRejected(f"the manifest's entry for {name} is malformed")
            files[name] = (size, sha)
        if LIBRARY not in files:
            raise BundleRejected(f"the manifest lists no {LIBRARY}")
        params = raw["params"]
        if not isinstance(params, list):
            raise BundleRejected("the manifest's params are not a list")
        manifest = Manifest(
            key, str(raw["digest"]), files, params, str(raw["target"]), str(raw["compute_dtype"])
        )
    except BundleRejected:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BundleRejected(f"the manifest is malformed ({type(err).__name__}: {err})") from None
    if manifest.digest != key.digest():
        raise BundleRejected("the manifest's digest does not match its key")
    return manifest


def check_fits(manifest: Manifest, slot: LibrarySlot) -> None:
    """BundleRejected unless the bundle's key is exactly this machine's key for the model."""
    if manifest.key != slot.key:
        raise BundleRejected("built for " + "; ".join(manifest.key.differences(slot.key)))


def verify_files(manifest: Manifest, folder: Path) -> None:
    """Every file the manifest lists is in ``folder`` with its size and sha256."""
    for name, (size, sha) in manifest.files.items():
        path = folder / name
        if not path.is_file():
            raise BundleRejected(f"{name} is missing")
        if path.stat().st_size != size:
            raise BundleRejected(f"{name} is {path.stat().st_size} bytes, the manifest says {size}")
        got = cache.file_digest(path)
        if got != sha:
            raise BundleRejected(f"{name} has sha256 {got}, the manifest says {sha}")


# ------------------------------------------------------------------------------------------
# Build
# ------------------------------------------------------------------------------------------
def build_spec(device: str) -> Any:
    """The DeviceSpec to build for: ``device`` need not be present (``--arch`` names it)."""
    from app.inference.hardware.device_spec import DeviceSpec, parse_device

    kind, index = parse_device(device)
    if kind == "auto":
        from app.inference.hardware.device_spec import resolve_device

        return resolve_device("auto")
    return DeviceSpec(kind, index or 0)


def build_bundle(
    model: str | Path, device: str, arch: str | None, out: Path, progress: ProgressCallback | None = None
) -> Path:
    """Compile (or take from the local cache) the library of ``model`` for ``device``/``arch`` and
    write it as a bundle ``out/<digest>/`` (manifest.json + model.so); returns that folder."""
    from app.inference.engine.tvm_engine import resolve_model_dir
    from app.inference.store.config import ModelConfig

    _, model_dir = resolve_model_dir(model)
    cfg = ModelConfig.load(model_dir)
    spec = build_spec(device)
    targets.make_target(spec, arch)  # a missing --arch or an unknown one fails before anything else
    slot = compiler.library_slot(cfg, spec, arch)
    found = cache.cached_library(slot, progress)
    if found is not None and found.origin != "compiled":
        cache.drop_library(slot)  # publish only what was compiled here
        found = None
    compiled = found or compiler.compile_into(slot, spec, arch, progress)
    meta = json.loads(compiled.lib_path.with_suffix(".json").read_text(encoding="utf-8"))
    key = slot.key
    if meta.get("pipeline") == "tvm-default" and key.pipeline != "tvm-default":
        key = cache.library_key(slot.cfg, spec.backend, key.device, plain_pipeline=True)
    manifest = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "key": key.as_dict(),
        "digest": key.digest(),
        "target_label": key.target,
        "params": compiled.params,
        "target": compiled.target,
        "compute_dtype": compiled.compute_dtype,
        "model_config": slot.cfg.code_key(),
        "files": {
            LIBRARY: {
                "size": compiled.lib_path.stat().st_size,
                "sha256": cache.file_digest(compiled.lib_path),
            }
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    final = out / key.digest()
    tmp = Path(tempfile.mkdtemp(prefix=f".{key.digest()}.", dir=out))
    try:
        shutil.copyfile(compiled.lib_path, tmp / LIBRARY)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        verify_files(parse_manifest((tmp / MANIFEST).read_bytes()), tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as err:
        raise LlmchatError(
            f"cannot write the bundle to {out}: {err}", "pick a writable --out directory"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------------
# Where bundles come from
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    repo: str
    revision: str
    folder: str  # in the repo, e.g. libs/<digest>
    manifest_sha256: str | None  # pinned by the catalog
    where: str  # "the catalog" or "the model repo"

    def describe(self) -> str:
        return f"HF://{self.repo}/{self.folder} ({self.where})"


def _download_record(model_dir: Path) -> dict[str, Any]:
    from app.inference.store.downloads import MANIFEST_NAME

    try:
        data = json.loads((model_dir / MANIFEST_NAME).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _catalog_entry(model_id: str, model_dir: Path) -> Any:
    from app.inference.store.catalog import load_catalog

    if model_dir.resolve() != (paths.models_dir() / model_id).resolve():
        return None  # a directory given by path: no catalog entry speaks for it
    try:
        catalog = load_catalog()
    except LlmchatError:
        return None
    return catalog.get(model_id) if model_id in catalog else None


def candidates(model_id: str, model_dir: Path, slot: LibrarySlot) -> tuple[list[Candidate], list[str]]:
    """The bundles that may fit ``slot`` and, when none may, why (in words)."""
    found: list[Candidate] = []
    notes: list[str] = []
    entry = _catalog_entry(model_id, model_dir)
    if entry is not None and entry.prebuilt_libs:
        mine = [lib for lib in entry.prebuilt_libs if lib.target == slot.key.target]
        found += [
            Candidate(lib.repo, lib.revision, lib.path.strip("/"), lib.sha256, "the catalog") for lib in mine
        ]
        if not mine:
            offered = ", ".join(sorted({lib.target for lib in entry.prebuilt_libs}))
            notes.append(f"the catalog has prebuilt libraries for {offered}, not for {slot.key.target}")
    record = _download_record(model_dir)
    libs, repo = record.get("libs") or {}, record.get("repo")
    if libs and isinstance(repo, str):
        from app.inference.store.downloads import LIBS_FOLDER

        folder = f"{LIBS_FOLDER}/{slot.digest}"
        if f"{folder}/{MANIFEST}" in libs:
            found.append(Candidate(repo, str(record.get("commit") or "main"), folder, None, "the model repo"))
        else:
            count = len({name.split("/")[1] for name in libs if name.count("/") >= 2})
            notes.append(
                f"HF://{repo} has {count} prebuilt librar{'y' if count == 1 else 'ies'}, none built "
                f"with this machine's key {slot.digest} ({slot.key.target}, TVM {slot.key.tvm}, "
                f"engine {slot.key.engine})"
            )
    return found, notes


# ------------------------------------------------------------------------------------------
# Download, verify, install
# ------------------------------------------------------------------------------------------
def staging_dir(slot: LibrarySlot, candidate: Candidate, commit: str) -> Path:
    tag = hashlib.sha256(f"{candidate.repo}|{commit}|{candidate.folder}".encode()).hexdigest()[:12]
    return cache.libs_dir() / STAGING / f"{slot.digest}-{tag}"


def fetch_one(
    slot: LibrarySlot,
    candidate: Candidate,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    label: str = "",
) -> CompiledModel:
    """Download ``candidate`` (manifest first), verify it against ``slot`` and install it.

    Raises BundleRejected (the staging folder is removed) or LlmchatError of the download (its
    partial files stay for a resume)."""
    from app.inference.store.downloads import _staging_lock
    from app.inference.store.hub import list_repo_files

    commit, listing = list_repo_files(candidate.repo, candidate.revision)
    inside = {f.name: f for f in listing if f.name.startswith(candidate.folder + "/")}
    manifest_name = f"{candidate.folder}/{MANIFEST}"
    if manifest_name not in inside:
        raise BundleRejected(f"the repo has no {manifest_name}")
    staging = staging_dir(slot, candidate, commit)
    with _staging_lock(staging, f"the {slot.key.target} library"):
        return _fetch_locked(slot, candidate, commit, inside, staging, progress, cancel, label)


def _fetch_locked(
    slot: LibrarySlot,
    candidate: Candidate,
    commit: str,
    inside: dict[str, Any],
    staging: Path,
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
    label: str,
) -> CompiledModel:
    from app.inference.store.hub import fetch_verified

    manifest_name = f"{candidate.folder}/{MANIFEST}"
    try:
        fetch_verified(
            candidate.repo,
            commit,
            [inside[manifest_name]],
            staging,
            {manifest_name: candidate.manifest_sha256},
            "the catalog",
            progress,
            cancel,
            label,
        )
        folder = staging / candidate.folder
        pinned, got = candidate.manifest_sha256, cache.file_digest(folder / MANIFEST)
        if pinned and got != pinned:  # also when an earlier run left the file complete
            raise BundleRejected(f"{MANIFEST} has sha256 {got}, the catalog says {pinned}")
        manifest = parse_manifest((folder / MANIFEST).read_bytes())
        check_fits(manifest, slot)  # before a single byte of the library is fetched
        remotes = []
        for name, (size, _) in manifest.files.items():
            remote = inside.get(f"{candidate.folder}/{name}")
            if remote is None:
                raise BundleRejected(f"{name} is missing from the repo")
            if remote.size is not None and remote.size != size:
                raise BundleRejected(f"{name} is {remote.size} bytes in the repo, the manifest says {size}")
            remotes.append(remote)
        fetch_verified(
            candidate.repo,
            commit,
            remotes,
            staging,
            {f"{candidate.folder}/{n}": sha for n, (_, sha) in manifest.files.items()},
            "its manifest",
            progress,
            cancel,
            label,
        )
        verify_files(manifest, folder)
    except BundleRejected:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except LlmchatError as err:
        if "checksum" in err.problem:  # a corrupt file is not worth resuming
            shutil.rmtree(staging, ignore_errors=True)
        raise
    meta = {
        "params": manifest.params,
        "target": manifest.target,
        "compute_dtype": manifest.compute_dtype,
        "pipeline": manifest.key.pipeline,
        "model": slot.cfg.code_key(),
        "origin": "prebuilt",
        "source": f"HF://{candidate.repo}@{commit}/{candidate.folder}",
    }
    try:
        return cache.install_library(slot, folder / LIBRARY, meta)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch_bundle(
    slot: LibrarySlot,
    found: list[Candidate],
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    label: str = "",
) -> tuple[CompiledModel | None, Candidate | None, list[str]]:
    """The first candidate that downloads and verifies, installed; else (None, None, reasons)."""
    reasons = []
    for candidate in found:
        try:
            return fetch_one(slot, candidate, progress, cancel, label), candidate, reasons
        except BundleRejected as why:
            reasons.append(f"{candidate.describe()}: {why}")
        except LlmchatError as err:
            from app.inference.store.hub import DownloadCancelled

            if isinstance(err, DownloadCancelled):
                raise
            reasons.append(f"{candidate.describe()}: {err.problem}")
    return None, None, reasons


def _say(progress: ProgressCallback | None, text: str) -> None:
    if progress:
        progress(ProgressEvent("compile", text, None, None))


def fetcher(
    model_id: str, model_dir: Path, allowed: bool | None = None, progress: ProgressCallback | None = None
) -> compiler.Fetcher:
    """The hook ``compiler.get_library`` asks on a cache miss: a fitting prebuilt library, verified
    and installed, or None (then it compiles), saying which and why."""

    def fetch(slot: LibrarySlot) -> CompiledModel | None:
        found, notes = candidates(model_id, model_dir, slot)
        estimate = f"~{compile_estimate_s(slot.key.backend)} s"
        if not found:
            if notes:
                _say(progress, f"no prebuilt library fits ({'; '.join(notes)}): compiling here ({estimate})")
            return None
        ok, why = prebuilt_allowed(allowed)
        if not ok:
            _say(progress, f"prebuilt libraries are off ({why}): compiling here ({estimate})")
            return None
        compiled, candidate, reasons = fetch_bundle(slot, found, progress, label=f"{model_id} library")
        if compiled is None:
            _say(progress, f"no usable prebuilt library ({'; '.join(reasons)}): compiling here ({estimate})")
            return None
        _say(
            progress,
            f"using the prebuilt library for {slot.key.target} from {candidate.describe()} "
            "(manifest and sha256 verified)",
        )
        return compiled

    return fetch


def prepare_library(
    model_id: str,
    model_dir: Path,
    device: str = "auto",
    allowed: bool | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> str:
    """After a download: install the prebuilt library that fits this machine, when there is one.
    Returns one line saying what was done and why (the library compiles on first use otherwise)."""
    from app.inference.hardware.device_spec import resolve_device
    from app.inference.store.config import ModelConfig

    entry = _catalog_entry(model_id, model_dir)
    if not (entry is not None and entry.prebuilt_libs) and not _download_record(model_dir).get("libs"):
        return "the model library compiles here on first use: no prebuilt library is published for this model"
    cfg = ModelConfig.load(model_dir)
    slot = compiler.library_slot(cfg, resolve_device(device))
    target = slot.key.target
    if cache.cached_library(slot) is not None:
        return f"library for {target}: already in the cache"
    compiles = f"library for {target}: compiles here on first use (~{compile_estimate_s(slot.key.backend)} s)"
    found, notes = candidates(model_id, model_dir, slot)
    if not found:
        return f"{compiles}; " + ("; ".join(notes) if notes else "no prebuilt library is published for it")
    ok, why = prebuilt_allowed(allowed)
    if not ok:
        return f"{compiles}; prebuilt libraries are off ({why})"
    compiled, candidate, reasons = fetch_bundle(slot, found, progress, cancel, label=f"{model_id} library")
    if compiled is None:
        return f"{compiles}; " + "; ".join(reasons)
    return f"library for {target}: prebuilt, from {candidate.describe()}, manifest and sha256 verified"


def catalog_status(entry: Any, backend: str, device: str | None) -> str:
    """What ``llmchat models`` shows: ``prebuilt`` when the catalog names a library for this
    machine's target (``device``: its CPU level / GPU architecture, when known), else
    ``compiles here (~N s)``."""
    for lib in getattr(entry, "prebuilt_libs", ()) or ():
        if lib.target == f"{backend}-{device}" or (device is None and lib.target.startswith(backend + "-")):
            return "prebuilt"
    return f"compiles here (~{compile_estimate_s(backend)} s)"
