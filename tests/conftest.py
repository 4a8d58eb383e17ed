"""Shared fixtures: isolated llmchat directories and tiny random-weight MLC-format models.

* Every test runs with ``LLMCHAT_DATA_DIR`` / ``LLMCHAT_CONFIG_DIR`` in a fresh tmp dir and
  ``LLMCHAT_CACHE_DIR`` in one tmp dir per session (compiled model libraries are reused by all
  tests; a test that needs an empty cache monkeypatches it).
* ``tiny_model_dir(family, quantization, **model_config_overrides)`` builds (once per session
  and key) a model directory in MLC's format: ``mlc-chat-config.json``, ``tensor-cache.json`` +
  ``params_shard_*.bin`` with random weights, a real byte-level BPE ``tokenizer.json`` trained
  with the ``tokenizers`` library, and ``tokenizer_config.json`` with a ChatML chat template.
* ``tiny_engine``: a CPU engine on the llama ``q4f32_1`` tiny model (compiled once per session).

Two switches decide what runs:

* ``LLMCHAT_NO_SKIP=1`` (set by ``.ci/run``): a skipped test FAILS the run. A test that needs
  something of the environment (nvcc, lld and ROCm bitcode, tmux, ...) may skip on a user's machine
  with its reason, never in CI, where the run must prove that every test ran.
* ``-m gpu`` selects the GPU suite (tests/gpu, marker ``gpu``; ``make test-gpu``). Without it those
  tests are deselected, not skipped: ``make test`` on a machine without a GPU runs everything else.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: environment switch: any skip fails the run (CI)
NO_SKIP_ENV = "LLMCHAT_NO_SKIP"


def no_skip() -> bool:
    """Whether ``LLMCHAT_NO_SKIP`` is set (to anything but empty or 0)."""
    return os.environ.get(NO_SKIP_ENV, "").strip() not in ("", "0")


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return f"{longrepr[2].removeprefix('Skipped: ')} ({longrepr[0]}:{longrepr[1]})"
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under ``LLMCHAT_NO_SKIP`` a skipped test is reported as failed, with the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if no_skip() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (
            f"{NO_SKIP_ENV} is set, and this test skipped: {_skip_reason(report.longrepr)}\n"
            "CI must run every test: install what it needs (see the README's "
            "'What the tests need') or make it run without it"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The GPU suite (marker ``gpu``) runs only when asked for with ``-m gpu`` (``make test-gpu``);
    otherwise its tests are deselected: not run, and not counted as skipped."""
    if "gpu" in (config.getoption("markexpr") or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``LLMCHAT_NO_SKIP`` skips outside a test's run (a module skipped at collection) fail
    the run too."""
    if not no_skip():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.write_line(f"{NO_SKIP_ENV} is set: {len(skipped)} skipped, failing the run", red=True)


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 300

#: tiny architectures (dims are multiples of 32 so every weight format applies)
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "model_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "rms_norm_eps": 1e-5,
            "position_embedding_base": 10000.0,
            "tie_word_embeddings": False,
        },
    },
    "qwen2": {
        "model_type": "qwen2",
        "model_config": {
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "num_hidden_layers": 2,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
            "hidden_act": "silu",
        },
    },
    # Llama-2-style multi-head attention (a KV head a query head): Vulkan's decode attention runs
    # these on its key-parallel kernel (pipelines/wgsl_attention_keys.py)
    "llama-mha": {
        "model_type": "llama",
        "model_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "num_hidden_layers": 2,
            "rms_norm_eps": 1e-5,
            "position_embedding_base": 10000.0,
            "tie_word_embeddings": False,
        },
    },
    # Llama 3.1/3.2-style RoPE scaling with a tiny original window so every frequency band is hit
    "llama3": {
        "model_type": "llama",
        "model_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "rms_norm_eps": 1e-5,
            "position_embedding_base": 10000.0,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    },
}

_CORPUS = [
    "Hello! How are you today? I am fine, thank you.",
    "The quick brown fox jumps over the lazy dog.",
    "Llamas and alpacas live in the Andes; they eat grass.",
    "Compilers turn programs into machine code: TVM generates kernels for GPUs.",
    "Grüße aus München — naïve café, 東京, emoji 🙂 too.",
    "user assistant system You are a helpful assistant.",
]


@pytest.fixture(scope="session")
def _session_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("llmchat-session")
    old = {k: os.environ.get(k) for k in ("LLMCHAT_CACHE_DIR",)}
    os.environ["LLMCHAT_CACHE_DIR"] = str(root / "cache")
    yield root
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _isolated_dirs(_session_dirs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every test away from the real user's llmchat directories."""
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "llmchat-data"))
    monkeypatch.setenv("LLMCHAT_CONFIG_DIR", str(tmp_path / "llmchat-config"))
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(_session_dirs / "cache"))
    # measured speeds (llmchat bench) live in the cache dir, shared by the session: one file per test
    from app.inference.store import bench_store

    monkeypatch.setattr(bench_store, "path", lambda: tmp_path / "llmchat-cache-bench_results.json")


