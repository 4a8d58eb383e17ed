"""End-to-end checks of a loaded engine, as assertions (the checks ``benchmarks/gpu_decode.py``
records): logits against the numpy float64 reference and against a second engine (TVM's plain
pipeline, ``LLMCHAT_TVM_PIPELINE=default``), and greedy tokens picked on the device against
numpy's argmax of the same logits. Device-independent: tests/gpu/test_engine_cuda.py runs them on
the GPU, tests/gpu/test_harness_on_cpu.py on the CPU."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from app.inference.store.weights import load_numpy
from tests.inference.reference import forward

#: a prompt longer than two 64-row tiles of the prompt kernels, decode steps on its KV, a second
#: "turn" (attention over the cached pages and its own keys) and more decode steps
PROMPT, SECOND_TURN, STEPS = 150, 70, 8


def token_script(vocab: int, seed: int = 7) -> tuple[list[int], list[int], list[int]]:
    """(prompt, decoded tokens, second turn): fixed ids, the same for every engine."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=PROMPT + SECOND_TURN + 2 * STEPS).tolist()
    return ids[:PROMPT], ids[PROMPT : PROMPT + 2 * STEPS], ids[PROMPT + 2 * STEPS :]


def scripted_logits(engine: Any, vocab: int) -> tuple[np.ndarray, list[int]]:
    """Logits after the prompt, after each decoded token, after the second turn and after each
    token decoded after it (teacher-forced: the same tokens for every engine); and all the ids fed."""
    prompt, decoded, second = token_script(vocab)
    rt = engine.runtime
    rt.clear()
    outs = [rt.prefill(prompt)]
    outs += [rt.decode(t) for t in decoded[:STEPS]]
    outs.append(rt.prefill(second))
    outs += [rt.decode(t) for t in decoded[STEPS:]]
    rt.clear()
    return np.stack(outs), [*prompt, *decoded[:STEPS], *second, *decoded[STEPS:]]


