"""Build a Hugging Face ``tokenizers`` tokenizer from a GGUF file's ``tokenizer.*`` metadata.

Two vocabulary kinds, as llama.cpp reads them (``src/llama-vocab.cpp``):

* ``gpt2``: byte-level BPE (tokens + merges).  llama.cpp splits text with a list of regexes chosen
  by ``tokenizer.ggml.pre``; each regex splits every piece of the previous one, keeping matches
  and the text between them — a ``Sequence`` of ``Split(..., "isolated")`` pre-tokenizers.
* ``llama``: SentencePiece-style BPE over scores with byte fallback; a space is prepended to every
  text fragment (``add_space_prefix``) and spaces become "▁".  As in Hugging Face's own
  ``LlamaConverter`` the merges are derived from the vocabulary, ranked by the merged piece's score.

Tokens typed CONTROL or UNKNOWN become special added tokens, USER_DEFINED ones plain added tokens
(both are matched in the text before the model runs, as llama.cpp does with ``parse_special``).
BOS is not added by a post-processor: ``tokenizer_config.json``'s ``add_bos_token`` says whether the
caller prepends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.errors import LlmchatError

# llama.cpp's regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), keyed by its pre-tokenizer type.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_REGEXES: dict[str, list[str]] = {
    "llama3": [
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "qwen2": [
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
    "starcoder": [r"\p{N}", _GPT2],  # also smollm, refact, command-r, codeshell, exaone, minerva
    "gpt2": [_GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "gpt4o": [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ],
}

#: tokenizer.ggml.pre -> (regex set, ignore_merges) as llama.cpp's llama_vocab::load decides
PRE_TOKENIZERS: dict[str, tuple[str, bool]] = {
    "default": ("gpt2", False),
    "llama3": ("llama3", True),
    "llama-v3": ("llama3", True),
    "llama-bpe": ("llama3", True),
    "falcon3": ("llama3", True),
    "pixtral": ("llama3", True),
    "dbrx": ("llama3", False),
    "smaug-bpe": ("llama3", False),
    "chatglm-bpe": ("llama3", False),
    "glm4": ("llama3", False),
    "qwen2": ("qwen2", False),
    "deepseek-r1-qwen": ("qwen2", False),
    "stablelm2": ("qwen2", False),
    "megrez": ("qwen2", False),
    "smollm": ("starcoder", False),
    "starcoder": ("starcoder", False),
    "refact": ("starcoder", False),
    "command-r": ("starcoder", False),
    "codeshell": ("starcoder", False),
    "exaone": ("starcoder", False),
    "minerva-7b": ("starcoder", False),
    "gpt-2": ("gpt2", False),
    "phi-2": ("gpt2", False),
    "mpt": ("gpt2", False),
    "olmo": ("gpt2", False),
    "jais": ("gpt2", False),
    "falcon": ("falcon", False),
    "deepseek-coder": ("deepseek-coder", False),
    "gpt-4o": ("gpt4o", False),
    "llama4": ("gpt4o", False),
}

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GGUFTokenizer:
    """What ``build_tokenizer`` makes: the tokenizer and what tokenizer_config.json needs."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos: bool
    chat_template: str | None
    clean_up_spaces: bool
    tokens: list[str] = field(repr=False, default_factory=list)

    def token(self, token_id: int | None) -> str | None:
        """The text of a token id (None for None)."""
        return None if token_id is None else self.tokens[token_id]

    def tokenizer_config(self, context_window: int | None = None) -> dict[str, Any]:
        """``tokenizer_config.json`` as Hugging Face writes it (special tokens as strings)."""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.token(self.bos_token_id),
            "eos_token": self.token(eos),
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": self.clean_up_spaces,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        if context_window:
            config["model_max_length"] = context_window
        return config


