"""Picking the next token from logits: greedy, temperature, top-p, penalties, seed.

Also the validation of sampling settings, shared by the CLI flags and the TUI's ``/set``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np

from app.errors import LlmchatError
from app.inference.api import SamplingParams

# Top-p ranks only the tokens whose weight (probability / max probability) is at least one of
# these cutoffs, as long as there are at most _TOP_P_MAX_CANDIDATES of them; otherwise it sorts
# the whole vocabulary.
_TOP_P_CUTOFFS = (math.exp(-9.0), math.exp(-18.0))
_TOP_P_MAX_CANDIDATES = 8192

# key -> the allowed range, in words (error messages and /help)
ALLOWED_RANGES: dict[str, str] = {
    "temperature": "a number from 0 to 2 (0 = greedy)",
    "top_p": "a number greater than 0 and at most 1",
    "max_tokens": "a whole number of at least 1",
    "seed": "a whole number of at least 0, or 'none'",
    "repetition_penalty": "a number greater than 0 (typically 1 to 2; 1 = off)",
    "repeat_last_n": "a whole number of at least 0 (0 = the whole reply)",
    "presence_penalty": "a number from -2 to 2",
    "frequency_penalty": "a number from -2 to 2",
    "stop": "a list of non-empty strings (in /set: separated by commas)",
}


def _range_error(key: str, value: object) -> LlmchatError:
    return LlmchatError(
        f"{key}={value!r} is out of range: {key} must be {ALLOWED_RANGES[key]}.",
        f"use {key}=<{ALLOWED_RANGES[key]}>",
    )


def _type_error(key: str, value: object, whole: bool) -> LlmchatError:
    """A value that is not a (whole, finite) number at all: saying "out of range" would mislead."""
    kind = "whole number" if whole else "number"
    return LlmchatError(
        f"{key}={value!r} is not a {kind}: {key} must be {ALLOWED_RANGES[key]}.",
        f"use {key}=<{ALLOWED_RANGES[key]}>",
    )


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate_value(key: str, value: Any) -> Any:
    """Check one sampling setting; returns it (ints widened to float where a float is meant)."""
    if key not in ALLOWED_RANGES:
        raise LlmchatError(
            f"unknown sampling setting {key!r}.",
            "use one of: " + ", ".join(ALLOWED_RANGES),
        )
    if key == "stop":
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise _range_error(key, value)
        if not all(isinstance(s, str) and s for s in value):
            raise _range_error(key, value)
        return list(value)
    if key in ("seed", "max_tokens", "repeat_last_n"):
        if key == "seed" and value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(key, value, whole=True)
        if value < (key == "max_tokens"):
            raise _range_error(key, value)
        return value
    if not _is_number(value):
        raise _type_error(key, value, whole=False)
    number = float(value)
    ok = {
        "temperature": 0.0 <= number <= 2.0,
        "top_p": 0.0 < number <= 1.0,
        "repetition_penalty": number > 0.0,
        "presence_penalty": -2.0 <= number <= 2.0,
        "frequency_penalty": -2.0 <= number <= 2.0,
    }[key]
    if not ok:
        raise _range_error(key, value)
    return number


def validate(params: SamplingParams) -> SamplingParams:
    """Raise LlmchatError naming the first setting out of range; returns ``params``."""
    for f in fields(SamplingParams):
        validate_value(f.name, getattr(params, f.name))
    return params


def _parse_value(key: str, text: str) -> Any:
    text = text.strip()
    if key == "stop":
        return [part for part in text.split(",") if part != ""]
    if key == "seed" and text.lower() in ("none", "null", ""):
        return None
    whole = key in ("max_tokens", "seed", "repeat_last_n")
    try:
        return int(text) if whole else float(text)
    except ValueError:
        raise LlmchatError(
            f"{key}={text!r} is not a {'whole number' if whole else 'number'}: {key} must be "
            f"{ALLOWED_RANGES[key]}.",
            f"use {key}=<{ALLOWED_RANGES[key]}>",
        ) from None


def parse_set_command(text: str) -> dict[str, Any]:
    """Parse ``/set`` overrides: ``"temperature=0.5; top_p=0.9; stop=###,END"`` -> validated dict.

    Pairs are separated by ``;`` (as in MLC's ``/set``), stop strings by ``,``. Raises
    LlmchatError naming the key and its allowed range.
    """
    result: dict[str, Any] = {}
    for pair in text.split(";"):
        if not pair.strip():
            continue
        if "=" not in pair:
            raise LlmchatError(
                f"{pair.strip()!r} is not a key=value setting.",
                "write /set key=value;key=value, for example /set temperature=0.5;top_p=0.9",
            )
        key, _, raw = pair.partition("=")
        key = key.strip()
        if key not in ALLOWED_RANGES:
            validate_value(key, None)  # raises the unknown-setting error
        result[key] = validate_value(key, _parse_value(key, raw))
    return result


def apply_overrides(params: SamplingParams, overrides: dict[str, Any]) -> SamplingParams:
    """A copy of ``params`` with validated overrides (from ``parse_set_command``) applied."""
    return validate(replace(params, **overrides))


class Sampler:
    """Samples one token per call from float32 logits, for one sequence.

    Penalties count the token ids the caller says were generated so far, the last
    ``params.repeat_last_n`` of them (0: all). ``sample`` takes
    them as ``previous_ids``, treated as an append-only history: only the ids past the
    length seen on the last call are counted (O(new ids) per step), so pass the same
    growing list each step. A shorter list than last time starts the counts over.
    Callers that do not keep a list can call ``observe(token_id)`` after each step and
    pass ``previous_ids=None``. ``reset()`` forgets the history.

    Order of operations (as MLC and Hugging Face): repetition penalty, then presence and
    frequency penalties, then temperature, then top-p, then a draw with the seeded
    generator. Temperature 0 is greedy (argmax after the penalties).
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = validate(params)
        self.rng = np.random.default_rng(params.seed)
        self._counts: dict[int, int] = {}
        self._window: deque[int] = deque()  # the counted ids, oldest first
        self._history_len = 0

    # -- penalty bookkeeping -------------------------------------------------------------
    def observe(self, token_id: int) -> None:
        """Count one generated token for the penalties (the oldest leaves past repeat_last_n)."""
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        self._window.append(token_id)
        self._history_len += 1
        last_n = self.params.repeat_last_n
        if last_n and len(self._window) > last_n:
            old = self._window.popleft()
            left = self._counts[old] - 1
            if left:
                self._counts[old] = left
            else:
                del self._counts[old]

    def reset(self) -> None:
        """Forget the generated tokens (a new sequence)."""
        self._counts.clear()
        self._window.clear()
        self._history_len = 0

    def _sync(self, previous_ids: Sequence[int]) -> None:
        if len(previous_ids) < self._history_len:
            self.reset()
        for token_id in previous_ids[self._history_len :]:
            self.observe(int(token_id))

    @property
    def is_plain_greedy(self) -> bool:
        """Temperature 0 and no penalty: the next token is the argmax of the raw logits."""
        return self.params.temperature == 0.0 and not self._penalties_on

    @property
    def _penalties_on(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def apply_penalties(self, logits: np.ndarray) -> np.ndarray:
        """Penalized copy of ``logits`` (or ``logits`` itself when no penalty applies)."""
        if not self._counts or not self._penalties_on:
            return logits
        p = self.params
        vocab = logits.shape[0]
        ids = np.fromiter((i for i in self._counts if 0 <= i < vocab), dtype=np.int64)
        if ids.size == 0:
            return logits
        counts = np.fromiter((self._counts[int(i)] for i in ids), dtype=np.float32, count=ids.size)
        out = logits.astype(np.float32, copy=True)
        seen = out[ids]
        if p.repetition_penalty != 1.0:
            r = np.float32(p.repetition_penalty)
            seen = np.where(seen > 0, seen / r, seen * r)
        seen = seen - np.float32(p.presence_penalty) - np.float32(p.frequency_penalty) * counts
        out[ids] = seen
        return out

    # -- sampling ------------------------------------------------------------------------
    def sample(self, logits: np.ndarray, previous_ids: Sequence[int] | None = None) -> int:
        """The next token id for ``logits`` (shape ``(vocab,)``)."""
        if previous_ids is not None:
            self._sync(previous_ids)
        logits = np.asarray(logits).reshape(-1)
        logits = self.apply_penalties(logits)
        if self.params.temperature == 0.0:
            token = int(np.argmax(logits))  # the first NaN when there is one
            if not math.isfinite(float(logits[token])):
                raise not_finite_error()
            return token
        candidates, weights = self._weights(logits)
        return int(candidates[_inverse_cdf(weights, self.rng.random())])

    def distribution(self, penalized_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, probabilities) the next draw is taken from, after temperature and top-p.

        The probabilities (float64) sum to 1. With top_p < 1 the ids are exactly the nucleus:
        ranking tokens by decreasing probability (ties: lower id first), every token up to and
        including the first at which the cumulative probability reaches top_p. The order of
        the returned ids is deterministic (the draw depends on it only through the seed).
        """
        ids, weights = self._weights(penalized_logits)
        weights = weights.astype(np.float64)
        return ids, weights / weights.sum()

    def _weights(self, penalized_logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Candidate ids and their unnormalized float32 probabilities."""
        logits = np.asarray(penalized_logits, dtype=np.float32)
        top = float(np.max(logits))
        if not math.isfinite(top):
            raise not_finite_error()
        # softmax numerator, exp in float32 (fast), sums in float64
        weights = np.exp((logits - np.float32(top)) * np.float32(1.0 / self.params.temperature))
        total = float(weights.sum(dtype=np.float64))
        top_p = self.params.top_p
        if top_p >= 1.0:
            return np.arange(weights.shape[0]), weights
        ids = _nucleus(weights, total, top_p)
        return ids, weights[ids]


def not_finite_error() -> LlmchatError:
    """The model's logits hold NaN (or no finite value): its weights or library compute garbage."""
    return LlmchatError(
        "the model produced NaN logits (not a number): its weights hold NaN or infinity, or the compiled "
        "library computes garbage; no reply can be drawn from them",
        "check the weights: `llmchat download ID` verifies and repairs a downloaded model (re-import a "
        "GGUF); if they are whole, the model file itself is broken: use another model or quantization",
    )


_BLOCK = 1024


def _inverse_cdf(weights: np.ndarray, uniform: float) -> int:
    """Index i with cumsum(weights)[i-1] <= uniform * sum(weights) < cumsum(weights)[i].

    Exact inverse-CDF sampling in id order. Large arrays are summed in blocks first (a float64
    cumsum over a whole 150k vocabulary costs milliseconds; block sums a few microseconds), then
    only the chosen block is accumulated.
    """
    n = weights.shape[0]
    if n <= 4 * _BLOCK:
        cumulative = np.cumsum(weights, dtype=np.float64)
        index = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
        return _last_positive(weights, 0, n) if index >= n else index
    full = n - n % _BLOCK
    sums = weights[:full].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if full < n:
        sums = np.append(sums, weights[full:].sum(dtype=np.float64))
    block_cumulative = np.cumsum(sums)
    target = uniform * block_cumulative[-1]
    block = min(int(np.searchsorted(block_cumulative, target, side="right")), sums.size - 1)
    while block > 0 and sums[block] == 0.0:  # only when rounding put the target past the end
        block -= 1
    start, stop = block * _BLOCK, min((block + 1) * _BLOCK, n)
    before = block_cumulative[block - 1] if block else 0.0
    cumulative = np.cumsum(weights[start:stop], dtype=np.float64) + before
    index = int(np.searchsorted(cumulative, target, side="right"))
    return start + index if index < stop - start else _last_positive(weights, start, stop)


def _last_positive(weights: np.ndarray, start: int, stop: int) -> int:
    positive = np.flatnonzero(weights[start:stop] > 0)
    return start + int(positive[-1]) if positive.size else stop - 1


def _nucleus(weights: np.ndarray, total: float, top_p: float) -> np.ndarray:
    """Ids of the smallest set of most likely tokens whose probability sum reaches top_p.

    Ranking: decreasing weight, ties broken by lower id. Candidates are all tokens whose
    weight is at least a cutoff; every other token ranks below all of them, so if the
    candidates' cumulative weight reaches top_p the nucleus found among them is exact. A flat
    distribution (a huge nucleus) goes through value buckets instead.
    """
    threshold = top_p * total
    for cutoff in _TOP_P_CUTOFFS:
        candidates = np.flatnonzero(weights >= cutoff)
        if candidates.size > _TOP_P_MAX_CANDIDATES:
            break
        order = candidates[np.lexsort((candidates, -weights[candidates]))]
        cumulative = np.cumsum(weights[order], dtype=np.float64)
        cut = int(np.searchsorted(cumulative, threshold, side="left"))
        if cut < order.size:
            return order[: cut + 1]
    return _nucleus_by_buckets(weights, threshold)


def _nucleus_by_buckets(weights: np.ndarray, threshold: float) -> np.ndarray:
    """The nucleus of a flat distribution without sorting the whole vocabulary.

    The bit patterns of non-negative float32 values sort like the values, so the top 16 bits
    (sign, exponent, 7 mantissa bits) put every token into one of ~16k ordered buckets. The
    bucket masses locate the bucket where the cumulative probability reaches the threshold:
    every token in a higher bucket is in the nucleus, and only that bucket's tokens are sorted.
    """
    keys = weights.view(np.int32) >> 16
    masses = np.bincount(keys, weights=weights)
    from_top = np.cumsum(masses[::-1])
    k = min(int(np.searchsorted(from_top, threshold, side="left")), from_top.size - 1)
    bucket = masses.size - 1 - k
    mass_above = float(from_top[k - 1]) if k else 0.0
    above = np.flatnonzero(keys > bucket)
    members = np.flatnonzero(keys == bucket)
    order = members[np.lexsort((members, -weights[members]))]
    cumulative = np.cumsum(weights[order], dtype=np.float64) + mass_above
    cut = min(int(np.searchsorted(cumulative, threshold, side="left")), order.size - 1)
    return np.concatenate([above, order[: cut + 1]])
