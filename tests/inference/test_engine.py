"""The engine's conversation behaviour on the tiny CPU model: streaming, KV reuse, cancel, reset,
context overflow and bad input."""

from __future__ import annotations

import itertools
import re
import threading

import numpy as np
import pytest

from app.errors import LlmchatError
from app.inference.api import ContextTrimmed, Message, PrefillProgress, ReplyStats, SamplingParams, TextDelta
from app.inference.engine.tvm_engine import load_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _run(events):
    deltas, stats, trimmed = [], None, []
    for ev in events:
        if isinstance(ev, TextDelta):
            deltas.append(ev.text)
        elif isinstance(ev, ContextTrimmed):
            trimmed.append(ev)
        elif isinstance(ev, ReplyStats):
            stats = ev
    return "".join(deltas), stats, trimmed


@pytest.fixture
def engine(tiny_engine):
    tiny_engine.set_system_prompt(None)
    tiny_engine.reset()
    yield tiny_engine
    tiny_engine.set_system_prompt(None)
    tiny_engine.reset()


def test_chat_streams_text_and_ends_with_stats(engine):
    events = list(engine.chat("Hello! How are you?", GREEDY))
    assert isinstance(events[-1], ReplyStats)
    # a one-chunk prompt: the prefill's start (0 of N tokens read), then text only
    assert isinstance(events[0], PrefillProgress) and events[0].done == 0
    assert all(isinstance(e, TextDelta) for e in events[1:-1])
    text, stats, _ = _run(events)
    assert events[0].total == stats.prompt_tokens
    assert stats.generated_tokens >= 1 and stats.prompt_tokens > 5
    assert stats.finish_reason in ("stop", "length")
    assert stats.time_to_first_token_s > 0 and stats.prefill_s > 0
    assert engine.history == [Message("user", "Hello! How are you?"), Message("assistant", text)]
    assert engine.last_stats is stats and engine.session_stats.replies >= 1
    assert "prefill:" in stats.format() and "decode:" in stats.format()


def test_greedy_is_deterministic_and_second_turn_reuses_kv(engine, tiny_model_dir):
    _run(engine.chat("Hello! How are you?", GREEDY))
    kv_after_first = engine.kv_sequence_length
    second, stats2, _ = _run(engine.chat("Tell me about llamas.", GREEDY))
    full_prompt = engine.formatter.encode_prompt(engine.tokenizer, engine.history[:-1])
    # only the tokens after the cached prefix were prefilled
    assert 0 < stats2.prompt_tokens < len(full_prompt)
    assert kv_after_first > 0
    # the same conversation prefilled from scratch gives the same greedy reply
    history = engine.history
    engine.reset()
    engine.load_history(history[:2])
    again, stats3, _ = _run(engine.chat("Tell me about llamas.", GREEDY))
    assert again == second
    assert stats3.prompt_tokens == len(full_prompt)


def test_reset_empties_the_kv_cache(engine):
    _run(engine.chat("Hello!", GREEDY))
    assert engine.runtime.kv_sequence_length() > 0
    engine.reset()
    assert engine.runtime.kv_sequence_length() == 0
    assert engine.kv_sequence_length == 0 and engine.history == []


