"""Sampler: greedy, seed, top-p nucleus, penalties; validation and /set parsing."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from app.errors import LlmchatError
from app.inference.api import SamplingParams
from app.inference.engine.sampling import Sampler, apply_overrides, parse_set_command, validate


def _logits(vocab: int = 1000, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference_nucleus(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    """Straightforward definition: full sort, smallest prefix whose probability sum reaches top_p."""
    probs = _softmax(logits.astype(np.float64) / temperature)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    total = 0.0
    nucleus = set()
    for i in order:
        nucleus.add(i)
        total += probs[i]
        if total >= top_p:
            break
    return nucleus


def test_greedy_is_argmax() -> None:
    for seed in range(5):
        logits = _logits(seed=seed)
        sampler = Sampler(SamplingParams(temperature=0.0, top_p=0.5))
        assert sampler.sample(logits, []) == int(np.argmax(logits))


def test_seed_reproducible_and_seeds_differ() -> None:
    logits = _logits(scale=1.0)

    def draws(seed: int | None) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=seed))
        return [sampler.sample(logits) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert draws(None) != draws(None)


@pytest.mark.parametrize("seed", [0, 7])
def test_seeded_draws_follow_the_temperature(seed: int) -> None:
    """The same seed at two temperatures: each run's frequencies follow softmax(logits / T) for its
    own T, and the two distributions are far apart (a sampler that ignored the temperature, or
    applied it twice, would fail one of them)."""
    logits = _logits(vocab=12, seed=2, scale=1.0)
    n = 6000

    def frequencies(temperature: float) -> np.ndarray:
        sampler = Sampler(SamplingParams(temperature=temperature, top_p=1.0, seed=seed))
        counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=logits.size)
        return counts / n

    cold, hot = _softmax(logits / 0.4), _softmax(logits / 2.0)
    assert 0.5 * np.abs(cold - hot).sum() > 0.4  # total variation: the temperatures matter
    for temperature, expected in ((0.4, cold), (2.0, hot)):
        got = frequencies(temperature)
        assert 0.5 * np.abs(got - expected).sum() < 0.04, (temperature, got.round(3), expected.round(3))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.5), (0.7, 0.9), (1.5, 0.3), (1.0, 0.05)])
def test_top_p_keeps_exactly_the_nucleus(temperature: float, top_p: float) -> None:
    logits = _logits(vocab=300, seed=3, scale=1.5)
    expected = _reference_nucleus(logits, temperature, top_p)
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=0))
    ids, probs = sampler.distribution(logits)
    assert set(ids.tolist()) == expected
    assert probs.sum() == pytest.approx(1.0)
    # empirically: nothing outside the nucleus is ever drawn, everything inside is
    draws = Counter(sampler.sample(logits) for _ in range(8000))
    assert set(draws) <= expected
    if len(expected) <= 60:
        assert set(draws) == expected
    # and the frequencies follow the renormalized nucleus probabilities
    p = _softmax(logits / temperature)
    nucleus_mass = sum(p[i] for i in expected)
    top = max(expected, key=lambda i: p[i])
    assert draws[top] / 8000 == pytest.approx(p[top] / nucleus_mass, abs=0.02)


def test_top_p_ties_are_deterministic_lower_id_first() -> None:
    logits = np.zeros(10, dtype=np.float32)  # ten equally likely tokens
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.3, seed=0))
    ids, probs = sampler.distribution(logits)
    assert sorted(ids.tolist()) == [0, 1, 2]  # 0.3 reached after three tokens, the lowest ids
    assert np.allclose(probs, 1 / 3)


def test_top_p_flat_large_vocab_uses_exact_fallback() -> None:
    """A flat distribution over a big vocabulary (nucleus larger than the fast path's candidates)."""
    logits = _logits(vocab=152_000, seed=5, scale=0.5)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    ids, _ = sampler.distribution(logits)
    probs = _softmax(logits)
    order = np.lexsort((np.arange(logits.size), -probs))
    cut = int(np.searchsorted(np.cumsum(probs[order]), 0.5))
    assert ids.size > 8192
    assert set(ids.tolist()) == set(order[: cut + 1].tolist())


def test_top_p_peaked_large_vocab_fast_path() -> None:
    logits = _logits(vocab=152_000, seed=6, scale=4.0)
    sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.95, seed=0))
    ids, _ = sampler.distribution(logits)
    probs = _softmax(logits / 0.7)
    order = np.argsort(-probs, kind="stable")
    cut = int(np.searchsorted(np.cumsum(probs[order]), 0.95))
    assert set(ids.tolist()) == set(order[: cut + 1].tolist())


