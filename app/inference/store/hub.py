"""Files from a Hugging Face repo: the listing with sizes and hashes, and one file at a time fetched
resumably, retried and verified before it is renamed into place.

``list_repo_files(repo, revision)`` lists a repo at a commit (``HfApi.model_info(files_metadata=True)``:
sha256 for LFS files, the git blob id for the others; names that would escape the target directory
are rejected). ``fetch_file`` downloads one file into a staging directory as ``<name>.part``,
resumes it with an HTTP ``Range`` request after an interruption, retries what is worth retrying
(MAX_ATTEMPTS, RETRY_DELAYS) and renames it to ``<name>`` only once its size matches the listing
and its hashes match the listing and the caller's checksum (md5 from ``tensor-cache.json``, sha256
from a bundle's manifest); a mismatch is fetched once more, then an error. ``fetch_verified`` does
that for a list of files (prebuilt model libraries); :mod:`app.inference.store.downloads` for a
model's weights. Every failure is an ``LlmchatError`` that says what happened and what to do.

Why not ``hf_hub_download(local_dir=...)``: in huggingface_hub 2.4.0 it writes to a process-unique
``<name>.<uuid>.incomplete`` file and deletes it in a ``finally`` when anything goes wrong
(``file_download._download_to_tmp_and_move``), so it resumes only within one call (``http_get``'s
retries), never after an interruption. The requests still go through huggingface_hub's HTTP session,
headers (token from ``HF_TOKEN`` or ``huggingface-cli login``, never logged) and error types, and
honour ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` (read at call time).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from app.errors import LlmchatError
from app.inference.api import DownloadCancelled, ProgressCallback, ProgressEvent
from app.units import format_bytes as _format_bytes

#: connection attempts per file before giving up (each resumes where the last stopped)
MAX_ATTEMPTS = 4
#: seconds before the 2nd, 3rd, ... attempt
RETRY_DELAYS = (0.5, 1.0, 2.0)
#: how long to wait for the hub to accept a connection / to send the next bytes
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 20.0
#: progress events per second at most
PROGRESS_HZ = 10.0
SKIPPED_FILES = {".gitattributes"}
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class DownloadProgress(ProgressEvent):
    """A download ``ProgressEvent`` with the rate and ETA as numbers (``message`` shows them too)."""

    bytes_per_s: float | None = None
    eta_s: float | None = None
    file: str = ""


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repo listing: its size, and the hash the Hub gives for it (sha256 for a file
    kept in LFS, the git blob id for one kept in git)."""

    name: str
    size: int | None
    sha256: str | None = None
    blob_id: str | None = None

    def record(self) -> dict:
        """What the download manifest keeps of it (``installed.listed_files`` reads it back)."""
        out: dict = {"size": self.size}
        if self.sha256:
            out["sha256"] = self.sha256
        elif self.blob_id and self.size is not None:
            out["blob_id"] = self.blob_id
        return out


class _ShortBody(ConnectionError):
    """The server ended a body before the listed size."""


def _describe(err: BaseException) -> str:
    """A transport error in words (never an internal class name)."""
    if isinstance(err, _ShortBody):
        return "the server ended the file early"
    import httpx2

    if isinstance(err, httpx2.ReadTimeout):
        return f"no data for {READ_TIMEOUT_S:.0f} s"
    if isinstance(err, httpx2.ConnectTimeout):
        return f"no connection within {CONNECT_TIMEOUT_S:.0f} s"
    if isinstance(err, httpx2.RemoteProtocolError):
        return "the server closed the connection mid-file"
    if isinstance(err, (httpx2.ConnectError, ConnectionRefusedError)):
        return "the connection was refused or the host is unknown"
    return type(err).__name__


