"""A small Hugging Face Hub on 127.0.0.1 for tests: real HTTP, real sockets, fault injection.

It speaks the part of the Hub's HTTP API that huggingface_hub 2.4.0 uses to get a repo's file listing
and to download files (point ``HF_ENDPOINT`` at :attr:`HubServer.endpoint`):

- ``GET /api/models/{owner}/{name}[/revision/{rev}][?blobs=true]`` → ``{id, sha, gated, private,
  siblings: [{rfilename, size, blobId, lfs?}]}`` (``HfApi.model_info``)
- ``HEAD|GET /{owner}/{name}/resolve/{rev}/{path}`` with ``ETag``, ``X-Repo-Commit``, ``X-Linked-Size``,
  ``X-Linked-Etag`` (LFS files), ``Accept-Ranges`` and ``Range`` → ``206`` + ``Content-Range``
  (``hf_hub_download``, ``get_hf_file_metadata``)
- errors with the Hub's ``X-Error-Code`` header (RepoNotFound, EntryNotFound, GatedRepo), which
  ``huggingface_hub.utils.hf_raise_for_status`` turns into its typed errors.

Faults (see :class:`Faults`): cut the connection after N bytes of a file, flip one byte, answer a status
code (404, 500, 401 …) for a file or for the API call, add names such as ``../x`` to the listing, and
require a token (gated repo). Counters record every request and the body bytes sent per file.

Also here: :func:`make_tiny_mlc_model`, an MLC-format model (mlc-chat-config.json, tensor-cache.json with
an md5 per shard, random params_shard_*.bin, tokenizer files) for the tests to serve.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

SEND_CHUNK = 1 << 20


def _git_blob_id(data: bytes) -> str:
    """git's object id of a blob (what the Hub lists as ``blobId`` for a file kept in git)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Faults:
    """What to break. Counts say how many more requests get the fault (-1 = every request)."""

    cut_after: dict[str, tuple[int, int]] = field(default_factory=dict)  # file -> (bytes, count)
    flip_byte: dict[str, tuple[int, int]] = field(default_factory=dict)  # file -> (offset, count)
    file_status: dict[str, tuple[int, int]] = field(default_factory=dict)  # file -> (status, count)
    api_status: tuple[int, int] | None = None  # (status, count) for the listing call
    extra_listing: list[dict] = field(default_factory=list)  # siblings added to the listing
    require_token: str | None = None  # gated: files need "Authorization: Bearer <token>"
    stall_after: dict[str, int] = field(default_factory=dict)  # file -> bytes, then the server waits
    listed_size: dict[str, int] = field(default_factory=dict)  # file -> size the listing claims

    @staticmethod
    def take(table: dict, key: str):
        """The fault for ``key`` if it still applies (and count one use)."""
        if key not in table:
            return None
        value, count = table[key]
        if count == 0:
            return None
        if count > 0:
            table[key] = (value, count - 1)
        return value


@dataclass
class Repo:
    """One model repo: file name → content, at one commit."""

    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool | str = False
    lfs_suffixes: tuple[str, ...] = (".bin", ".gguf", ".safetensors")

    def is_lfs(self, name: str) -> bool:
        return name.endswith(self.lfs_suffixes)


@dataclass
class Counters:
    # (method, path, Range header, has Authorization)
    requests: list[tuple[str, str, str | None, bool]] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)  # file -> body bytes written
    gets: dict[str, int] = field(default_factory=dict)  # file -> GET count

    def reset(self) -> None:
        self.requests.clear()
        self.bytes_sent.clear()
        self.gets.clear()


