"""The tokenizer built from GGUF metadata gives llama.cpp's token ids."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from app.errors import LlmchatError
from app.inference.store.gguf_reader import read_gguf
from app.inference.store.gguf_tokenizer import build_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SMOLLM2 = FIXTURES / "smollm2"
SPM = FIXTURES / "llama_cpp_vocab"


def _gunzip(src: Path, dst_dir: Path) -> Path:
    dst = dst_dir / src.name.removesuffix(".gz")
    with gzip.open(src, "rb") as fin, dst.open("wb") as fout:
        shutil.copyfileobj(fin, fout)
    return dst


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = _gunzip(SMOLLM2 / "smollm2-vocab.gguf.gz", tmp_path_factory.mktemp("vocab"))
    return build_tokenizer(read_gguf(path, vocab_only=True).metadata)


@pytest.fixture(scope="module")
def llama_spm(tmp_path_factory):
    path = _gunzip(SPM / "ggml-vocab-llama-spm.gguf.gz", tmp_path_factory.mktemp("vocab"))
    return build_tokenizer(read_gguf(path, vocab_only=True).metadata)


CASES = json.loads((SMOLLM2 / "smollm2_tokenize.json").read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("case", CASES, ids=[repr(c["text"])[:30] for c in CASES])
def test_smollm2_ids_equal_llama_cpp(smollm2, case):
    ids = smollm2.tokenizer.encode(case["text"], add_special_tokens=False).ids
    assert ids == case["ids"]
    assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == case["text"]


@pytest.mark.parametrize(
    "text",
    ["Ünïcödé ✓ — “quotes” …", "x" * 300, "\r\n\t \u00a0", "a<|im_end|>b", "中文和English混合 123", "😀" * 5],
)
def test_smollm2_round_trips_other_strings(smollm2, text):
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
    assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < len(smollm2.tokens) for i in ids)


def test_smollm2_digits_are_single_tokens(smollm2):
    # the "smollm" pre-tokenizer splits every digit on its own (llama.cpp's first regex \p{N})
    ids = smollm2.tokenizer.encode("x 20250", add_special_tokens=False).ids
    digits = [smollm2.tokens[i] for i in ids[-5:]]
    assert digits == ["2", "0", "2", "5", "0"]


def test_smollm2_special_tokens_and_template(smollm2):
    im_start, im_end = smollm2.tokens.index("<|im_start|>"), smollm2.tokens.index("<|im_end|>")
    ids = smollm2.tokenizer.encode("<|im_start|>assistant\nok<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == im_start and ids[-1] == im_end
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == [2] and smollm2.add_bos is False
    config = smollm2.tokenizer_config(8192)
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in config["chat_template"] and config["model_max_length"] == 8192


def _spm_cases():
    inp = (SPM / "ggml-vocab-llama-spm.gguf.inp").read_text(encoding="utf-8")
    inputs = inp.split("\n__ggml_vocab_test__\n")
    outputs = (SPM / "ggml-vocab-llama-spm.gguf.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(x) for x in out.split()]) for text, out in zip(inputs, outputs, strict=False)]


def test_llama_spm_ids_equal_llama_cpp(llama_spm):
    cases = _spm_cases()
    assert len(cases) > 40
    wrong = [
        (t, llama_spm.tokenizer.encode(t, add_special_tokens=False).ids, ids)
        for t, ids in cases
        if llama_spm.tokenizer.encode(t, add_special_tokens=False).ids != ids
    ]
    assert wrong == []


def test_llama_spm_byte_fallback_special_tokens_and_bos(llama_spm):
    # a character outside the vocabulary becomes its UTF-8 bytes <0xXX>
    ids = llama_spm.tokenizer.encode("\U0001f9ff", add_special_tokens=False).ids
    pieces = [llama_spm.tokens[i] for i in ids if llama_spm.tokens[i] != "▁"]
    assert pieces == ["<0xF0>", "<0x9F>", "<0xA7>", "<0xBF>"]
    assert llama_spm.tokenizer.decode(ids) == "\U0001f9ff"
    ids = llama_spm.tokenizer.encode("<s>hi</s>", add_special_tokens=False).ids
    assert ids[0] == 1 and ids[-1] == 2
    assert llama_spm.add_bos is True and llama_spm.bos_token_id == 1 and 2 in llama_spm.eos_token_ids


def test_unknown_pre_tokenizer_and_model_are_refused():
    base = {"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(LlmchatError, match="pre-tokenizer 'nonesuch'"):
        build_tokenizer({**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "nonesuch"})
    with pytest.raises(LlmchatError, match="tokenizer type 'bert'"):
        build_tokenizer({**base, "tokenizer.ggml.model": "bert"})