def test_temperature_scales_the_distribution() -> None:
    logits = _logits(vocab=50, seed=1)
    for temperature in (0.5, 1.0, 2.0):
        ids, probs = Sampler(SamplingParams(temperature=temperature, top_p=1.0)).distribution(logits)
        expected = _softmax(logits / temperature)
        np.testing.assert_allclose(probs[np.argsort(ids)], expected, rtol=1e-5, atol=1e-9)


def _penalized(params: SamplingParams, logits: np.ndarray, previous: list[int]) -> np.ndarray:
    sampler = Sampler(params)
    sampler._sync(previous)
    return sampler.apply_penalties(logits)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = np.array([2.0, -2.0, 1.0, -1.0, 0.5], dtype=np.float32)
    previous = [0, 1, 1, 4]
    out = _penalized(SamplingParams(repetition_penalty=2.0), logits, previous)
    expected = np.array([1.0, -4.0, 1.0, -1.0, 0.25], dtype=np.float32)
    np.testing.assert_allclose(out, expected)
    assert logits[0] == 2.0  # the caller's array is not changed


def test_presence_and_frequency_penalties() -> None:
    logits = np.array([1.0, 1.0, 1.0, 1.0], dtype=np.float32)
    previous = [0, 0, 0, 2]
    out = _penalized(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), logits, previous)
    # logit -= presence * (count > 0) + frequency * count
    expected = np.array([1.0 - 0.5 - 0.75, 1.0, 1.0 - 0.5 - 0.25, 1.0], dtype=np.float32)
    np.testing.assert_allclose(out, expected)
    # negative values reward repetition (allowed range -2..2)
    out = _penalized(SamplingParams(presence_penalty=-1.0), logits, previous)
    np.testing.assert_allclose(out, [2.0, 1.0, 2.0, 1.0])


def test_penalties_change_the_sampled_distribution() -> None:
    logits = np.array([3.0, 2.0, 1.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=1.5, frequency_penalty=0.5)
    sampler = Sampler(params)
    sampler._sync([0, 0])
    ids, probs = sampler.distribution(sampler.apply_penalties(logits))
    expected_logits = np.array([3.0 / 1.5 - 2 * 0.5, 2.0, 1.0])
    np.testing.assert_allclose(probs[np.argsort(ids)], _softmax(expected_logits), rtol=1e-5)
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=3.0)).sample(logits, [0]) == 1


def test_counts_are_incremental_and_restart_on_a_shorter_history() -> None:
    sampler = Sampler(SamplingParams(frequency_penalty=1.0, temperature=0))
    logits = np.array([5.0, 4.5, 0.0], dtype=np.float32)
    history = [0]
    assert sampler.sample(logits, history) == 1  # 5 - 1 < 4.5
    history.append(1)
    history.append(0)
    assert sampler._counts == {0: 1}  # sample() counts lazily: only what it has seen so far
    assert sampler.sample(logits, history) == 1  # 0 seen twice: 3.0; 1 once: 3.5
    assert sampler._counts == {0: 2, 1: 1}
    assert sampler.sample(logits, []) == 0  # a new sequence: no penalties
    sampler.observe(0)
    assert sampler.sample(logits) == 1