def test_system_prompt_is_rendered_and_resets_the_kv_state(engine):
    _run(engine.chat("Hello!", GREEDY))
    history = engine.history
    engine.set_system_prompt("You are terse.")
    assert engine.history == history and engine.runtime.kv_sequence_length() == 0
    _run(engine.chat("Hi", GREEDY))
    text = engine.tokenizer.decode(engine._kv_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello!")
    engine.set_system_prompt(None)
    _run(engine.chat("Bye", GREEDY))
    text = engine.tokenizer.decode(engine._kv_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nHello!")


def test_cancel_from_another_thread_stops_within_one_step(engine):
    runtime = engine.runtime
    real_decode = runtime.decode
    calls = {"n": 0, "after_cancel": 0}
    reached, cancelled = threading.Event(), threading.Event()

    def decode(token):
        calls["n"] += 1
        if cancelled.is_set():
            calls["after_cancel"] += 1
        if calls["n"] == 3:
            reached.set()
            assert cancelled.wait(10)
        return real_decode(token)

    def canceller():
        reached.wait(10)
        engine.cancel()
        cancelled.set()

    runtime.decode = decode
    thread = threading.Thread(target=canceller)
    thread.start()
    try:
        _, stats, _ = _run(
            engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=200), ignore_eos=True)
        )
    finally:
        thread.join()
        del runtime.decode
    assert stats.finish_reason == "cancelled"
    assert calls["after_cancel"] == 0  # the step running when cancel came finished, no new one began
    assert stats.generated_tokens == 4


def test_generate_raw_tokens_exact_count(engine):
    _, stats, _ = _run(
        engine.generate([1], SamplingParams(temperature=0, max_tokens=20), ignore_eos=True, detokenize=False)
    )
    assert stats.generated_tokens == 20 and stats.finish_reason == "length"
    assert stats.prompt_tokens == 1 and stats.decode_tok_s > 0
    assert engine.runtime.kv_sequence_length() == 0  # generate() leaves no state behind


def test_generate_keeps_the_conversation(engine):
    _run(engine.chat("Hello!", GREEDY))
    history = engine.history
    _run(engine.generate([1, 2], SamplingParams(temperature=0, max_tokens=3), ignore_eos=True))
    assert engine.history == history
    second, stats, _ = _run(engine.chat("And then?", GREEDY))
    engine.reset()
    engine.load_history(history)
    again, _, _ = _run(engine.chat("And then?", GREEDY))
    assert second == again and stats.prompt_tokens > 10


def test_sampling_with_seed_is_reproducible(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=123)
    a, _, _ = _run(engine.generate([3, 4], params, ignore_eos=True))
    b, _, _ = _run(engine.generate([3, 4], params, ignore_eos=True))
    assert a == b


def test_context_overflow_drops_oldest_turns(tiny_model_dir):
    engine = load_engine(tiny_model_dir("llama", "q4f32_1"), device="cpu", context_window=96)
    try:
        engine.set_system_prompt("Be brief.")
        params = SamplingParams(temperature=0, max_tokens=8)
        trimmed = []
        for i in range(8):
            _, _, t = _run(engine.chat(f"Question number {i}: what do llamas eat?", params))
            trimmed += t
            assert engine.runtime.kv_sequence_length() <= 96
        assert trimmed, "the conversation never overflowed the 96-token window"
        assert trimmed[0].context_window == 96 and trimmed[0].dropped_messages >= 2
        assert len(engine.history) < 16
        assert engine.history[-2].content == "Question number 7: what do llamas eat?"
        rendered = engine.tokenizer.decode(engine._kv_ids, skip_special_tokens=False)
        assert rendered.startswith("<|im_start|>system\nBe brief.")
    finally:
        engine.close()


def test_prompt_longer_than_context_window_is_an_error(tiny_model_dir):
    engine = load_engine(tiny_model_dir("llama", "q4f32_1"), device="cpu", context_window=48)
    try:
        with pytest.raises(LlmchatError, match="context window"):
            list(engine.chat("llamas " * 80, GREEDY))
        with pytest.raises(LlmchatError, match="context window"):
            list(engine.generate(list(range(60)), GREEDY))
        # the engine still works afterwards
        _, stats, _ = _run(engine.chat("Hi", SamplingParams(temperature=0, max_tokens=4)))
        assert stats.generated_tokens >= 1
        # a reply that runs into the end of the window stops there
        engine.reset()
        _, stats, _ = _run(
            engine.generate(
                list(range(1, 40)), SamplingParams(temperature=0, max_tokens=100), ignore_eos=True
            )
        )
        assert stats.finish_reason == "context"
        assert engine.runtime.context_window == 48 and stats.generated_tokens == 48 - 39 + 1
    finally:
        engine.close()