_API_RE = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?/?$")
_RESOLVE_RE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args) -> None:  # quiet
        pass

    # -- helpers ------------------------------------------------------------------------------
    def _error(self, status: int, code: str | None = None, message: str = "error") -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self) -> None:
        hub = self.server.hub
        with hub.lock:
            hub.counters.requests.append(
                (self.command, self.path, self.headers.get("Range"), "Authorization" in self.headers)
            )

    # -- API ----------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._record()
        path = unquote(urlsplit(self.path).path)
        if m := _API_RE.match(path):
            self._model_info(m.group(1), m.group(2))
        elif m := _RESOLVE_RE.match(path):
            self._resolve(m.group(1), m.group(2), m.group(3), head=False)
        else:
            self._error(404, None, "no such route")

    def do_HEAD(self) -> None:
        self._record()
        path = unquote(urlsplit(self.path).path)
        if m := _RESOLVE_RE.match(path):
            self._resolve(m.group(1), m.group(2), m.group(3), head=True)
        else:
            self._error(404, None, "no such route")

    def _model_info(self, repo_id: str, revision: str | None) -> None:
        hub = self.server.hub
        with hub.lock:
            status = None
            if hub.faults.api_status is not None:
                status, count = hub.faults.api_status
                if count == 0:
                    status = None
                elif count > 0:
                    hub.faults.api_status = (status, count - 1)
        if status is not None:
            code = {401: "GatedRepo", 404: "RepoNotFound"}.get(status)
            return self._error(status, code, f"injected {status}")
        repo = hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if revision not in (None, "main", repo.sha):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        siblings = []
        for name, data in repo.files.items():
            size = hub.faults.listed_size.get(name, len(data))
            sibling: dict = {"rfilename": name, "size": size, "blobId": _git_blob_id(data)}
            if repo.is_lfs(name):
                sha256 = hashlib.sha256(data).hexdigest()
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
                sibling["blobId"] = _git_blob_id(pointer.encode())  # the Hub lists the pointer's id
                sibling["lfs"] = {"size": size, "sha256": sha256, "pointerSize": 134}
            siblings.append(sibling)
        siblings += hub.faults.extra_listing
        body = json.dumps(
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": repo.sha,
                "private": False,
                "gated": repo.gated,
                "siblings": siblings,
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
        hub = self.server.hub
        repo = hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if revision not in ("main", repo.sha):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        with hub.lock:
            status = Faults.take(hub.faults.file_status, filename)
            cut = None if head else Faults.take(hub.faults.cut_after, filename)
            flip = None if head else Faults.take(hub.faults.flip_byte, filename)
            stall = None if head else hub.faults.stall_after.get(filename)
        if status is not None:
            code = {401: "GatedRepo", 403: "GatedRepo", 404: "EntryNotFound"}.get(status)
            return self._error(status, code, f"injected {status}")
        token = hub.faults.require_token
        if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
            return self._error(401, "GatedRepo", "Access to this model is restricted")
        data = repo.files.get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found")
        size = len(data)
        start, end = 0, size - 1
        status_code = 200
        if (rng := self.headers.get("Range")) and (m := _RANGE_RE.match(rng.strip())):
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else size - 1
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            end = min(end, size - 1)
            status_code = 206
        etag = hashlib.sha256(data).hexdigest() if repo.is_lfs(filename) else _git_blob_id(data)
        self.send_response(status_code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", repo.sha)
        if repo.is_lfs(filename):
            self.send_header("X-Linked-Size", str(size))
            self.send_header("X-Linked-Etag", f'"{etag}"')
        if status_code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return
        with hub.lock:
            hub.counters.gets[filename] = hub.counters.gets.get(filename, 0) + 1
        body = memoryview(data)[start : end + 1]
        if flip is not None and start <= flip <= end:
            patched = bytearray(body)
            patched[flip - start] ^= 0xFF
            body = memoryview(bytes(patched))
        limit = len(body) if cut is None else max(0, min(len(body), cut - start))
        limit = limit if stall is None else max(0, min(limit, stall - start))
        sent = 0
        try:
            while sent < limit:
                n = min(SEND_CHUNK, limit - sent)
                self.wfile.write(body[sent : sent + n])
                sent += n
                with hub.lock:
                    hub.counters.bytes_sent[filename] = hub.counters.bytes_sent.get(filename, 0) + n
            if stall is not None and sent < len(body):
                self.wfile.flush()
                hub.release_stall.wait(hub.stall_timeout_s)
                return self._drop()
            if cut is not None and sent < len(body):
                return self._drop()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _drop(self) -> None:
        """Cut the connection in the middle of the body."""
        self.wfile.flush()
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    hub: HubServer


class HubServer:
    """The test hub; use as a context manager or call :meth:`start` / :meth:`stop`."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.faults = Faults()
        self.counters = Counters()
        self.lock = threading.Lock()
        self.release_stall = threading.Event()
        #: how long a stalled response waits for release_stall before it drops the connection
        #: (None: until released; stop() releases every stall)
        self.stall_timeout_s: float | None = 30
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(self, repo_id: str, files: dict[str, bytes], **kwargs) -> Repo:
        repo = Repo(files=dict(files), **kwargs)
        self.repos[repo_id] = repo
        return repo

    def start(self) -> HubServer:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.hub = self
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release_stall.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def make_tiny_mlc_model(
    shard_sizes: tuple[int, ...] = (300_000, 200_000, 150_000), seed: int = 0
) -> dict[str, bytes]:
    """An MLC model directory as {file name: bytes}: random shards, their md5 sums in tensor-cache.json."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    records = []
    for index, size in enumerate(shard_sizes):
        name = f"params_shard_{index}.bin"
        data = rng.randbytes(size)
        files[name] = data
        records.append(
            {
                "dataPath": name,
                "format": "raw-shard",
                "nbytes": size,
                "records": [
                    {
                        "name": f"model.layers.{index}.weight",
                        "shape": [size // 2],
                        "dtype": "float16",
                        "format": "raw",
                        "nbytes": size,
                        "byteOffset": 0,
                    }
                ],
                "md5sum": hashlib.md5(data).hexdigest(),
            }
        )
    files["tensor-cache.json"] = json.dumps(
        {
            "metadata": {"ParamSize": len(shard_sizes), "ParamBytes": sum(shard_sizes), "BitsPerParam": 16},
            "records": records,
        }
    ).encode()
    files["mlc-chat-config.json"] = json.dumps(
        {
            "version": "0.1.0",
            "model_type": "llama",
            "quantization": "q4f16_1",
            "model_config": {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 256,
                "context_window_size": 512,
            },
            "context_window_size": 512,
            "vocab_size": 256,
            "tokenizer_files": ["tokenizer.json"],
            "conv_template": "chatml",
        }
    ).encode()
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}
    files["tokenizer.json"] = json.dumps(tokenizer).encode()
    files["tokenizer_config.json"] = b'{"model_max_length": 512}'
    files[".gitattributes"] = b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    return files


TINY_REPO = "mlc-ai/Tiny-q4f16_1-MLC"
TINY_ID = "tiny-mlc"
TINY_REGISTRY = f"""
[[model]]
id = "{TINY_ID}"
name = "Tiny test model"
source = {{ hf = "{TINY_REPO}", revision = "main" }}
format = "mlc"
architecture = "llama"
quantization = "q4f16_1"
parameters = 1000
download_bytes = 650000
context_window = 512
license = "apache-2.0"
gated = false
num_layers = 2
num_kv_heads = 2
head_dim = 16
vocab_size = 256
"""


def use_hub(server: HubServer, root, monkeypatch) -> dict[str, str]:
    """Point huggingface_hub and llmchat at ``server`` and at fresh directories under ``root``.

    The user registry in the config directory lists TINY_ID (source TINY_REPO). Returns the environment
    variables it set (for subprocesses).
    """
    env = {
        "HF_ENDPOINT": server.endpoint,
        "LLMCHAT_DATA_DIR": str(root / "data"),
        "LLMCHAT_CACHE_DIR": str(root / "cache"),
        "LLMCHAT_CONFIG_DIR": str(root / "config"),
        "HF_HOME": str(root / "hf-home"),  # no stored token of the machine's user
    }
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (root / "config").mkdir(parents=True, exist_ok=True)
    (root / "config" / "models_registry.toml").write_text(TINY_REGISTRY)
    return env


def _serve_forever_main() -> None:  # pragma: no cover - manual benchmarking helper
    """``python -m tests.hub_server DIR``: serve a directory of files as repo bench/model."""
    import sys
    import time

    root = sys.argv[1]
    files = {}
    for name in os.listdir(root):
        with open(os.path.join(root, name), "rb") as f:
            files[name] = f.read()
    hub = HubServer().start()
    hub.add_repo("bench/model", files)
    print(hub.endpoint, flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        hub.stop()


if __name__ == "__main__":  # pragma: no cover
    _serve_forever_main()