class ExpectedHashes:
    """The digests a file is checked against while it streams in: md5 from tensor-cache.json,
    sha256 (LFS files) or the git blob id (other files) from the Hub's listing."""

    def __init__(
        self,
        remote: RemoteFile,
        expected: str | None,
        algorithm: str = "md5",
        source: str = "tensor-cache.json",
    ) -> None:
        self.size = remote.size
        self.checks: list[tuple[str, str, str]] = []  # (algorithm, who says so, expected hex)
        if expected:  # md5 from tensor-cache.json (shards), sha256 from a bundle's manifest (libraries)
            self.checks.append((algorithm, source, expected.lower()))
        if remote.sha256:
            self.checks.append(("sha256", "the listing", remote.sha256.lower()))
        elif remote.blob_id and remote.size is not None:
            self.checks.append(("git-blob", "the listing", remote.blob_id.lower()))
        self.reset()

    def reset(self) -> None:
        from app.inference.store.file_hashes import new_hasher

        self.hashers = [new_hasher(algo, self.size) for algo, _, _ in self.checks]

    def update(self, chunk: bytes) -> None:
        for h in self.hashers:
            h.update(chunk)

    def update_file(self, path: Path) -> None:
        if self.hashers:
            with path.open("rb") as f:
                while block := f.read(_READ_CHUNK):
                    self.update(block)

    def mismatch(self) -> str | None:
        """'md5 X, tensor-cache.json says Y' for the first digest that differs, else None."""
        for (algo, who, want), h in zip(self.checks, self.hashers, strict=True):
            if h.hexdigest() != want:
                name = "git blob id" if algo == "git-blob" else algo
                return f"{name} {h.hexdigest()}, {who} says {want}"
        return None


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    if value.strip().upper() in {"1", "ON", "YES", "TRUE"}:
        return True
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def safe_relative_path(name: str) -> PurePosixPath:
    """A listing's file name as a path inside the model directory, or an error if it could escape."""
    if not name or "\\" in name or "\x00" in name or name.startswith("/") or ":" in name.split("/")[0]:
        raise LlmchatError(
            f"the repo listing holds an unsafe file name {name!r}",
            "the repo is broken or malicious; download from a trusted repo",
        )
    path = PurePosixPath(name)
    if path.is_absolute() or any(part in ("..", ".", "") for part in path.parts) or name.endswith("/"):
        raise LlmchatError(
            f"the repo listing holds a file name that escapes the model directory: {name!r}",
            "the repo is broken or malicious; download from a trusted repo",
        )
    return path


# -- errors -------------------------------------------------------------------------------------
def _gated_error(repo: str) -> LlmchatError:
    return LlmchatError(
        f"{repo} is gated: Hugging Face refused the download without an accepted licence and a token",
        f"accept the licence on https://huggingface.co/{repo}, then run `huggingface-cli login` "
        "(or set HF_TOKEN) and retry",
    )


def _unreachable_error(endpoint: str, err: BaseException) -> LlmchatError:
    return LlmchatError(
        f"cannot reach the Hugging Face hub at {endpoint} ({_describe(err)})",
        "check your network connection (or HF_ENDPOINT) and retry; a partial download resumes",
    )


def _offline_error() -> LlmchatError:
    return LlmchatError(
        "offline mode is on (HF_HUB_OFFLINE=1): cannot download models",
        "unset HF_HUB_OFFLINE to download, or use a model that is already installed (`llmchat models`)",
    )


