"""Tokenizer and StreamDecoder on real tokenizers trained here with the `tokenizers` library."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from app.errors import LlmchatError
from app.inference.engine.tokenizer import StreamDecoder, Tokenizer

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. Hello again!",
    "Привет, мир! Как дела? Всё хорошо.",
    "Numbers 1234567890 and symbols: (a + b) * c = d;",
] * 30
# Characters the corpus makes rare (split over several tokens) or never shows at all.
MULTIBYTE_TEXTS = [
    "Hello 🤖🚀 world",
    "日本語のテキスト and 中文 mixed",
    "Привет, мир! Ёжик 🦔 в тумане",
    "emoji at the end 👍🏽",
    "  two leading spaces and ünïcödé ñ",
    "🇯🇵 flags 👨‍👩‍👧 zwj",
]

# A SentencePiece BPE model (byte fallback, identity normalization, like Llama-2's) trained with the
# sentencepiece library 0.2.2 on a small corpus, zlib-compressed, base64; and the ids sentencepiece
# itself gives for some texts (SentencePieceProcessor.encode).
SPM_MODEL_B64 = (
    "eNpd2DtsHFUUxnHv2LGci5NYFkEWonBBQQFi5z0jrYB5ioIiBUgUSJDYBi/ZOOt4DQ4y0hIhhKioUEoKCsooAikCJO+6sqg2HWVE"
    "RUmJqLjnzI4j/q6+c+5j7v3drWwumwu9w72br11dsH8bjlk1i72DebVoLpml3qtPy6tmtXfcv/X+wej6ndHxvL1krpjlXveo2503"
    "ltuGy4bHhs9GwEbIRsRGzEbCRspGxkbORsFGyUbFRo2GSw+XHi49XHq49HDp4dLDpYdLD5ceLj1cerj0cOnh0sOlh0cPjx4ePTx6"
    "ePTw6OHRw6OHRw+PHh49PHp49PDo4dHDo4dPD58ePj18evj08Onh08Onh08Pnx4+PXx6+PTw6eHTw6dHQI+AHgE9AnoE9AjoEdAj"
    "oEdAj4AeAT0CegT0COgR0COgR0iPkB4hPUJ6hPQI6RHSI6RHSI+QHiE9QnqE9AjpEdIjpEdEj4geET0iekT0iOgR0SOiR0SPiB4R"
    "PSJ6RPSI6BHRI6JHTI+YHjE9YnrE9IjpEdMjpkdMj5geMT1iesT0iOkR0yOmR0KPhB4JPRJ6JPRI6JHQI6FHQo+EHgk9Enok9Ejo"
    "kdAjoUdKj5QeKT1SeqT0SOmR0iOlR0qPlB4pPVJ6pPRI6ZHSI6VHRo+MHhk9Mnpk9MjokdEjo0dGj4weGT0yemT0yOiR0SOjR06P"
    "nB45PXJ65PTI6ZHTI6dHTo+cHjk9cnrk9MjpkdMjp0dBj4IeBT0KehT0KOhR0KOgR0GPgh4FPQp6FPQo6FHQo6BHSY+SHiU9SnqU"
    "9CjpUdKjpEdJj5IeJT1KepT0KOlR0qOkR0WPih4VPSp6VPSo6FHRo6JHRY+KHhU9KnpU9KjoUdGjokdNj5oeNT1qetT0qOlR06Om"
    "R02Pmh41PWp61PSo6VHTo37qcdE4O3ekGEscDGwcn0jcuindicTdHRvfmJhnzNKf333xoUzR/m1Z+H3bv2WLSVvcsMWTthjJTtN5"
    "cWCLtaksP5QVmxq35AvdqTFmcTC4LV+bmlVzwU7Xb1+b2oOvaNUMf6BTt/QAQ93ZZpk5bmcezBtf6+js4exnW3zbFCePx7a4PzWX"
    "zLKMPL4n92hKOzZ7ZMsfp2bNXLQbnXceTM1z5sp553zhI73BthxronH/0MYzPWFfFWftZXTSH22l8560B94/bCb/pXsMhenv1uxj"
    "W/yjG9pCME/NiunI9ZY0ybYrmuT9VjUJzZqmLZue1STgG5rkfV7QdF0eQdO2TS9qknO8pKlv08ua5BG7muRogSa5QKJpaFNP0668"
    "3qncQcnLJgrgmxrV/i2dKr+ka834Lza+3cQHNr6r43dtek/TR/Lmmj61aVvTnk27mj6zadAsfig/iCae2DhqPinPdKRT92061iSm"
    "Y02f2HRP05FNXzarf7Lxqyb+Kj+jJv5m4zen66+sL94Y7mw4m7877/ww/Pz1s07n387//r143+lMnIUzpzNznOcvm5X+9s7eqD+6"
    "u76wufAf+xPb2w=="
)
SPM_EXPECTED_IDS = [
    (
        "Ёжик в тумане 🦔",
        [
            292,
            212,
            133,
            212,
            186,
            310,
            313,
            292,
            320,
            292,
            322,
            213,
            135,
            329,
            314,
            212,
            193,
            309,
            292,
            244,
            163,
            170,
            152,
        ],
    ),
    ("don't stop", [287, 318, 43, 304, 269, 304, 294, 307]),
    ("Hello world", [292, 76, 293, 272, 292, 317, 265, 295, 301]),
    (" hello world", [292, 274, 292, 317, 265, 295, 301]),
    ("hello  world\n\nnew", [274, 292, 292, 317, 265, 295, 301, 14, 14, 318, 293, 317]),
    ("привет мир!", [283, 292, 329, 310, 311, 37]),
    (
        "日本語 🤖 emoji",
        [
            292,
            234,
            155,
            169,
            234,
            160,
            176,
            236,
            174,
            162,
            292,
            244,
            163,
            168,
            154,
            292,
            293,
            298,
            294,
            324,
            303,
        ],
    ),
    ("12345 quick", [292, 53, 54, 55, 56, 57, 289]),
    ("the lazy dog jumps", [268, 263, 292, 295, 300, 319, 315, 287, 316, 291, 270, 290]),
    ("", []),
    ("x", [292, 326]),
    ("  leading", [292, 292, 292, 295, 293, 300, 301, 303, 318, 316]),
    ("trailing  ", [268, 296, 300, 303, 295, 303, 318, 316, 292, 292]),
]


def _byte_level_bpe() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _sentencepiece_byte_fallback(llama_post_processor: bool = False) -> HFTokenizer:
    """A Llama-2-style tokenizer: ▁ for spaces, BPE with byte fallback, Strip decoder."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, limit_alphabet=70, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for byte in range(256):
        name = f"<0x{byte:02X}>"
        if name not in vocab:
            vocab[name] = next_id
            next_id += 1
    tok = HFTokenizer.from_str(json.dumps(data))
    if llama_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


