"""Text <-> token ids with the `tokenizers` library, and streaming decode of whole characters."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from app.errors import LlmchatError

# How many held-back tokens StreamDecoder waits for a character to complete before it gives
# up and emits the replacement character (UTF-8 needs at most 4 bytes; a broken model may
# emit bytes that never form a character).
_MAX_HELD_TOKENS = 8


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LlmchatError(
            f"cannot read {path}: {err}",
            "download the model again (the file is damaged or incomplete)",
        ) from None
    if not isinstance(data, dict):
        raise LlmchatError(f"{path} is not a JSON object.", "download the model again")
    return data


def token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """A model's tokenizer: encode text (special tokens in the text are parsed), decode ids."""

    def __init__(self, tok: HFTokenizer, bos_id: int | None, eos_ids: Iterable[int], add_bos: bool) -> None:
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids: set[int] = set(eos_ids)
        self.add_bos = bool(add_bos and bos_id is not None)
        self.special_ids: frozenset[int] = frozenset(
            token_id for token_id, added in tok.get_added_tokens_decoder().items() if added.special
        )

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_tokenizers(
        cls, tok: HFTokenizer, bos_id: int | None, eos_ids: Iterable[int], add_bos: bool
    ) -> Tokenizer:
        """Wrap a `tokenizers.Tokenizer` built elsewhere (tests, GGUF import)."""
        return cls(tok, bos_id, eos_ids, add_bos)

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` with ``tokenizer_config.json`` / ``mlc-chat-config.json`` beside it.

        bos/eos: ``bos_token``/``eos_token`` of tokenizer_config.json, ``eos_token_id`` of
        generation_config.json, ``conv_template.stop_token_ids`` of mlc-chat-config.json (the
        ids MLC stops on); mlc-chat-config's ``bos_token_id``/``eos_token_id`` only when none of
        those name one. add_bos: tokenizer_config's ``add_bos_token``, else whether the
        tokenizer's own post-processor puts BOS first.
        """
        model_dir = Path(path)
        tokenizer_json = model_dir / "tokenizer.json"
        spm_model = model_dir / "tokenizer.model"
        spm: SentencePieceModel | None = None
        if tokenizer_json.is_file():
            try:
                tok = HFTokenizer.from_file(str(tokenizer_json))
            except Exception as err:  # the library raises plain Exception for bad files
                raise LlmchatError(
                    f"cannot load {tokenizer_json}: {err}",
                    "download the model again (the tokenizer file is damaged or from a newer format)",
                ) from None
        elif spm_model.is_file():
            spm = SentencePieceModel.read(spm_model)
            tok = spm.to_tokenizers()
        else:
            raise LlmchatError(
                f"{model_dir} has no tokenizer.json (nor a SentencePiece tokenizer.model).",
                "download the model again; a model directory needs tokenizer.json",
            )

        config = (
            _read_json(model_dir / "tokenizer_config.json")
            if (model_dir / "tokenizer_config.json").is_file()
            else {}
        )
        mlc = (
            _read_json(model_dir / "mlc-chat-config.json")
            if (model_dir / "mlc-chat-config.json").is_file()
            else {}
        )
        generation = (
            _read_json(model_dir / "generation_config.json")
            if (model_dir / "generation_config.json").is_file()
            else {}
        )

        _add_missing_special_tokens(tok, config)

        def lookup(value: Any) -> int | None:
            content = token_content(value)
            return tok.token_to_id(content) if content is not None else None

        bos_id = lookup(config.get("bos_token"))
        if bos_id is None and spm is not None and "bos_token" not in config:
            bos_id = spm.bos_id
        if bos_id is None and "bos_token" not in config:
            bos_ids = _id_list(mlc.get("bos_token_id")) or _id_list(generation.get("bos_token_id"))
            bos_id = bos_ids[0] if bos_ids else None

        eos_ids: set[int] = set()
        eos = lookup(config.get("eos_token"))
        if eos is not None:
            eos_ids.add(eos)
        eos_ids.update(_id_list(generation.get("eos_token_id")))
        if not eos_ids and spm is not None and spm.eos_id is not None:
            eos_ids.add(spm.eos_id)
        conv = mlc.get("conv_template")
        if isinstance(conv, dict):
            eos_ids.update(_id_list(conv.get("stop_token_ids")))
        if not eos_ids:
            eos_ids.update(_id_list(mlc.get("eos_token_id")))

        if isinstance(config.get("add_bos_token"), bool):
            add_bos = config["add_bos_token"]
        elif spm is not None:
            add_bos = True  # Hugging Face's LlamaTokenizer default for SentencePiece models
        else:
            add_bos = _post_processor_adds_bos(tok, bos_id)
        vocab_limit = tok.get_vocab_size(with_added_tokens=True)
        eos_ids = {i for i in eos_ids if 0 <= i < max(vocab_limit, 1)}
        return cls(tok, bos_id, eos_ids, add_bos)

    # -- use -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in it become their ids.

        BOS is prepended only when ``add_bos`` (default: ``self.add_bos``) — the tokenizer's
        own post-processor is never run, so a chat template that writes ``{{ bos_token }}``
        itself gets exactly one BOS when encoded with ``add_bos=False``.
        """
        ids = self.tok.encode(text, add_special_tokens=False).ids
        use_bos = self.add_bos if add_bos is None else add_bos
        if use_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return list(ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _add_missing_special_tokens(tok: HFTokenizer, config: dict[str, Any]) -> None:
    """Special tokens tokenizer_config.json declares but tokenizer.json lacks (rare)."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        return
    for _id, entry in sorted(decoder.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        content = token_content(entry)
        if content is None or not (isinstance(entry, dict) and entry.get("special")):
            continue
        if tok.token_to_id(content) is None:
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])


def _post_processor_adds_bos(tok: HFTokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    with_specials = tok.encode("a", add_special_tokens=True).ids
    without = tok.encode("a", add_special_tokens=False).ids
    return len(with_specials) > len(without) and with_specials[0] == bos_id


# -- SentencePiece tokenizer.model ---------------------------------------------------------------
# The protobuf schema (sentencepiece_model.proto): ModelProto { repeated SentencePiece pieces = 1
# {string piece = 1; float score = 2; Type type = 3}; TrainerSpec trainer_spec = 2 {model_type = 3,
# byte_fallback = 35, unk_id = 40, bos_id = 41, eos_id = 42}; NormalizerSpec normalizer_spec = 3
# {add_dummy_prefix = 3} }. Piece types: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5,
# BYTE 6 (the same numbers as GGUF's token types).
_SPM_BPE = 2


def _protobuf_fields(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message; LEN values stay bytes."""
    pos, end = 0, len(data)

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            if pos >= end:
                raise ValueError("truncated varint")
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    while pos < end:
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 1:
            yield number, wire, data[pos : pos + 8]
            pos += 8
        elif wire == 2:
            length = varint()
            if pos + length > end:
                raise ValueError("truncated field")
            yield number, wire, data[pos : pos + length]
            pos += length
        elif wire == 5:
            yield number, wire, data[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if pos != end:
        raise ValueError("truncated message")


def _int32(value: int) -> int:
    """A protobuf int32 written as a (possibly 10-byte, two's complement) varint."""
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass
class SentencePieceModel:
    """The parts of a SentencePiece ``tokenizer.model`` a BPE tokenizer needs."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int
    byte_fallback: bool
    add_dummy_prefix: bool
    unk_id: int | None
    bos_id: int | None
    eos_id: int | None

    @classmethod
    def read(cls, path: Path) -> SentencePieceModel:
        try:
            return cls.parse(path.read_bytes())
        except (OSError, ValueError, UnicodeDecodeError, struct.error) as err:
            raise LlmchatError(
                f"cannot read the SentencePiece model {path}: {err}",
                "download the model again (the file is damaged or incomplete)",
            ) from None

    @classmethod
    def parse(cls, data: bytes) -> SentencePieceModel:
        pieces: list[str] = []
        scores: list[float] = []
        types: list[int] = []
        trainer: dict[int, int] = {}
        normalizer: dict[int, int] = {}
        for number, wire, value in _protobuf_fields(data):
            if number == 1 and wire == 2:
                piece, score, kind = "", 0.0, 1
                for f_number, f_wire, f_value in _protobuf_fields(value):
                    if f_number == 1 and f_wire == 2:
                        piece = f_value.decode("utf-8")
                    elif f_number == 2 and f_wire == 5:
                        score = struct.unpack("<f", f_value)[0]
                    elif f_number == 3 and f_wire == 0:
                        kind = f_value
                pieces.append(piece)
                scores.append(score)
                types.append(kind)
            elif number in (2, 3) and wire == 2:
                target = trainer if number == 2 else normalizer
                for f_number, f_wire, f_value in _protobuf_fields(value):
                    if f_wire == 0:
                        target[f_number] = f_value
        if not pieces:
            raise ValueError("no pieces (not a SentencePiece model)")

        def special(number: int, default: int) -> int | None:
            value = _int32(trainer.get(number, default))
            return value if 0 <= value < len(pieces) else None

        return cls(
            pieces=pieces,
            scores=scores,
            types=types,
            model_type=trainer.get(3, 1),
            byte_fallback=bool(trainer.get(35, 0)),
            add_dummy_prefix=bool(normalizer.get(3, 1)),
            unk_id=special(40, 0),
            bos_id=special(41, 1),
            eos_id=special(42, 2),
        )

    def to_tokenizers(self) -> HFTokenizer:
        """A `tokenizers` BPE with byte fallback, built as llama.cpp and HF's LlamaConverter do."""
        if self.model_type != _SPM_BPE:
            raise LlmchatError(
                "the model's tokenizer.model is a SentencePiece unigram model, which llmchat can only "
                "load as tokenizer.json.",
                "download the original model's tokenizer.json into the model directory",
            )
        from app.inference.store.gguf_tokenizer import build_tokenizer

        meta: dict[str, Any] = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": self.pieces,
            "tokenizer.ggml.scores": self.scores,
            "tokenizer.ggml.token_type": self.types,
            "tokenizer.ggml.add_space_prefix": self.add_dummy_prefix,
        }
        for key, value in (
            ("tokenizer.ggml.unknown_token_id", self.unk_id),
            ("tokenizer.ggml.bos_token_id", self.bos_id),
            ("tokenizer.ggml.eos_token_id", self.eos_id),
        ):
            if value is not None:
                meta[key] = value
        return build_tokenizer(meta).tokenizer


class StreamDecoder:
    """Turns generated token ids into text one token at a time, whole characters only.

    Byte-level BPE and SentencePiece byte-fallback tokens can split a UTF-8 character, and
    SentencePiece decoders strip the leading space of the first token. Like Hugging Face's
    incremental detokenization it decodes a short window: the tokens already shown last
    step (the prefix) plus the new ones, and emits the difference between the two decodes —
    unless that ends in an incomplete character (U+FFFD), in which case it waits for the
    next token. Each step decodes a few tokens, never the whole reply.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []  # the window: tokens from the prefix start on
        self._prefix_len = 0  # tokens of the window already shown (context for the decoder)
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly empty)."""
        token_id = int(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""  # skipped as decode() skips it (keeping it would shift SentencePiece spaces)
        self._ids.append(token_id)
        text = self._decode(self._ids)
        held = len(self._ids) - self._prefix_len
        if text.endswith("\ufffd") and held < _MAX_HELD_TOKENS:
            return ""
        # (if the decoder changed the prefix's text, which no common decoder does, what lies past
        # its length is still the new part)
        new = text[len(self._prefix_text) :]
        # the tokens just shown become the next prefix
        self._ids = self._ids[self._prefix_len :]
        self._prefix_len = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        if len(self._ids) == self._prefix_len:
            return ""
        text = self._decode(self._ids)
        new = text[len(self._prefix_text) :]
        self.reset()
        return new

    def reset(self) -> None:
        """Start a new reply."""
        self._ids = []
        self._prefix_len = 0
        self._prefix_text = ""