def test_memory_in_use_counts_weights_and_kv(engine):
    used = engine.memory_in_use_bytes()
    assert used is not None and used > engine.info.weight_bytes > 0
    assert engine.info.backend == "cpu" and engine.info.device == "cpu:0"
    assert engine.info.quantization == "q4f32_1"


def test_model_not_installed_suggests_download():
    with pytest.raises(LlmchatError) as err:
        load_engine("no-such-model-q4f16_1", device="cpu")
    assert err.value.fix == "llmchat download no-such-model-q4f16_1"


def test_installed_model_id_resolves(tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    from app import paths

    target = paths.models_dir() / "tiny-chat"
    shutil.copytree(tiny_model_dir("llama", "q4f32_1"), target)
    engine = load_engine("tiny-chat", device="cpu")
    try:
        assert engine.info.model_id == "tiny-chat"
        assert np.isfinite(engine.runtime.prefill([1, 2, 3])).all()
    finally:
        engine.close()


def test_default_context_window_fits_gpu_memory():
    """Weights + KV cache of the default window stay within 85 % of a (stand-in) GPU's memory."""
    import types

    from app.inference.engine.tvm_engine import fit_context_window

    gpu = types.SimpleNamespace(dlpack_device_type=lambda: 2, total_global_memory=8 << 30)
    kv = 2 * 32 * 32 * 128 * 2  # Llama-2-7B, fp16: 512 KiB per token
    ctx = fit_context_window(8192, gpu, weight_bytes=3_800_000_000, kv_bytes_per_token=kv)
    assert 512 <= ctx < 8192 and ctx % 16 == 0
    assert 3_800_000_000 + ctx * kv <= 0.85 * (8 << 30)
    big = types.SimpleNamespace(dlpack_device_type=lambda: 2, total_global_memory=141 << 30)
    assert fit_context_window(8192, big, 3_800_000_000, kv) == 8192
    cpu = types.SimpleNamespace(dlpack_device_type=lambda: 1, total_global_memory=1)
    assert fit_context_window(8192, cpu, 3_800_000_000, kv) == 8192


def test_device_argmax_gives_the_host_greedy_reply(tiny_engine, tiny_model_dir, tmp_path, monkeypatch):
    """Libraries for CUDA export ``argmax`` and greedy decoding then feeds each token id to the
    next step on the device, in batches, the next queued before one is read. Built here for the
    CPU (the export switched on, its own cache directory): the reply is the same as through the
    host's argmax, the steps went through start_greedy_ahead, and a reply that stops inside a
    batch (stop token, cancel, reader gone) leaves the KV cache holding exactly the conversation."""
    import app.inference.models.llama as llama_module
    from app.inference.engine.generation import GREEDY_AHEAD, GenerationResult, generate

    monkeypatch.setattr(llama_module, "has_device_argmax", lambda _target: True)
    monkeypatch.setenv("LLMCHAT_CACHE_DIR", str(tmp_path / "cache"))
    device_engine = load_engine(tiny_model_dir("llama", "q4f32_1"), device="cpu")
    try:
        runtime = device_engine.runtime
        assert runtime.has_device_argmax and not tiny_engine.runtime.has_device_argmax
        calls, starts = [], []
        start = runtime.start_greedy_ahead

        def counted_start(token, steps):
            calls.append(steps)
            starts.append(token)
            return start(token, steps)

        monkeypatch.setattr(runtime, "start_greedy_ahead", counted_start)
        params = SamplingParams(temperature=0.0, max_tokens=2 * GREEDY_AHEAD + 3)
        tiny_engine.reset()
        expected, _, _ = _run(tiny_engine.chat("Tell me about llamas.", params))
        got, stats, _ = _run(device_engine.chat("Tell me about llamas.", params))
        assert got == expected and stats.generated_tokens > 1
        assert 1 < max(calls) <= GREEDY_AHEAD and sum(calls) >= stats.generated_tokens - 1
        # the first batch starts from the prompt's token, the next ones from the device's last pick
        # (queued before the previous batch's ids are read)
        assert starts[0] is not None and len(starts) > 1 and all(t is None for t in starts[1:])
        assert runtime.sequence_length == len(device_engine._kv_ids) == runtime.kv_sequence_length()
        # sampling with a temperature still goes through the host's sampler
        calls.clear()
        _run(device_engine.chat("And alpacas?", SamplingParams(temperature=0.8, max_tokens=4, seed=1)))
        assert calls == []

        # a raw prompt decoded 1, 4 and 5 steps per call; stops inside a batch of steps
        prompt = [1, 5, 9, 2]

        class CancelAfter(threading.Event):
            def __init__(self, checks: int) -> None:
                super().__init__()
                self.checks = checks

            def is_set(self) -> bool:
                self.checks -= 1
                return self.checks < 0

        def run(steps: int, stop_ids=(), cancel=None):
            runtime.clear()
            kv_ids: list[int] = []
            result = GenerationResult()
            for _ in generate(
                runtime,
                prompt,
                SamplingParams(temperature=0.0, max_tokens=12),
                kv_ids=kv_ids,
                cancel=cancel or threading.Event(),
                stop_token_ids=stop_ids,
                result=result,
                greedy_ahead=steps,
            ):
                pass
            assert runtime.sequence_length == len(kv_ids) == runtime.kv_sequence_length()
            # the KV cache holds exactly kv_ids: the next logits are those of a fresh prefill
            cont = runtime.decode(3)
            runtime.clear()
            np.testing.assert_allclose(cont, runtime.prefill([*kv_ids, 3]), rtol=1e-4, atol=1e-4)
            return result

        tokens = run(1).token_ids
        assert len(tokens) == 12 and run(4).token_ids == tokens and run(5).token_ids == tokens
        first = tokens.index(tokens[6])  # a stop token met inside the second batch of 4 steps
        assert run(4, stop_ids={tokens[6]}).token_ids == tokens[: first + 1]
        cancelled = run(4, cancel=CancelAfter(6))
        assert cancelled.stats.finish_reason == "cancelled" and cancelled.token_ids == tokens[:7]
        # the reader goes away after the first piece of text: the unused steps are rolled back too
        device_engine.reset()
        events = device_engine.chat("Tell me about llamas.", params)
        next(e for e in events if isinstance(e, TextDelta))
        events.close()
        assert runtime.sequence_length == len(device_engine._kv_ids) == runtime.kv_sequence_length()
    finally:
        device_engine.close()
        tiny_engine.reset()


def test_a_long_prompt_reports_its_prefill_per_chunk_before_the_first_token(engine):
    """#18 item 4: PrefillProgress before the prefill (0 done) and after each 32-token chunk but the
    last, with tok/s and the time left; all of it before the first text."""
    events = list(engine.chat("The quick brown fox jumps over the lazy dog. " * 4, GREEDY))
    kinds = [type(ev).__name__ for ev in events]
    progress = [ev for ev in events if isinstance(ev, PrefillProgress)]
    stats = events[-1]
    assert isinstance(stats, ReplyStats)
    total = stats.prompt_tokens
    chunk = engine.runtime.prefill_chunk
    assert total > 3 * chunk  # several chunks
    assert [p.done for p in progress] == list(range(0, total, chunk))
    assert all(p.total == total for p in progress)
    assert progress[0].eta_s is None and "reading the prompt: 0 / " in progress[0].format()
    later = progress[1:]
    assert all(p.tok_s > 0 and p.eta_s is not None and p.eta_s >= 0 for p in later)
    assert all(a.elapsed_s <= b.elapsed_s for a, b in itertools.pairwise(later))
    assert re.fullmatch(
        rf"reading the prompt: {chunk:,} / {total:,} tokens · [\d,]+ tok/s · ~\d+ s left", later[0].format()
    )
    # every progress event comes before the first text
    first_text = kinds.index("TextDelta")
    assert max(i for i, k in enumerate(kinds) if k == "PrefillProgress") < first_text
    # a follow-up counts only the tokens it prefills (the conversation's prefix is in the KV cache)
    events = list(engine.chat("ok", GREEDY))
    follow = [ev for ev in events if isinstance(ev, PrefillProgress)]
    assert follow[0].total == events[-1].prompt_tokens < total


def test_cancel_and_leaving_mid_prefill_keep_the_kv_cache_consistent(engine, tiny_model_dir):
    """Cancelled between chunks: the chunks done stay (prompt_tokens says how many); a consumer that
    stops reading mid-prefill leaves the KV mirror in step; the next reply equals a fresh one."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    events = engine.chat(prompt, GREEDY)
    for ev in events:
        if isinstance(ev, PrefillProgress) and ev.done == 2 * engine.runtime.prefill_chunk:
            engine.cancel()
    stats = ev
    assert isinstance(stats, ReplyStats) and stats.finish_reason == "cancelled"
    assert stats.generated_tokens == 0 and stats.prompt_tokens == 2 * engine.runtime.prefill_chunk
    assert engine.runtime.sequence_length == len(engine._kv_ids)
    engine.reset()
    events = engine.chat(prompt, GREEDY)
    for ev in events:
        if isinstance(ev, PrefillProgress) and ev.done:
            break
    events.close()  # the consumer left after the first chunk
    assert engine.runtime.sequence_length == len(engine._kv_ids) == engine.runtime.prefill_chunk
    engine.reset()
    after_leave = _run(engine.chat("Hi there", GREEDY))[0]
    fresh = load_engine(tiny_model_dir("llama", "q4f32_1"), device="cpu")
    try:
        assert after_leave == _run(fresh.chat("Hi there", GREEDY))[0]
    finally:
        fresh.close()


def test_context_trimmed_comes_before_the_prefill(tiny_model_dir):
    engine = load_engine(tiny_model_dir("llama", "q4f32_1"), device="cpu", context_window=256)
    try:
        params = SamplingParams(temperature=0, max_tokens=4)
        _run(engine.chat("The quick brown fox jumps over the lazy dog. " * 3, params))
        events = list(engine.chat("A lazy dog sleeps under the quick brown fox. " * 4, params))
        kinds = [type(ev).__name__ for ev in events]
        assert kinds[0] == "ContextTrimmed" and kinds[1] == "PrefillProgress", kinds
    finally:
        engine.close()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_nan_weights_are_an_error_not_an_empty_reply(tiny_model_dir, tmp_path, temperature):
    """Issue 19: NaN weights once gave an empty reply with rc 0. The logits are checked where a token
    is drawn from them (greedy and sampled): the reply is an error naming NaN."""
    import shutil

    from app.inference.store.weights import load_numpy, write_tensor_cache

    source = tiny_model_dir("llama", "q4f32_1")
    broken = tmp_path / "nan-model"
    shutil.copytree(source, broken)
    arrays = load_numpy(source)
    norms = [name for name in arrays if name.endswith("norm.weight")]
    assert norms
    for name in norms:
        arrays[name] = np.full_like(arrays[name], np.nan)
    for old in broken.glob("params_shard_*.bin"):
        old.unlink()
    write_tensor_cache(arrays, broken)
    engine = load_engine(broken, device="cpu")
    try:
        with pytest.raises(LlmchatError, match="NaN logits") as info:
            _run(engine.chat("Tell me about llamas.", SamplingParams(temperature=temperature, max_tokens=8)))
        assert "llmchat download" in info.value.fix
    finally:
        engine.close()