def _id(meta: dict[str, Any], key: str, n_tokens: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_tokens else None


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) split of a vocabulary piece into two pieces, best merged score first."""
    index = {}
    for i, t in enumerate(tokens):
        if types[i] in (NORMAL, USER_DEFINED, UNUSED):
            index[t] = i
    found: list[tuple[float, int, int, tuple[str, str]]] = []
    for piece, pid in index.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            lid, rid = index.get(left), index.get(right)
            if lid is not None and rid is not None:
                found.append((-scores[pid], lid, rid, (left, right)))
    found.sort()
    return [m for *_, m in found]


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[Any], list[Any]]:
    from tokenizers import AddedToken

    special, user = [], []
    for i, t in enumerate(tokens):
        if types[i] in (CONTROL, UNKNOWN):
            special.append(AddedToken(t, special=True, normalized=False))
        elif types[i] == USER_DEFINED:
            user.append(AddedToken(t, special=False, normalized=False))
    return special, user


def _bpe(meta: dict[str, Any], tokens: list[str], types: list[int]) -> tuple[Any, bool]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    if pre not in PRE_TOKENIZERS:
        raise LlmchatError(
            f"The GGUF's pre-tokenizer {pre!r} is not known to llmchat.",
            f"use a GGUF whose tokenizer.ggml.pre is one of: {', '.join(sorted(PRE_TOKENIZERS))}",
        )
    regex_set, ignore_merges = PRE_TOKENIZERS[pre]
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise LlmchatError(
            "The GGUF's BPE tokenizer has no merges (tokenizer.ggml.merges).",
            "use a GGUF converted by a recent llama.cpp",
        )
    merges = []
    for m in merges_raw:
        left, sep, right = str(m).partition(" ")
        if sep:
            merges.append((left, right))
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
    tok = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _REGEXES[regex_set]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    clean_spaces = pre not in {
        "deepseek-coder",
        "qwen2",
        "deepseek-r1-qwen",
        "smollm",
        "command-r",
        "gpt-4o",
        "llama4",
    }
    return tok, clean_spaces


def _spm(meta: dict[str, Any], tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        scores = [0.0] * len(tokens)
    scores = [float(s) for s in scores]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = _id(meta, "tokenizer.ggml.unknown_token_id", len(tokens))
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    norm = [normalizers.Replace(" ", "▁")]
    if bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def build_tokenizer(meta: dict[str, Any]) -> GGUFTokenizer:
    """The tokenizer described by a GGUF's metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``)."""
    kind = str(meta.get("tokenizer.ggml.model") or "")
    tokens = [str(t) for t in (meta.get("tokenizer.ggml.tokens") or [])]
    if not tokens:
        raise LlmchatError(
            "The GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens).",
            "use a GGUF that embeds its tokenizer (any file converted by llama.cpp does)",
        )
    types = [int(t) for t in (meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))]
    if len(types) != len(tokens):
        types = [NORMAL] * len(tokens)
    if kind == "gpt2":
        tok, clean_spaces = _bpe(meta, tokens, types)
        add_bos_default = PRE_TOKENIZERS.get(str(meta.get("tokenizer.ggml.pre")), ("", False))[1]
    elif kind == "llama":
        tok, clean_spaces = _spm(meta, tokens, types), False
        add_bos_default = True
    else:
        raise LlmchatError(
            f"The GGUF's tokenizer type {kind or 'unknown'!r} is not supported.",
            "use a GGUF with a 'gpt2' (byte-level BPE) or 'llama' (SentencePiece) tokenizer",
        )
    special, user = _added_tokens(tokens, types)
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    n = len(tokens)
    bos = _id(meta, "tokenizer.ggml.bos_token_id", n)
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _id(meta, key, n)
        if value is not None and value not in eos_ids:
            eos_ids.append(value)
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(add_bos) if add_bos is not None else add_bos_default
    template = meta.get("tokenizer.chat_template")
    return GGUFTokenizer(
        tokenizer=tok,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        add_bos=add_bos and bos is not None,
        chat_template=str(template) if template else None,
        clean_up_spaces=clean_spaces,
        tokens=tokens,
    )
