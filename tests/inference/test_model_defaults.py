"""Sampling defaults from the model (catalog entry, generation_config.json, mlc-chat-config.json), the
repetition guard where the model sets no penalty, and the penalty window (repeat_last_n)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.errors import LlmchatError
from app.inference.api import SamplingParams
from app.inference.engine.model_defaults import REPETITION_GUARD, effective_params, model_sampling
from app.inference.engine.sampling import Sampler, parse_set_command
from app.inference.store.catalog import parse_registry


def _model(tmp_path, mlc: dict | None = None, generation: dict | None = None):
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    (folder / "mlc-chat-config.json").write_text(json.dumps(mlc or {}))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_default_model_takes_its_catalog_settings_and_the_repetition_guard():
    defaults = model_sampling(None, "smollm2-135m-instruct")
    assert defaults.params.temperature == 0.2 and defaults.params.top_p == 0.9
    assert defaults.params.repetition_penalty == REPETITION_GUARD["repetition_penalty"] == 1.1
    assert defaults.params.repeat_last_n == 64
    assert defaults.describe("temperature") == "catalog entry"
    assert "repetition guard" in defaults.describe("repetition_penalty")
    assert defaults.describe("max_tokens") == "llmchat default"


def test_generation_config_comes_before_mlc_config_and_an_mlc_penalty_of_1_is_unset(tmp_path):
    folder = _model(
        tmp_path,
        mlc={"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0},
        generation={"temperature": 0.6, "top_p": 0.9, "bos_token_id": 1},
    )
    defaults = model_sampling(folder, "not-in-the-catalog")
    assert (defaults.params.temperature, defaults.params.top_p) == (0.6, 0.9)
    assert defaults.describe("top_p") == "generation_config.json"
    assert defaults.params.repetition_penalty == 1.1  # MLC's 1.0 means "the model says nothing"


def test_a_penalty_the_model_sets_is_kept_without_the_guard(tmp_path):
    folder = _model(tmp_path, mlc={"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05})
    defaults = model_sampling(folder)
    assert defaults.params.repetition_penalty == 1.05
    assert defaults.describe("repetition_penalty") == "mlc-chat-config.json"
    # a penalty of 1 set in Hugging Face's config is the model's choice: no guard
    off = model_sampling(_model(tmp_path / "b", generation={"repetition_penalty": 1.0, "do_sample": False}))
    assert off.params.repetition_penalty == 1.0 and off.params.temperature == 0.0


def test_out_of_range_values_in_model_files_are_ignored(tmp_path):
    folder = _model(tmp_path, generation={"temperature": 7, "top_p": "high"})
    params = model_sampling(folder).params
    assert params.temperature == SamplingParams().temperature and params.top_p == SamplingParams().top_p


def test_the_users_settings_win_over_the_models(tmp_path):
    defaults = model_sampling(None, "smollm2-135m-instruct").params
    params = effective_params(defaults, parse_set_command("temperature=0.9; repetition_penalty=1"))
    assert params.temperature == 0.9 and params.repetition_penalty == 1.0 and params.top_p == 0.9


def test_catalog_sampling_table_is_validated():
    entry = """
[[model]]
id = "m"
name = "M"
source = { hf = "o/r" }
format = "mlc"
architecture = "llama"
quantization = "q4f16_1"
parameters = 1
download_bytes = 1
context_window = 2048
license = "x"
gated = false
num_layers = 1
num_kv_heads = 1
head_dim = 64
vocab_size = 10
"""
    ok = parse_registry(entry + "sampling = { temperature = 0.3, repeat_last_n = 32 }\n", "t.toml", "user")
    assert ok[0].sampling == {"temperature": 0.3, "repeat_last_n": 32}
    with pytest.raises(LlmchatError, match=r"sampling\.top_k"):
        parse_registry(entry + "sampling = { top_k = 40 }\n", "t.toml", "user")
    with pytest.raises(LlmchatError, match="temperature"):
        parse_registry(entry + "sampling = { temperature = 5.0 }\n", "t.toml", "user")


def test_penalties_count_only_the_last_n_tokens():
    logits = np.array([3.0, 2.9, 2.8, 0.0], dtype=np.float32)
    windowed = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0, repeat_last_n=2))
    # token 0 was generated 3 steps ago: out of the window, so it is not penalized and wins
    assert windowed.sample(logits, [0, 1, 2]) == 0
    whole = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0, repeat_last_n=0))
    whole.sample(logits, [0, 1, 2])
    assert whole.apply_penalties(logits)[0] == pytest.approx(1.5)
    assert windowed.apply_penalties(logits)[0] == pytest.approx(3.0)
    assert windowed.apply_penalties(logits)[1] == pytest.approx(1.45)


def test_set_rejects_a_word_as_not_a_number():
    with pytest.raises(LlmchatError, match="is not a number") as err:
        parse_set_command("temperature=warm")
    assert "out of range" not in err.value.problem
    with pytest.raises(LlmchatError, match="is not a whole number"):
        parse_set_command("repeat_last_n=1.5")
    # nan parses as a float but is not a number; a value of the wrong type (a saved setting) neither
    for text in ("temperature=nan", "top_p=inf"):
        with pytest.raises(LlmchatError, match="is not a number") as err:
            parse_set_command(text)
        assert "out of range" not in err.value.problem
    from app.inference.engine.sampling import validate_value

    for key, value, kind in (
        ("temperature", "0.5", "number"),
        ("seed", 1.5, "whole number"),
        ("max_tokens", True, "whole number"),
        ("top_p", None, "number"),
    ):
        with pytest.raises(LlmchatError, match=f"is not a {kind}:"):
            validate_value(key, value)
    with pytest.raises(LlmchatError, match="out of range"):  # a number, but outside its range
        validate_value("temperature", 9)