@pytest.fixture(scope="module", params=["byte_level_bpe", "sentencepiece_byte_fallback"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    hf = _byte_level_bpe() if request.param == "byte_level_bpe" else _sentencepiece_byte_fallback()
    return Tokenizer.from_tokenizers(
        hf, bos_id=hf.token_to_id("<s>"), eos_ids=[hf.token_to_id("</s>")], add_bos=False
    )


def _stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    return pieces


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_stream_decoder_matches_full_decode_and_never_splits_a_character(
    tokenizer: Tokenizer, text: str
) -> None:
    ids = tokenizer.encode(text)
    # the corpus does not cover these characters: at least one must be split over tokens
    split = any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    assert split, f"test text {text!r} is not split over byte tokens; the test would prove nothing"
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_stream_decoder_emits_promptly(tokenizer: Tokenizer) -> None:
    """Plain ASCII text comes out with every token (nothing held back needlessly)."""
    ids = tokenizer.encode("Hello world, the quick brown fox")
    decoder = StreamDecoder(tokenizer)
    assert all(decoder.push(i) != "" for i in ids)


def test_sentencepiece_leading_space_kept_between_tokens() -> None:
    hf = _sentencepiece_byte_fallback()
    tok = Tokenizer.from_tokenizers(hf, bos_id=hf.token_to_id("<s>"), eos_ids=[], add_bos=False)
    ids = tok.encode("Hello world again and again")
    pieces = _stream(tok, ids)
    assert "".join(pieces) == "Hello world again and again"
    # a later token that starts a word carries its space (decoding it alone would strip it)
    assert any(piece.startswith(" ") for piece in pieces[1:])


def test_stream_decoder_work_per_token_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _byte_level_bpe()
    tok = Tokenizer.from_tokenizers(hf, bos_id=None, eos_ids=[], add_bos=False)
    decoded_lengths: list[int] = []
    original = tok.decode

    def counting_decode(ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        ids = list(ids)
        decoded_lengths.append(len(ids))
        return original(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting_decode)
    ids = tok.encode("Hello world, this is a small corpus. " * 40)
    assert len(ids) > 200
    _stream(tok, ids)
    assert max(decoded_lengths) <= 8


def test_invalid_bytes_do_not_stall_the_stream() -> None:
    hf = _sentencepiece_byte_fallback()
    tok = Tokenizer.from_tokenizers(hf, bos_id=None, eos_ids=[], add_bos=False)
    lone_lead_byte = hf.token_to_id("<0xE6>")
    ids = [lone_lead_byte] * 12 + tok.encode("ok")
    pieces = _stream(tok, ids)
    assert "".join(pieces).endswith("ok")
    # the broken bytes come out as U+FFFD after a bounded wait, not at the very end
    assert "\ufffd" in "".join(pieces[:12])


def test_special_tokens_in_text_are_parsed(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert ids[-1] == tokenizer.token_to_id("<|im_end|>")
    with_specials = tokenizer.decode(ids, skip_special_tokens=False)
    assert with_specials.startswith("<|im_start|>")
    assert with_specials.endswith("user\nhi<|im_end|>")
    # (SentencePiece-style normalizers put a ▁ after a special token, as Llama's legacy mode does)
    assert tokenizer.decode(ids).strip() == "user\nhi"
    # the same text not written as specials is ordinary tokens
    assert tokenizer.token_to_id("<|im_start|>") not in tokenizer.encode("<|im_start")


def test_bos_only_when_asked() -> None:
    hf = _sentencepiece_byte_fallback(llama_post_processor=True)
    bos = hf.token_to_id("<s>")
    with_bos = Tokenizer.from_tokenizers(hf, bos_id=bos, eos_ids=[2], add_bos=True)
    without = Tokenizer.from_tokenizers(hf, bos_id=bos, eos_ids=[2], add_bos=False)
    assert with_bos.encode("Hello")[0] == bos
    assert with_bos.encode("Hello").count(bos) == 1
    assert bos not in without.encode("Hello")
    assert with_bos.encode("Hello", add_bos=False) == without.encode("Hello")
    # a chat template that writes the BOS itself gets exactly one
    assert with_bos.encode("<s>Hello", add_bos=False).count(bos) == 1


def test_from_model_dir_reads_specials_from_tokenizer_config(tmp_path: Path) -> None:
    hf = _byte_level_bpe()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "special": True},
                "eos_token": "<|im_end|>",
                "add_bos_token": True,
                "chat_template": "unused here",
            }
        )
    )
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.bos_id == hf.token_to_id("<s>")
    assert tok.eos_ids == {hf.token_to_id("<|im_end|>")}
    assert tok.add_bos
    assert tok.encode("Hello")[0] == tok.bos_id
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)


