"""Prebuilt model libraries end to end: a bundle built in this session for the CPU (real TVM
compile) is published on the loopback Hub (tests/hub_server.py), downloaded on a "fresh machine"
(empty cache) and answers exactly like the local compile; every bad bundle (a flipped byte, a
manifest for another CPU level or TVM version, a missing file, a wrong catalog pin, a library that
does not load) ends in the fallback or a clear error with nothing broken left in the cache; a cut
download resumes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from app.cli import main
from app.errors import LlmchatError
from app.inference.compile import build, cache, compiler, prebuilt, targets
from app.inference.engine.tvm_engine import load_engine
from app.inference.store import downloads
from app.inference.store import hub as hub_files
from tests.hub_server import HubServer, use_hub

MODEL_REPO = "org/Tiny-Llama-q4f32_1-MLC"
LIBS_REPO = "org/llmchat-libs"
MODEL_ID = "tiny-llama"
PROMPT = [5, 9, 14, 3, 27, 8, 41, 2]
GREEDY_STEPS = 12


def registry(libs: str = "") -> str:
    return f"""
[[model]]
id = "{MODEL_ID}"
name = "Tiny llama"
source = {{ hf = "{MODEL_REPO}", revision = "main" }}
format = "mlc"
architecture = "llama"
quantization = "q4f32_1"
parameters = 1000
download_bytes = 650000
context_window = 256
license = "apache-2.0"
gated = false
num_layers = 2
num_kv_heads = 2
head_dim = 16
vocab_size = 300
{libs}
"""


def answers(engine) -> tuple[np.ndarray, list[int]]:
    """Every logit of the prompt's prefill and of a greedy continuation, and the greedy tokens."""
    rt = engine.runtime
    engine._clear_kv()
    rows = [np.array(rt.prefill(PROMPT), dtype=np.float32, copy=True).ravel()]
    tokens = [int(np.argmax(rows[0]))]
    for _ in range(GREEDY_STEPS - 1):
        rows.append(np.array(rt.decode(tokens[-1]), dtype=np.float32, copy=True).ravel())
        tokens.append(int(np.argmax(rows[-1])))
    engine._clear_kv()
    return np.stack(rows), tokens


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """The bundle ``llmchat build`` writes for this CPU, and how the local compile answers."""
    model = tiny_model_dir("llama", "q4f32_1")
    out = tmp_path_factory.mktemp("bundles")
    assert main(["build", str(model), "--device", "cpu", "--out", str(out)]) == 0
    (folder,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    engine = load_engine(model, device="cpu")  # the session cache: the library build compiled
    try:
        assert engine.runtime is not None
        reference = answers(engine)
    finally:
        engine.close()
    return model, folder, reference


def bundle_files(folder: Path, prefix: str = "libs") -> dict[str, bytes]:
    return {f"{prefix}/{folder.name}/{p.name}": p.read_bytes() for p in folder.iterdir()}


def model_files(model: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fresh machine (empty data, cache and config directories) and the loopback Hub."""
    server = HubServer().start()
    use_hub(server, tmp_path, monkeypatch)
    (tmp_path / "config" / "models_registry.toml").write_text(registry())
    monkeypatch.setattr(hub_files, "RETRY_DELAYS", (0.01, 0.02, 0.05))
    monkeypatch.delenv(prebuilt.NO_PREBUILT_ENV, raising=False)
    server.root = tmp_path
    yield server
    server.stop()


def cache_entries() -> list[dict]:
    return [json.loads(p.read_text()) for p in cache.libs_dir().glob("*.json")]


def nothing_broken_cached() -> None:
    """No half-installed library: every entry is complete and verified, no staging left over."""
    for meta in cache.libs_dir().glob("*.json"):
        assert cache.verified_entry(meta.with_suffix(".so"), meta) is not None
    assert not list(cache.libs_dir().glob("*.so")) or all(
        p.with_suffix(".json").exists() for p in cache.libs_dir().glob("*.so")
    )
    staging = cache.libs_dir() / prebuilt.STAGING
    assert not staging.exists() or not any(staging.iterdir())


def forged(folder: Path, out: Path, **key_changes: str) -> Path:
    """A copy of the bundle whose manifest claims another key (consistent digest, same folder name)."""
    copy = out / folder.name
    copy.mkdir(parents=True)
    manifest = json.loads((folder / prebuilt.MANIFEST).read_text())
    key = cache.LibraryKey.from_dict(manifest["key"])
    key = dataclasses.replace(key, **key_changes)
    manifest["key"], manifest["digest"] = key.as_dict(), key.digest()
    (copy / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    (copy / prebuilt.LIBRARY).write_bytes((folder / prebuilt.LIBRARY).read_bytes())
    return copy


# ------------------------------------------------------------------------------------------
def test_bundle_manifest_carries_the_cache_key(built):
    model, folder, _ = built
    manifest = prebuilt.parse_manifest((folder / prebuilt.MANIFEST).read_bytes())
    from app.inference.hardware.device_spec import DeviceSpec
    from app.inference.store.config import ModelConfig

    slot = compiler.library_slot(ModelConfig.load(model), DeviceSpec("cpu"))
    assert manifest.key == slot.key and folder.name == slot.digest == manifest.digest
    level = targets.cpu_level()
    assert manifest.key.host_cpu == level and manifest.key.target == f"cpu-{level}"
    size, sha = manifest.files[prebuilt.LIBRARY]
    lib = folder / prebuilt.LIBRARY
    assert lib.stat().st_size == size and hashlib.sha256(lib.read_bytes()).hexdigest() == sha
    assert set(p.name for p in folder.iterdir()) == {prebuilt.MANIFEST, prebuilt.LIBRARY}


def test_model_repo_bundle_downloads_and_answers_exactly_like_a_local_compile(built, hub, capsys):
    model, folder, (ref_logits, ref_tokens) = built
    hub.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(folder)})
    before = build.COMPILE_COUNT
    assert main(["download", MODEL_ID, "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "prebuilt, from HF://" in err and "sha256 verified" in err
    installed = hub.root / "data" / "models" / MODEL_ID
    assert not (installed / "libs").exists()  # libraries are not weights
    (entry,) = cache_entries()
    assert entry["origin"] == "prebuilt" and entry["key"] == folder.name
    events = []
    engine = load_engine(MODEL_ID, device="cpu", progress=events.append)
    try:
        logits, tokens = answers(engine)
    finally:
        engine.close()
    assert before == build.COMPILE_COUNT  # nothing compiled on this machine
    assert not [e for e in events if e.stage == "compile"]  # a cache hit
    np.testing.assert_array_equal(logits, ref_logits)
    assert tokens == ref_tokens and len(tokens) == GREEDY_STEPS
    nothing_broken_cached()


def test_catalog_pinned_bundle_is_fetched_on_first_load(built, hub):
    model, folder, (ref_logits, _) = built
    hub.add_repo(MODEL_REPO, model_files(model))
    hub.add_repo(LIBS_REPO, bundle_files(folder, "llmchat/tiny"))
    pin = hashlib.sha256((folder / prebuilt.MANIFEST).read_bytes()).hexdigest()
    target = f"cpu-{targets.cpu_level()}"
    lib = (
        f'prebuilt_libs = [{{ target = "{target}", repo = "{LIBS_REPO}", '
        f'path = "llmchat/tiny/{folder.name}", sha256 = "{pin}" }}]'
    )
    (hub.root / "config" / "models_registry.toml").write_text(registry(lib))
    downloads.download_model(MODEL_ID)
    before = build.COMPILE_COUNT
    events = []
    engine = load_engine(MODEL_ID, device="cpu", progress=events.append)  # the first-run flow's load
    try:
        logits, _ = answers(engine)
    finally:
        engine.close()
    assert before == build.COMPILE_COUNT
    assert any("using the prebuilt library" in e.message and "the catalog" in e.message for e in events)
    np.testing.assert_array_equal(logits, ref_logits)
    # `llmchat models` says so
    from app.commands.models import collect

    row = next(r for r in collect(None) if r["id"] == MODEL_ID)
    assert row["library"] == "prebuilt"


def test_wrong_catalog_pin_and_flipped_byte_fall_back_to_compiling(built, hub):
    """A manifest that is not the catalog's, then a library byte flipped on the wire: neither is
    used, nothing is cached, and the model compiles here and answers the same."""
    model, folder, (ref_logits, _) = built
    hub.add_repo(MODEL_REPO, model_files(model))
    hub.add_repo(LIBS_REPO, bundle_files(folder))
    target = f"cpu-{targets.cpu_level()}"
    lib = (
        f'prebuilt_libs = [{{ target = "{target}", repo = "{LIBS_REPO}", '
        f'path = "libs/{folder.name}", sha256 = "{"0" * 64}" }}]'
    )
    (hub.root / "config" / "models_registry.toml").write_text(registry(lib))
    model_dir = downloads.download_model(MODEL_ID)
    line = prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert "compiles here on first use" in line and "failed its checksum" in line and "the catalog" in line
    assert cache_entries() == []
    nothing_broken_cached()

    pin = hashlib.sha256((folder / prebuilt.MANIFEST).read_bytes()).hexdigest()
    (hub.root / "config" / "models_registry.toml").write_text(registry(lib.replace("0" * 64, pin)))
    so = f"libs/{folder.name}/{prebuilt.LIBRARY}"
    hub.faults.flip_byte[so] = (1000, -1)
    before = build.COMPILE_COUNT
    events = []
    engine = load_engine(MODEL_ID, device="cpu", progress=events.append)
    try:
        logits, _ = answers(engine)
    finally:
        engine.close()
    assert before + 1 == build.COMPILE_COUNT
    fallback = [e.message for e in events if "no usable prebuilt library" in e.message]
    assert fallback and "sha256" in fallback[0] and "compiling here" in fallback[0]
    assert hub.counters.gets[so] == 2  # fetched, failed its sha256, fetched once more, failed: given up
    (entry,) = cache_entries()
    assert entry["origin"] == "compiled"
    np.testing.assert_array_equal(logits, ref_logits)
    nothing_broken_cached()


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"device": "x86-64-v2", "host_cpu": "x86-64-v2"}, "target x86-64-v2 (here "),
        ({"tvm": "0.26.0"}, "TVM 0.26.0 (here "),
    ],
)
def test_manifest_for_another_machine_is_rejected_before_the_library_is_fetched(
    built, hub, tmp_path, change, words
):
    model, folder, _ = built
    if change.get("device") == targets.cpu_level():
        change = {"device": "x86-64", "host_cpu": "x86-64"}
    bad = forged(folder, tmp_path / "forged", **change)
    hub.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(bad)})
    model_dir = downloads.download_model(MODEL_ID)
    line = prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert "compiles here on first use" in line and "built for" in line and words in line
    assert hub.counters.gets.get(f"libs/{folder.name}/{prebuilt.LIBRARY}", 0) == 0
    assert cache_entries() == []
    nothing_broken_cached()


def test_repo_bundles_for_other_keys_are_named_and_a_missing_file_is_an_error(built, hub, tmp_path):
    model, folder, _ = built
    other = forged(folder, tmp_path / "other", tvm="0.26.0")
    renamed = tmp_path / "renamed" / json.loads((other / prebuilt.MANIFEST).read_text())["digest"]
    renamed.parent.mkdir()
    other.rename(renamed)
    hub.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(renamed)})
    model_dir = downloads.download_model(MODEL_ID)
    line = prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert "has 1 prebuilt library, none built with this machine's key" in line
    assert not hub.counters.gets.get(f"libs/{renamed.name}/{prebuilt.MANIFEST}")

    files = {**model_files(model), **bundle_files(folder)}
    del files[f"libs/{folder.name}/{prebuilt.LIBRARY}"]
    hub.add_repo(MODEL_REPO, files)
    (model_dir / downloads.MANIFEST_NAME).write_text(
        json.dumps(
            {"repo": MODEL_REPO, "commit": "main", "libs": {f"libs/{folder.name}/{prebuilt.MANIFEST}": 1}}
        )
    )
    line = prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert f"{prebuilt.LIBRARY} is missing from the repo" in line
    assert cache_entries() == []
    nothing_broken_cached()


def test_cut_download_resumes(built, hub):
    """Cut in the middle once: resumed with a Range request in the same run.  Cut on every attempt:
    the first run falls back (keeping the part), the next one resumes where it stopped."""
    model, folder, _ = built
    hub.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(folder)})
    so = f"libs/{folder.name}/{prebuilt.LIBRARY}"
    size = (folder / prebuilt.LIBRARY).stat().st_size
    hub.faults.cut_after[so] = (size // 2, hub_files.MAX_ATTEMPTS)
    model_dir = downloads.download_model(MODEL_ID)
    line = prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert "compiles here on first use" in line and "breaking off" in line
    assert cache_entries() == []
    parts = list((cache.libs_dir() / prebuilt.STAGING).rglob("*.part"))
    assert len(parts) == 1 and parts[0].stat().st_size == size // 2  # kept for the resume
    hub.counters.reset()
    line = prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert "prebuilt, from HF://" in line
    ranges = [r for (_, path, r, _) in hub.counters.requests if path.endswith(prebuilt.LIBRARY)]
    assert ranges == [f"bytes={size // 2}-"]
    assert hub.counters.bytes_sent[so] == size - size // 2
    (entry,) = cache_entries()
    assert entry["origin"] == "prebuilt"
    nothing_broken_cached()


def test_a_prebuilt_library_that_fails_to_load_is_removed_and_compiled(built, hub, tmp_path):
    """Consistent manifest, right key, sha256 all matching — and still not a library: it is
    dropped from the cache and compiled here."""
    model, folder, (ref_logits, _) = built
    bad = forged(folder, tmp_path / "junk")
    junk = b"\x7fELF" + b"not a shared object" * 100
    (bad / prebuilt.LIBRARY).write_bytes(junk)
    manifest = json.loads((bad / prebuilt.MANIFEST).read_text())
    manifest["files"][prebuilt.LIBRARY] = {"size": len(junk), "sha256": hashlib.sha256(junk).hexdigest()}
    (bad / prebuilt.MANIFEST).write_text(json.dumps(manifest))
    hub.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(bad)})
    downloads.download_model(MODEL_ID)
    before = build.COMPILE_COUNT
    events = []
    engine = load_engine(MODEL_ID, device="cpu", progress=events.append)
    try:
        logits, _ = answers(engine)
    finally:
        engine.close()
    assert any("failed to load" in e.message and "removed it" in e.message for e in events)
    assert before + 1 == build.COMPILE_COUNT
    (entry,) = cache_entries()
    assert entry["origin"] == "compiled"
    np.testing.assert_array_equal(logits, ref_logits)


def test_no_prebuilt_flag_env_and_config_always_compile(built, hub, capsys, monkeypatch):
    model, folder, _ = built
    hub.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(folder)})
    assert main(["download", MODEL_ID, "--device", "cpu", "--no-prebuilt"]) == 0
    assert "prebuilt libraries are off (--no-prebuilt)" in capsys.readouterr().err
    model_dir = hub.root / "data" / "models" / MODEL_ID
    monkeypatch.setenv(prebuilt.NO_PREBUILT_ENV, "1")
    assert "LLMCHAT_NO_PREBUILT is set" in prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    monkeypatch.delenv(prebuilt.NO_PREBUILT_ENV)
    config = hub.root / "config" / prebuilt.CONFIG_FILE
    config.write_text("prebuilt_libraries = false\n")
    assert "prebuilt_libraries = false in" in prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert cache_entries() == [] and not hub.counters.gets.get(f"libs/{folder.name}/{prebuilt.MANIFEST}")
    config.write_text('prebuilt_libraries = "no"\n')
    with pytest.raises(LlmchatError, match="must be true or false") as err:
        prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")
    assert "prebuilt_libraries = false" in err.value.fix
    config.write_text("prebuilt_libraries = true\n")
    assert "prebuilt, from" in prebuilt.prepare_library(MODEL_ID, model_dir, "cpu")


def test_models_says_compiles_here_with_an_estimate(hub, capsys):
    assert main(["models", "--memory", "8"]) == 0
    out = capsys.readouterr().out
    assert "LIBRARY" in out.splitlines()[0]
    assert f"compiles here (~{prebuilt.compile_estimate_s('cpu')} s)" in out


def test_build_errors_are_clear(built, tmp_path, capsys):
    model, _, _ = built
    assert main(["build", str(model), "--device", "cpu", "--arch", "pentium4", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "not a CPU level" in err and "fix:" in err and "Traceback" not in err
    assert main(["build", "no-such-model", "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert "not installed" in capsys.readouterr().err
    vulkan = ["--device", "vulkan", "--arch", "wgsl-f99", "--out", str(tmp_path)]
    assert main(["build", str(model), *vulkan]) == 1
    assert "not a WGSL adapter profile" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_ask_with_no_prebuilt_compiles_here(built, hub, capsys):
    model, folder, _ = built
    hub.add_repo(MODEL_REPO, {**model_files(model), **bundle_files(folder)})
    downloads.download_model(MODEL_ID)
    before = build.COMPILE_COUNT
    args = ["ask", "--model", MODEL_ID, "--device", "cpu", "--temperature", "0", "--max-tokens", "2"]
    assert main([*args, "--no-prebuilt", "hello"]) == 0
    err = capsys.readouterr().err
    assert "prebuilt libraries are off (--no-prebuilt): compiling here" in err
    assert before + 1 == build.COMPILE_COUNT
    assert [e["origin"] for e in cache_entries()] == ["compiled"]
    assert not hub.counters.gets.get(f"libs/{folder.name}/{prebuilt.MANIFEST}")
