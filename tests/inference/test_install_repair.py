"""Issue 19, items 6 and 7: a broken install is shown as broken and `llmchat download` repairs it
(catalog id, HF://owner/repo, owner--repo); every listed file is verified (sha256 of LFS files,
git blob id of the others) and the model parses before it counts as installed. Real loopback hub
(tests/hub_server.py), real files, the real CLI."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.cli import main
from app.errors import LlmchatError
from app.inference.store import hub as hub_files
from app.inference.store.catalog import installed_model_path, list_installed
from app.inference.store.downloads import download_model
from app.inference.store.installed import quick_problem, verify
from app.inference.store.weights import read_manifest, verify_shards
from tests.hub_server import TINY_ID, TINY_REPO, HubServer, make_tiny_mlc_model, use_hub

OTHER_REPO = "someone/Other-q4f16_1-MLC"
OTHER_ID = "someone--Other-q4f16_1-MLC"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    server = HubServer().start()
    server.add_repo(TINY_REPO, make_tiny_mlc_model())
    server.add_repo(OTHER_REPO, make_tiny_mlc_model(seed=3))
    use_hub(server, tmp_path, monkeypatch)
    monkeypatch.setattr(hub_files, "RETRY_DELAYS", (0.01, 0.02, 0.05))
    yield server
    server.stop()


def models_json(capsys) -> dict[str, dict]:
    capsys.readouterr()
    assert main(["models", "--json", "--memory", "8"]) == 0
    return {row["id"]: row for row in json.loads(capsys.readouterr().out)["models"]}


def test_deleted_shard_shows_broken_and_download_by_id_fetches_only_it(hub, capsys):
    path = download_model(TINY_ID)
    assert models_json(capsys)[TINY_ID]["broken"] is None
    shard = path / "params_shard_1.bin"
    shard.unlink()

    row = models_json(capsys)[TINY_ID]
    assert row["installed"] and "params_shard_1.bin is missing" in row["broken"]
    assert row["fix"] == (
        f"`llmchat download {TINY_ID}` checks every file and fetches what is missing or damaged"
    )
    assert main(["models", "--memory", "8"]) == 0
    table = capsys.readouterr().out
    assert f"{TINY_ID} is broken: params_shard_1.bin is missing" in table
    assert any(line.startswith(TINY_ID) and line.rstrip().endswith("broken") for line in table.splitlines())

    hub.counters.reset()
    assert main(["download", TINY_ID]) == 0  # the fix the message gives
    assert capsys.readouterr().out.strip() == str(path)
    resolved = [r[1].rsplit("/", 1)[-1] for r in hub.counters.requests if "/resolve/" in r[1]]
    assert resolved == ["params_shard_1.bin"]  # only what was missing
    assert verify(path) is None and models_json(capsys)[TINY_ID]["broken"] is None


def test_hf_reference_and_owner_id_repair_a_repo_outside_the_catalog(hub, capsys):
    path = download_model(f"HF://{OTHER_REPO}")
    assert path.name == OTHER_ID
    (path / "tokenizer.json").unlink()
    assert "tokenizer.json" in models_json(capsys)[OTHER_ID]["broken"]
    hub.counters.reset()
    assert main(["download", f"HF://{OTHER_REPO}"]) == 0
    assert hub.counters.gets == {"tokenizer.json": 1}
    assert verify(path) is None

    # a shard rewritten in place with its mtime restored: same size, same mtime, other bytes
    shard = path / "params_shard_0.bin"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_size == st.st_size
    hub.counters.reset()
    assert main(["download", OTHER_ID]) == 0  # the id `llmchat models` shows
    assert hub.counters.gets == {"params_shard_0.bin": 1}
    assert verify(path) is None


def test_shard_corrupted_with_mtime_kept_fails_the_remembered_md5(hub):
    path = download_model(TINY_ID)
    manifest = read_manifest(path)
    verify_shards(path, manifest)  # hashed and remembered
    shard = path / "params_shard_2.bin"
    st = shard.stat()
    with shard.open("r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(LlmchatError, match=r"params_shard_2\.bin is corrupt") as info:
        verify_shards(path, manifest)
    assert f"llmchat download {TINY_ID}" in info.value.fix


def test_a_config_corrupted_in_transit_fails_its_git_blob_id(hub):
    hub.faults.flip_byte["mlc-chat-config.json"] = (5, -1)
    with pytest.raises(LlmchatError, match=r"mlc-chat-config.json failed its checksum twice \(git blob id"):
        download_model(TINY_ID)
    assert list_installed() == []


def test_a_tokenizer_corrupted_in_transit_is_fetched_again(hub):
    hub.faults.flip_byte["tokenizer.json"] = (3, 1)
    path = download_model(TINY_ID)
    assert hub.counters.gets["tokenizer.json"] == 2
    assert verify(path) is None


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("mlc-chat-config.json", b'{"model_type": "llama", ', "not valid JSON"),
        ("tokenizer.json", b"{not json", "cannot load"),
        ("tokenizer_config.json", b'{"chat_template": "{% if %}"}', "chat template"),
    ],
)
def test_a_repo_whose_files_do_not_parse_is_not_installed(hub, name, text, expected):
    files = make_tiny_mlc_model(seed=5)
    files[name] = text
    hub.add_repo("someone/Broken-MLC", files)
    with pytest.raises(LlmchatError, match=expected) as info:
        download_model("HF://someone/Broken-MLC")
    assert "the repo itself is broken" in info.value.problem
    assert list_installed() == []


def test_an_imported_model_that_is_damaged_names_the_reimport(hub, tmp_path, capsys):
    model = Path(os.environ["LLMCHAT_DATA_DIR"]) / "models" / "my-import"
    for name, data in make_tiny_mlc_model(seed=7).items():
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_bytes(data)
    (model / "llmchat-import.json").write_text(json.dumps({"source": "/models/my.gguf"}))
    assert main(["download", "my-import"]) == 0  # whole: checked, nothing fetched
    (model / "params_shard_0.bin").write_bytes(b"short")
    assert "params_shard_0.bin" in quick_problem(model)
    capsys.readouterr()
    assert main(["download", "my-import"]) == 1
    err = capsys.readouterr().err
    assert "my-import is damaged" in err
    assert "fix: import it again: `llmchat remove my-import` then `llmchat import /models/my.gguf" in err
    assert installed_model_path("my-import") is not None


def test_an_unparsable_chat_template_is_refused_at_import(tmp_path, monkeypatch):
    from app.inference.store.gguf_import import import_gguf
    from tests.inference.tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    bad = write_tiny_gguf(tmp_path / "bad.gguf", chat_template="{% for m in messages %}{{ m.content }")
    with pytest.raises(LlmchatError, match=r"chat template .* does not parse") as info:
        import_gguf(bad, "bad")
    assert "convert the model again" in info.value.fix
    models = tmp_path / "data" / "models"
    assert not models.exists() or list(models.iterdir()) == []  # nothing installed, no staging left

    good = import_gguf(write_tiny_gguf(tmp_path / "good.gguf"), "good")
    assert json.loads((good / "llmchat-import.json").read_text())["source"] == str(tmp_path / "good.gguf")


@pytest.mark.parametrize("which", ["LLMCHAT_DATA_DIR", "LLMCHAT_CACHE_DIR"])
def test_an_unwritable_data_or_cache_dir_is_a_message(hub, tmp_path, monkeypatch, capsys, which):
    """A data or cache directory that cannot be made (a file where a directory belongs: the same
    OSError path as a read-only one, which root, who runs CI, cannot be shown) is a message."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(which, str(blocker / "dir"))
    for model in (TINY_ID, "smollm2-135m-instruct"):
        capsys.readouterr()
        rc = main(["download", model])
        err = capsys.readouterr().err
        assert "Traceback" not in err
        if model == TINY_ID and which == "LLMCHAT_CACHE_DIR":
            assert rc == 0  # a download needs no cache (remembering verified files is skipped, logged)
            continue
        assert rc == 1 and "a part of the path is a file, not a directory" in err, err
        assert str(blocker) in err and "fix: move that file away" in err