def test_from_model_dir_mlc_and_generation_config(tmp_path: Path) -> None:
    """add_bos from the post-processor; stop ids from generation_config and MLC's conv_template."""
    hf = _sentencepiece_byte_fallback(llama_post_processor=True)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    (tmp_path / "mlc-chat-config.json").write_text(
        json.dumps({"eos_token_id": 77, "conv_template": {"stop_token_ids": [3]}})
    )
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.add_bos  # the TemplateProcessing post-processor puts <s> first
    assert tok.eos_ids == {hf.token_to_id("</s>"), 2, 4, 3}
    assert tok.encode("Hello").count(tok.bos_id) == 1


def test_from_model_dir_without_config_files(tmp_path: Path) -> None:
    hf = _byte_level_bpe()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "mlc-chat-config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 4]}))
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.bos_id == 1
    assert tok.eos_ids == {2, 4}
    assert not tok.add_bos


def test_missing_tokenizer_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(LlmchatError, match=r"no tokenizer\.json") as err:
        Tokenizer.from_model_dir(tmp_path)
    assert err.value.fix


def _spm_model_bytes() -> bytes:
    return zlib.decompress(base64.b64decode(SPM_MODEL_B64))


def test_sentencepiece_model_file_matches_sentencepiece(tmp_path: Path) -> None:
    """A directory with only tokenizer.model (older MLC dirs) tokenizes exactly as sentencepiece does."""
    (tmp_path / "tokenizer.model").write_bytes(_spm_model_bytes())
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.bos_id == 1 and tok.eos_ids == {2} and tok.add_bos
    for text, expected in SPM_EXPECTED_IDS:
        ids = tok.encode(text, add_bos=False)
        assert ids == expected, text
        assert tok.decode(ids) == text
        assert "".join(_stream(tok, ids)) == text
    assert tok.encode("x") == [1, *dict(SPM_EXPECTED_IDS)["x"]]


def test_sentencepiece_unigram_and_corrupt_models_are_clear_errors(tmp_path: Path) -> None:
    # protobuf merges a repeated message field: a second trainer_spec with model_type=1 (UNIGRAM)
    (tmp_path / "tokenizer.model").write_bytes(_spm_model_bytes() + bytes([0x12, 0x02, 0x18, 0x01]))
    with pytest.raises(LlmchatError, match="unigram") as err:
        Tokenizer.from_model_dir(tmp_path)
    assert "tokenizer.json" in err.value.fix
    (tmp_path / "tokenizer.model").write_bytes(_spm_model_bytes()[:1000])
    with pytest.raises(LlmchatError, match=r"cannot read the SentencePiece model .*tokenizer\.model"):
        Tokenizer.from_model_dir(tmp_path)


def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(LlmchatError, match=r"tokenizer\.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_special_token_mid_stream_is_skipped_like_decode(tokenizer: Tokenizer) -> None:
    ids = [*tokenizer.encode("Hello world"), tokenizer.token_to_id("<|im_end|>"), *tokenizer.encode(" again")]
    assert "".join(_stream(tokenizer, ids)) == tokenizer.decode(ids)
    assert tokenizer.token_to_id("<|im_end|>") in tokenizer.special_ids