def _hub_error(repo: str, err: BaseException, what: str) -> LlmchatError:
    """Turn huggingface_hub / httpx errors into one clear message."""
    import httpx2
    from huggingface_hub import errors as hf_errors

    endpoint = _endpoint()
    if isinstance(err, LlmchatError):
        return err
    if isinstance(err, hf_errors.OfflineModeIsEnabled):
        return _offline_error()
    if isinstance(err, hf_errors.GatedRepoError):
        return _gated_error(repo)
    if isinstance(err, hf_errors.RepositoryNotFoundError):
        return LlmchatError(
            f"the Hugging Face repo {repo} does not exist (or is private and your token cannot see it)",
            "check the name on https://huggingface.co (`llmchat models` lists the catalog); "
            "for a private repo run `huggingface-cli login` or set HF_TOKEN",
        )
    if isinstance(err, hf_errors.RevisionNotFoundError):
        return LlmchatError(f"{repo}: the revision in the catalog does not exist", "fix the entry's revision")
    if isinstance(err, hf_errors.EntryNotFoundError):
        return LlmchatError(
            f"{repo}: {what} is listed but the hub answered 404 Not Found",
            "retry later; the repo may be changing",
        )
    if isinstance(err, hf_errors.HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403):
            return _gated_error(repo)
        if status == 404:
            return LlmchatError(
                f"{repo}: {endpoint} answered 404 Not Found for {what}",
                "check the repo name (and HF_ENDPOINT, if set); `llmchat models` lists the catalog",
            )
        return LlmchatError(
            f"{repo}: the hub answered HTTP {status} for {what}",
            "retry later (the download resumes where it stopped)",
        )
    if isinstance(err, (httpx2.RemoteProtocolError, httpx2.ReadError, httpx2.ReadTimeout, _ShortBody)):
        return LlmchatError(
            f"{repo}: the download of {what} from {endpoint} kept breaking off ({_describe(err)})",
            "retry; the download resumes where it stopped",
        )
    if isinstance(err, (httpx2.TransportError, ConnectionError)):
        return _unreachable_error(endpoint, err)
    return LlmchatError(
        f"{repo}: downloading {what} failed ({type(err).__name__}: {err})",
        "retry; the download resumes where it stopped",
    )


# -- listing ------------------------------------------------------------------------------------
def list_repo_files(repo: str, revision: str = "main") -> tuple[str, list[RemoteFile]]:
    """(commit sha, files with sizes) of a repo; raises LlmchatError on any failure."""
    if _offline():
        raise _offline_error()
    import httpx2
    from huggingface_hub import HfApi

    api = HfApi(endpoint=_endpoint(), library_name="llmchat")
    try:
        info = api.model_info(
            repo,
            revision=revision,
            files_metadata=True,
            timeout=httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),  # type: ignore[arg-type]
        )
    except Exception as err:  # mapped to a clear message below, re-raised if unknown
        raise _hub_error(repo, err, "the file listing") from None
    siblings = info.siblings or []
    files = [
        RemoteFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id)
        for s in siblings
        if s.rfilename not in SKIPPED_FILES
    ]
    for remote in files:
        safe_relative_path(remote.name)
    return (info.sha or revision), files


# -- one file -----------------------------------------------------------------------------------
def _write_chunk(f, chunk: bytes) -> None:
    """Append one chunk (a seam for the disk-full tests)."""
    f.write(chunk)


class ProgressTracker:
    """Aggregates bytes over all files and emits DownloadProgress at most PROGRESS_HZ times a second."""

    def __init__(self, callback: ProgressCallback | None, total: int, done: int, label: str) -> None:
        self.callback = callback
        self.total = total
        self.done = done
        self.label = label
        self.file = ""
        self._start_done = done
        self._start = time.monotonic()
        self._next = 0.0
        self._window: list[tuple[float, int]] = []
        self._lock = threading.Lock()  # files download in parallel

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self.callback is not None:
                now = time.monotonic()
                if now >= self._next:
                    self._next = now + 1.0 / PROGRESS_HZ
                    self._emit(now)

    def emit(self, now: float | None = None, message: str | None = None) -> None:
        with self._lock:
            self._emit(now, message)

    def rate(self, now: float) -> float | None:
        self._window.append((now, self.done))
        while len(self._window) > 2 and now - self._window[0][0] > 5.0:  # rate over the last ~5 s
            self._window.pop(0)
        t0, d0 = self._window[0]
        if now - t0 > 0.2:
            return (self.done - d0) / (now - t0)
        elapsed = now - self._start
        return (self.done - self._start_done) / elapsed if elapsed > 0.2 else None

    def _emit(self, now: float | None = None, message: str | None = None) -> None:
        if self.callback is None:
            return
        now = time.monotonic() if now is None else now
        rate = self.rate(now)
        eta = (self.total - self.done) / rate if rate else None
        if message is None:
            rate_text = f"{_format_bytes(rate)}/s" if rate else "--"
            message = (
                f"{self.label}: {_format_bytes(self.done)} of {_format_bytes(self.total)}, "
                f"{rate_text}, ETA {_format_eta(eta)}"
            )
        self.callback(
            DownloadProgress(
                stage="download",
                message=message,
                done=float(self.done),
                total=float(self.total),
                bytes_per_s=rate,
                eta_s=eta,
                file=self.file,
            )
        )