def test_validate_names_key_and_range() -> None:
    validate(SamplingParams())
    cases = {
        "temperature": (2.5, "0 to 2"),
        "top_p": (0.0, "greater than 0 and at most 1"),
        "max_tokens": (0, "at least 1"),
        "seed": (-1, "at least 0"),
        "repetition_penalty": (0.0, "greater than 0"),
        "presence_penalty": (3.0, "-2 to 2"),
        "frequency_penalty": (-2.5, "-2 to 2"),
        "stop": ("###", "list of non-empty strings"),
    }
    for key, (value, words) in cases.items():
        params = SamplingParams(**{key: value})
        with pytest.raises(LlmchatError) as err:
            validate(params)
        assert key in str(err.value)
        assert words in str(err.value)
    with pytest.raises(LlmchatError, match="temperature"):
        Sampler(SamplingParams(temperature=-1))


def test_parse_set_command() -> None:
    values = parse_set_command("temperature=0.5; top_p=0.9; stop=###,END;max_tokens=100;seed=23")
    assert values == {"temperature": 0.5, "top_p": 0.9, "stop": ["###", "END"], "max_tokens": 100, "seed": 23}
    params = apply_overrides(SamplingParams(), values)
    assert params.temperature == 0.5 and params.stop == ["###", "END"] and params.seed == 23
    assert parse_set_command("seed=none") == {"seed": None}
    assert parse_set_command("repetition_penalty=1.1;presence_penalty=-0.5") == {
        "repetition_penalty": 1.1,
        "presence_penalty": -0.5,
    }


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("temperature=3", "temperature"),
        ("temperature=hot", "temperature"),
        ("top_p=1.5", "top_p"),
        ("max_tokens=0.5", "max_tokens"),
        ("frequency_penalty=9", "-2 to 2"),
        ("colour=blue", "unknown sampling setting 'colour'"),
        ("temperature", "key=value"),
    ],
)
def test_parse_set_command_errors(text: str, words: str) -> None:
    with pytest.raises(LlmchatError) as err:
        parse_set_command(text)
    assert words in str(err.value)


def test_inverse_cdf_matches_a_plain_cumulative_sum() -> None:
    from app.inference.engine.sampling import _inverse_cdf

    rng = np.random.default_rng(1)
    for n in (10, 5000, 151_936):
        weights = (rng.random(n) ** 8).astype(np.float32)
        weights[rng.integers(0, n, n // 3)] = 0.0
        cumulative = np.cumsum(weights, dtype=np.float64)
        for u in [*rng.random(500), 0.0, 1.0 - 1e-12]:
            expected = min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), n - 1)
            got = _inverse_cdf(weights, float(u))
            assert weights[got] > 0
            if got != expected:  # only a float rounding tie at a boundary may differ
                assert abs(cumulative[got] - u * cumulative[-1]) < 1e-9 * cumulative[-1]


def test_full_vocabulary_draws_follow_the_softmax() -> None:
    """top_p = 1 over a large vocabulary: frequencies match, impossible tokens never come."""
    vocab = 50_000
    logits = np.full(vocab, -np.inf, dtype=np.float32)
    favourites = {7: 2.0, 12_345: 1.0, 30_000: 1.5, 49_999: 0.0}
    for token, logit in favourites.items():
        logits[token] = logit
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1.0, seed=3))
    draws = Counter(sampler.sample(logits) for _ in range(4000))
    assert set(draws) == set(favourites)
    probs = _softmax(np.array(list(favourites.values())))
    for (token, _), p in zip(favourites.items(), probs, strict=True):
        assert draws[token] / 4000 == pytest.approx(p, abs=0.03)


@pytest.mark.parametrize(("temperature", "top_p"), [(2.0, 0.9), (1.0, 0.37), (1.3, 0.61)])
def test_top_p_flat_distribution_with_ties(temperature: float, top_p: float) -> None:
    """Many exactly equal logits (a flat, coarse distribution): the lowest ids win the cut."""
    rng = np.random.default_rng(11)
    logits = rng.integers(0, 4, 152_000).astype(np.float32)
    ids, probs = Sampler(SamplingParams(temperature=temperature, top_p=top_p)).distribution(logits)
    reference = _softmax(logits.astype(np.float64) / temperature)
    order = np.lexsort((np.arange(logits.size), -reference))
    cut = int(np.searchsorted(np.cumsum(reference[order]), top_p))
    assert set(ids.tolist()) == set(order[: cut + 1].tolist())
    assert probs.sum() == pytest.approx(1.0)