def relative_errors(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per row: max |got - expected| over the row's largest |expected|."""
    return np.abs(got - expected).max(axis=1) / (np.abs(expected).max(axis=1) + 1e-9)


def _positions_checked(ids: list[int]) -> list[int]:
    """Positions (of the full sequence) whose logits :func:`scripted_logits` returns."""
    first = PROMPT - 1
    after_first = [first + 1 + i for i in range(STEPS)]
    second_end = PROMPT + STEPS + SECOND_TURN - 1
    after_second = [second_end + 1 + i for i in range(STEPS)]
    assert after_second[-1] == len(ids) - 1
    return [first, *after_first, second_end, *after_second]


def check_against_reference(engine: Any, model_dir: Path, tol: float) -> float:
    """The engine's logits against the numpy float64 forward pass of the stored weights; greedy
    picks equal wherever the reference's top two are further apart than the tolerance. The
    largest relative error."""
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    got, ids = scripted_logits(engine, config["vocab_size"])
    ref = forward(config, load_numpy(model_dir), ids)[_positions_checked(ids)]
    assert np.isfinite(got).all()
    rel = relative_errors(got, ref)
    assert rel.max() <= tol, f"logits off the float64 reference by {rel.max():.2e} at row {int(rel.argmax())}"
    _same_clear_picks(got, ref, tol)
    return float(rel.max())


def check_against_engine(engine: Any, other: Any, vocab: int, tol: float) -> float:
    """Two engines of the same model (e.g. llmchat's pipeline and TVM's plain one) give the same
    logits within ``tol`` and the same clear greedy picks. The largest relative error."""
    got, _ = scripted_logits(engine, vocab)
    ref, _ = scripted_logits(other, vocab)
    rel = relative_errors(got, ref)
    assert rel.max() <= tol, f"logits off the other engine's by {rel.max():.2e} at row {int(rel.argmax())}"
    _same_clear_picks(got, ref, tol)
    return float(rel.max())


def _same_clear_picks(got: np.ndarray, ref: np.ndarray, tol: float) -> None:
    for row, (a, b) in enumerate(zip(got, ref, strict=True)):
        top2 = np.sort(b)[-2:]
        if top2[1] - top2[0] > 2 * tol * np.abs(b).max():
            assert int(np.argmax(a)) == int(np.argmax(b)), f"greedy pick differs at row {row}"


def check_device_greedy(engine: Any, steps: int = 24, start: list[int] | None = None) -> list[int]:
    """Greedy decoding through the library's argmax (one step per call, several per call with the
    ids fed back on the device, and generation's batches: the chat's path) after the prompt
    ``start`` (default three tokens) gives the tokens of numpy's argmax of the host's logits.
    Those tokens."""
    from app.inference.api import SamplingParams
    from app.inference.engine.generation import GenerationResult, generate

    rt = engine.runtime
    start = start or [1, 2, 3]

    def first() -> int:
        rt.clear()
        return int(np.argmax(rt.prefill(start)))

    token = first()
    host = []
    for _ in range(steps):
        token = int(np.argmax(rt.decode(token)))
        host.append(token)
    token = first()
    device = []
    for _ in range(steps):
        token = rt.decode_greedy(token)
        device.append(token)
    token = first()
    ahead: list[int] = []
    while len(ahead) < steps:
        ahead += rt.decode_greedy_ahead(token, min(5, steps - len(ahead)))
        token = ahead[-1]
    rt.clear()
    result = GenerationResult()
    for _ in generate(
        rt,
        start,
        SamplingParams(temperature=0.0, max_tokens=steps + 1),
        kv_ids=[],
        cancel=threading.Event(),
        result=result,
    ):
        pass
    rt.clear()
    assert device == host, "decode_greedy differs from numpy's argmax"
    assert ahead == host, "decode_greedy_ahead differs from numpy's argmax"
    assert result.token_ids[1:] == host, "generation's greedy batches differ from numpy's argmax"
    return host


def long_prompt(vocab: int, prompt_len: int, seed: int = 11) -> list[int]:
    """The fixed random prompt of the long-context checks."""
    return np.random.default_rng(seed).integers(0, vocab, size=prompt_len).tolist()


def long_context_logits(engine: Any, ids: list[int], prompt_len: int) -> np.ndarray:
    """Logits after the prompt ``ids[:prompt_len]`` (read in the engine's prefill chunks) and after
    each later id of ``ids``, decoded one at a time (teacher-forced)."""
    rt = engine.runtime
    rt.clear()
    outs = [rt.prefill(ids[:prompt_len])]
    outs += [rt.decode(t) for t in ids[prompt_len:]]
    rt.clear()
    return np.stack(outs)


def check_long_context(engine: Any, model_dir: Path, prompt_len: int, steps: int, tol: float) -> float:
    """A long prompt (several prefill chunks), then greedy steps whose attention reads all its
    keys, against the float64 reference. The largest relative error."""
    config = json.loads((model_dir / "mlc-chat-config.json").read_text())
    ids = long_prompt(config["vocab_size"], prompt_len)
    rt = engine.runtime
    rt.clear()
    outs = [rt.prefill(ids)]
    for _ in range(steps):
        ids.append(int(np.argmax(outs[-1])))
        outs.append(rt.decode(ids[-1]))
    rt.clear()
    ref = forward(config, load_numpy(model_dir), ids)[prompt_len - 1 :]
    rel = relative_errors(np.stack(outs), ref)
    assert rel.max() <= tol, f"long context: logits off by {rel.max():.2e} at step {int(rel.argmax())}"
    return float(rel.max())


def check_long_context_against_engine(
    engine: Any, other: Any, vocab: int, prompt_len: int, steps: int, tol: float
) -> float:
    """A long prompt and ``steps`` greedy tokens of ``engine`` fed to both engines: the same logits
    within ``tol`` after the prompt and after each token, and the same clear greedy picks. The
    largest relative error."""
    ids = long_prompt(vocab, prompt_len)
    rt = engine.runtime
    rt.clear()
    logits = rt.prefill(ids)
    for _ in range(steps):
        ids.append(int(np.argmax(logits)))
        logits = rt.decode(ids[-1])
    got = long_context_logits(engine, ids, prompt_len)
    ref = long_context_logits(other, ids, prompt_len)
    assert np.isfinite(got).all()
    rel = relative_errors(got, ref)
    assert rel.max() <= tol, (
        f"long context: logits off the other engine's by {rel.max():.2e} at step {int(rel.argmax())}"
    )
    _same_clear_picks(got, ref, tol)
    return float(rel.max())


def check_kv_reuse(engine: Any, vocab: int, tol: float) -> float:
    """Multi-turn KV reuse: a prompt, greedy steps on the device, three of them rolled back (the
    chat's unused steps), then a second turn on the kept cache: its logits equal those of a fresh
    prefill of everything kept within ``tol`` (relative to the row's largest), with the same
    greedy pick. The relative error."""
    rt = engine.runtime
    prompt, _, second = token_script(vocab)
    rt.clear()
    first = int(np.argmax(rt.prefill(prompt)))
    picked = rt.decode_greedy_ahead(first, 8)
    rt.popn(3)
    # fed: the prompt, ``first`` and the first 7 picks (the 8th is not fed yet); 3 rolled back
    kept = [*prompt, first, *picked[:4]]
    assert rt.kv_sequence_length() == len(kept), "the rollback left another cache length"
    got = rt.prefill(second)
    rt.clear()
    want = rt.prefill([*kept, *second])
    rt.clear()
    rel = float(relative_errors(got.reshape(1, -1), want.reshape(1, -1)).max())
    assert rel <= tol, f"second turn on the kept KV cache off a fresh prefill by {rel:.2e}"
    _same_clear_picks(got.reshape(1, -1), want.reshape(1, -1), tol)
    return rel