def fetch_file(
    repo: str,
    commit: str,
    remote: RemoteFile,
    staging: Path,
    expected_md5: str | None,
    progress: ProgressTracker,
    cancel: threading.Event,
    algorithm: str = "md5",
    checksum_source: str = "tensor-cache.json",
) -> None:
    """Download one file into ``staging`` (resuming ``.part``), verify it, rename it into place.

    ``expected_md5`` is the digest ``checksum_source`` gives, in ``algorithm`` (md5 for weight
    shards, sha256 for prebuilt libraries)."""
    import httpx2
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    rel = safe_relative_path(remote.name)
    final = staging.joinpath(*rel.parts)
    part = final.with_name(final.name + ".part")
    final.parent.mkdir(parents=True, exist_ok=True)
    url = hf_hub_url(repo, remote.name, revision=commit, endpoint=_endpoint())
    headers = build_hf_headers(library_name="llmchat")
    headers["Accept-Encoding"] = "identity"
    timeout = httpx2.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    progress.file = remote.name

    md5_retry_left = 1
    attempt = 0
    while True:
        offset = part.stat().st_size if part.exists() else 0
        if remote.size is not None and offset > remote.size:
            part.unlink()
            progress.add(-offset)
            offset = 0
        hashes = ExpectedHashes(remote, expected_md5, algorithm, checksum_source)
        if offset:
            hashes.update_file(part)
        try:
            if remote.size is None or offset < remote.size:
                request_headers = dict(headers)
                if offset:
                    request_headers["Range"] = f"bytes={offset}-"
                if cancel.is_set():
                    raise cancelled()
                with (
                    get_session().stream("GET", url, headers=request_headers, timeout=timeout) as response,
                    part.open("ab") as f,
                    _close_on_cancel(response, cancel),
                ):
                    if response.status_code == 416 and offset:
                        if remote.size is not None:  # the hub has fewer bytes than the listing says
                            raise LlmchatError(
                                f"{repo}: {remote.name} on the hub is {offset} bytes or less, "
                                f"the listing says {remote.size}",
                                "retry later; the repo may be changing",
                            )
                        # size unknown: the partial file already holds everything
                    else:
                        hf_raise_for_status(response)
                        if offset and response.status_code == 200:  # the server ignored Range: start over
                            f.truncate(0)
                            f.seek(0)
                            progress.add(-offset)
                            offset = 0
                            hashes.reset()
                        for chunk in response.iter_bytes():
                            if cancel.is_set():
                                raise cancelled()
                            _write_chunk(f, chunk)
                            hashes.update(chunk)
                            offset += len(chunk)
                            progress.add(len(chunk))
        except LlmchatError:
            raise
        except Exception as err:
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise LlmchatError(
                    f"the disk is full: writing {remote.name} to {staging} failed ({os.strerror(err.errno)})",
                    "free some disk space, then run the download again: it resumes where it stopped",
                ) from None
            if cancel.is_set():  # the watcher shut the connection down under a stalled read
                raise cancelled() from None
            if not _is_retryable(err):
                raise _hub_error(repo, err, remote.name) from None
            attempt = _retry_or_raise(repo, remote, err, attempt, cancel)
            continue

        part.touch()  # a zero-byte file needs no request but must still exist
        size = part.stat().st_size
        if remote.size is not None and size < remote.size:
            # the body ended early without an error (should not happen with Content-Length): retry
            attempt = _retry_or_raise(repo, remote, _ShortBody("short body"), attempt, cancel)
            continue
        if remote.size is not None and size != remote.size:
            part.unlink()
            progress.add(-size)
            raise LlmchatError(
                f"{repo}: {remote.name} is {size} bytes, the listing says {remote.size}",
                "retry later; the repo may be changing",
            )
        bad = hashes.mismatch()
        if bad:
            part.unlink()
            progress.add(-size)
            if md5_retry_left:
                md5_retry_left -= 1
                continue
            raise LlmchatError(
                f"{repo}: {remote.name} failed its checksum twice ({bad})",
                "retry later; if it persists the repo or a proxy between you and the hub is corrupting files",
            )
        os.replace(part, final)
        return