@pytest.fixture(autouse=True)
def _no_system_keyring() -> Iterator[None]:
    """No test reaches the user's keyring (saved servers' API keys): keyring's 'no backend' is in force
    (tests that need a keyring put one of their own in)."""
    import keyring
    from keyring.backends import fail

    previous = keyring.get_keyring()
    keyring.set_keyring(fail.Keyring())
    yield
    keyring.set_keyring(previous)


def build_tokenizer(out_dir: Path) -> int:
    """Train a small byte-level BPE, write tokenizer.json + tokenizer_config.json; its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHATML_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "add_bos_token": False,
            }
        ),
        encoding="utf-8",
    )
    return tok.get_vocab_size(with_added_tokens=True)


def write_tiny_model(
    out_dir: Path,
    family: str,
    quantization: str,
    seed: int = 0,
    context_window: int = 256,
    prefill_chunk: int = 32,
    **overrides: Any,
) -> Path:
    """A complete MLC-format model directory with random weights. Its parameter list comes from
    TVM's model exporter, or from the GPU suite's prebuilt cache where it runs from one
    (tests/gpu/prebuilt.py: the GPU machine has no TVM compiler)."""
    from app.inference.engine.random_model import random_params
    from app.inference.store.config import ModelConfig
    from app.inference.store.weights import write_tensor_cache

    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out_dir)
    base = json.loads(json.dumps(TINY_FAMILIES[family]))
    base["model_config"].update(overrides)
    base["model_config"]["vocab_size"] = vocab
    base["model_config"]["context_window_size"] = context_window
    base["model_config"]["prefill_chunk_size"] = prefill_chunk
    data = {
        "version": "0.1.0",
        **base,
        "quantization": quantization,
        "vocab_size": vocab,
        "context_window_size": context_window,
        "prefill_chunk_size": prefill_chunk,
        "sliding_window_size": -1,
        "temperature": 0.7,
        "top_p": 0.95,
        "tokenizer_files": ["tokenizer.json", "tokenizer_config.json"],
        "conv_template": {
            "name": "chatml",
            "system_template": "<|im_start|>system\n{system_message}<|im_end|>\n",
            "system_message": "",
            "roles": {"user": "<|im_start|>user", "assistant": "<|im_start|>assistant"},
            "seps": ["<|im_end|>\n"],
            "role_content_sep": "\n",
            "role_empty_sep": "\n",
            "stop_str": ["<|im_end|>"],
            "stop_token_ids": [2],
        },
    }
    (out_dir / "mlc-chat-config.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    cfg = ModelConfig.load(out_dir)
    from tests.gpu.prebuilt import parameter_specs

    specs = parameter_specs(cfg)
    write_tensor_cache(random_params(cfg, specs, seed=seed, exact=True), out_dir, shard_bytes=64 << 10)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: ``tiny_model_dir("llama", "q4f32_1", **overrides)`` -> a model directory (cached)."""
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def make(family: str = "llama", quantization: str = "q4f32_1", **overrides: Any) -> Path:
        key = json.dumps([family, quantization, overrides], sort_keys=True)
        if key not in made:
            name = f"{family}-{quantization}-{len(made)}"
            made[key] = write_tiny_model(root / name, family, quantization, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Callable[..., Path], _session_dirs: Path) -> Iterator[Any]:
    """A loaded CPU engine on the tiny llama q4f32_1 model (shared: tests reset it first)."""
    from app.inference.engine.tvm_engine import load_engine

    engine = load_engine(tiny_model_dir("llama", "q4f32_1"), device="cpu")
    yield engine
    engine.close()


#: the stand-in for MLC-LLM's package (its real wheels are only on MLC's own index)
STAND_INS = Path(__file__).resolve().parent / "stand_ins"


@pytest.fixture
def mlc_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``import mlc_llm`` gives the stand-in of ``tests/stand_ins`` for this test."""
    import importlib

    monkeypatch.syspath_prepend(str(STAND_INS))
    monkeypatch.delitem(sys.modules, "mlc_llm", raising=False)
    module = importlib.import_module("mlc_llm")
    assert module.STAND_IN
    yield module
    sys.modules.pop("mlc_llm", None)