def _abort(response) -> None:
    """Shut the response's socket down: this wakes a thread blocked reading it (close() would not)."""
    with contextlib.suppress(Exception):
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        response.close()


@contextlib.contextmanager
def _close_on_cancel(response, cancel: threading.Event) -> Iterator[None]:
    """Close ``response`` as soon as ``cancel`` is set, so that a stalled read ends at once."""
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            if cancel.wait(0.05):
                if not finished.is_set():
                    _abort(response)
                return

    watcher = threading.Thread(target=watch, name="download-cancel-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join()


def _is_retryable(err: BaseException) -> bool:
    import httpx2
    from huggingface_hub import errors as hf_errors

    if isinstance(err, hf_errors.HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        return status in (408, 429, 500, 502, 503, 504)
    return isinstance(err, (httpx2.TransportError, ConnectionError))


def cancelled() -> DownloadCancelled:
    return DownloadCancelled("download cancelled", "run the same download again to resume where it stopped")


def _retry_or_raise(
    repo: str, remote: RemoteFile, err: BaseException, attempt: int, cancel: threading.Event
) -> int:
    attempt += 1
    if attempt >= MAX_ATTEMPTS:
        raise _hub_error(repo, err, remote.name) from None
    delay = RETRY_DELAYS[min(attempt - 1, len(RETRY_DELAYS) - 1)]
    if cancel.wait(delay):
        raise cancelled()
    return attempt


def staging_bytes(staging: Path, files: list[RemoteFile]) -> int:
    """Bytes of ``files`` already in staging (complete files and .part files)."""
    done = 0
    for remote in files:
        final = staging.joinpath(*safe_relative_path(remote.name).parts)
        part = final.with_name(final.name + ".part")
        if final.is_file():
            done += final.stat().st_size
        elif part.is_file():
            done += part.stat().st_size
    return done


def fetch_verified(
    repo: str,
    commit: str,
    remotes: list[RemoteFile],
    staging: Path,
    sha256: dict[str, str | None],
    checksum_source: str,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    label: str = "",
) -> None:
    """Fetch ``remotes`` of ``repo`` at ``commit`` into ``staging`` with the weights' code: resumed
    from ``.part`` files, retried, each renamed into place only once its size matches the listing
    and its sha256 the one ``checksum_source`` gives (None: size only)."""
    if _offline():
        raise _offline_error()
    cancel = cancel or threading.Event()
    total = sum(r.size or 0 for r in remotes)
    tracker = ProgressTracker(progress, total, staging_bytes(staging, remotes), label or repo)
    for remote in remotes:
        final = staging.joinpath(*safe_relative_path(remote.name).parts)
        if final.is_file() and (remote.size is None or final.stat().st_size == remote.size):
            continue  # complete in an earlier run (verified again by the caller)
        fetch_file(
            repo,
            commit,
            remote,
            staging,
            sha256.get(remote.name),
            tracker,
            cancel,
            algorithm="sha256",
            checksum_source=checksum_source,
        )
