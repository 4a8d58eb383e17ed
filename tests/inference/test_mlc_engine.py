"""The optional MLC-LLM engine, driven against the stand-in ``mlc_llm`` in tests/stand_ins.

The stand-in exists because MLC's wheels are not on PyPI; see its module docstring.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from app.errors import LlmchatError
from app.inference.api import ContextTrimmed, Message, ReplyStats, SamplingParams, TextDelta
from app.inference.engine.mlc_engine import MLCLLMEngine, mlc_llm_available


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "Tiny-q4f16_1-MLC"
    directory.mkdir()
    (directory / "mlc-chat-config.json").write_text(
        json.dumps({"model_type": "llama", "quantization": "q4f16_1", "context_window_size": 40})
    )
    (directory / "tensor-cache.json").write_text(
        json.dumps({"metadata": {"ParamBytes": 123456}, "records": []})
    )
    return directory


def _run(events) -> tuple[str, list, ReplyStats]:  # type: ignore[no-untyped-def]
    events = list(events)
    assert isinstance(events[-1], ReplyStats)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, events, events[-1]


def test_not_available_without_the_package(monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "mlc_llm", None)  # import fails as when it is not installed
    assert not mlc_llm_available()
    with pytest.raises(LlmchatError) as err:
        MLCLLMEngine(model_dir)
    assert "mlc.ai/wheels" in str(err.value)


def test_placeholder_package_is_not_available(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """PyPI's mlc-llm-* 0.1 placeholders install an empty package."""
    (tmp_path / "mlc_llm").mkdir()
    (tmp_path / "mlc_llm" / "__init__.py").write_text("# placeholder\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mlc_llm", raising=False)
    assert not mlc_llm_available()
    with pytest.raises(LlmchatError, match="placeholder"):
        MLCLLMEngine(tmp_path)
    sys.modules.pop("mlc_llm", None)


def test_streams_chat_and_reports_stats(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    assert mlc_llm_available()
    engine = MLCLLMEngine(model_dir, device="vulkan", model_id="tiny")
    assert engine.info.backend == "mlc-llm:vulkan"
    assert engine.info.quantization == "q4f16_1"
    assert engine.info.context_window == 40
    assert engine.info.weight_bytes == 123456
    params = SamplingParams(
        temperature=0.3, top_p=0.8, max_tokens=50, seed=5, frequency_penalty=0.1, stop=["XYZ"]
    )
    text, events, stats = _run(engine.chat("hello there", params))
    assert text == "You said: hello there w0 w1 w2"
    assert sum(isinstance(e, TextDelta) for e in events) == 7  # one delta per chunk
    request = engine._engine.requests[-1]
    assert request.kwargs["stream_options"] == {"include_usage": True}
    assert request.kwargs["temperature"] == 0.3 and request.kwargs["top_p"] == 0.8
    assert request.kwargs["seed"] == 5 and request.kwargs["max_tokens"] == 50
    assert request.kwargs["frequency_penalty"] == 0.1 and request.kwargs["stop"] == ["XYZ"]
    assert request.kwargs["messages"] == [{"role": "user", "content": "hello there"}]
    # stats from usage and usage.extra
    assert stats.generated_tokens == 7
    assert stats.prompt_tokens == len(request.prompt_words)
    assert stats.finish_reason == "stop"
    assert stats.decode_s > 0 and stats.prefill_s > 0
    assert engine.last_stats is stats
    assert engine.session_stats.replies == 1
    assert stats.format().startswith("prefill: ")
    assert engine.history == [Message("user", "hello there"), Message("assistant", text)]


def test_tok_per_s_come_from_usage_extra(
    mlc_stand_in, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    fixed = {
        "prefill_tokens": 10,
        "decode_tokens": 4,
        "prefill_tokens_per_s": 250.0,
        "decode_tokens_per_s": 40.0,
        "ttft_s": 0.05,
    }
    original = mlc_stand_in.MLCEngine._usage

    def usage(self, request, generated, start, first):  # type: ignore[no-untyped-def]
        result = original(self, request, generated, start, first)
        result.extra.update(fixed)
        return result

    monkeypatch.setattr(mlc_stand_in.MLCEngine, "_usage", usage)
    _, _, stats = _run(engine.chat("one two", SamplingParams(max_tokens=5)))
    assert stats.generated_tokens == 5
    assert stats.finish_reason == "length"
    assert stats.prompt_tokens == 10
    assert stats.prefill_tok_s == pytest.approx(250.0)
    assert stats.decode_tok_s == pytest.approx(40.0)
    assert stats.time_to_first_token_s == pytest.approx(0.05)
    assert stats.format() == "prefill: 250.0 tok/s, decode: 40.0 tok/s"


def test_history_and_system_prompt_are_sent_each_turn(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    engine.set_system_prompt("Be brief.")
    _run(engine.chat("first"))
    _run(engine.chat("second"))
    messages = engine._engine.requests[-1].kwargs["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == "Be brief."
    assert messages[2]["content"] == "You said: first w0 w1 w2"
    engine.reset()
    assert engine.history == []
    _run(engine.chat("third"))
    assert [m["role"] for m in engine._engine.requests[-1].kwargs["messages"]] == ["system", "user"]
    engine.set_system_prompt(None)  # keeps the conversation, like the TVM engine
    _run(engine.chat("fourth"))
    assert [m["role"] for m in engine._engine.requests[-1].kwargs["messages"]] == [
        "user",
        "assistant",
        "user",
    ]


def test_load_history(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    engine.load_history([Message("system", "S"), Message("user", "a"), Message("assistant", "b")])
    assert engine.system_prompt == "S"
    _run(engine.chat("c"))
    roles = [m["role"] for m in engine._engine.requests[-1].kwargs["messages"]]
    assert roles == ["system", "user", "assistant", "user"]


def test_cancel_from_another_thread_stops_within_a_chunk(
    mlc_stand_in, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mlc_stand_in, "CHUNK_DELAY_S", 0.02)
    engine = MLCLLMEngine(model_dir)
    params = SamplingParams(max_tokens=30)
    received: list[str] = []
    stats_box: list[ReplyStats] = []

    def worker() -> None:
        for event in engine.generate([1, 2, 3], params, ignore_eos=True):
            if isinstance(event, TextDelta):
                received.append(event.text)
                if len(received) == 3:
                    engine.cancel()
            elif isinstance(event, ReplyStats):
                stats_box.append(event)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert len(received) in (3, 4)  # at most one more chunk after cancel()
    assert stats_box[0].finish_reason == "cancelled"
    request = engine._engine.requests[-1]
    assert request.closed  # the stream was closed (MLC aborts the request on close)
    assert request.request_id in engine._engine.aborted
    # the engine is usable again afterwards
    text, _, stats = _run(engine.chat("again"))
    assert text.startswith("You said: again") and stats.finish_reason == "stop"


def test_cancel_chat_keeps_partial_reply_in_history(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    events = engine.chat("tell me more")
    first = next(events)
    assert isinstance(first, TextDelta)
    engine.cancel()
    rest = list(events)
    assert isinstance(rest[-1], ReplyStats) and rest[-1].finish_reason == "cancelled"
    assert not any(isinstance(e, TextDelta) for e in rest)
    assert engine.history[-1] == Message("assistant", first.text)


def test_generate_raw_prompt_ids_with_ignore_eos(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    _text, _, stats = _run(
        engine.generate([5, 6], SamplingParams(temperature=0, max_tokens=8), ignore_eos=True)
    )
    request = engine._engine.requests[-1]
    assert request.kind == "completion" and request.kwargs["prompt"] == [5, 6]
    assert request.kwargs["extra_body"] == {"debug_config": {"ignore_eos": True}}
    assert stats.generated_tokens == 8 and stats.finish_reason == "length"
    assert engine.history == []  # generate() does not touch the conversation
    _, events, _ = _run(engine.generate([5], SamplingParams(max_tokens=4), detokenize=False))
    assert not any(isinstance(e, TextDelta) for e in events)


def test_multibyte_text_passes_through(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    text, _, _ = _run(engine.chat("__unicode__"))
    assert text.startswith("Привет, мир! 日本語 🤖🚀")


def test_context_overflow_drops_oldest_turns(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)  # context window: 40 stand-in tokens
    engine.set_system_prompt("sys")
    for i in range(3):
        _run(engine.chat(f"message number {i} with some words"))
    events = list(engine.chat("last one"))
    trimmed = [e for e in events if isinstance(e, ContextTrimmed)]
    assert len(trimmed) == 1 and trimmed[0].dropped_messages >= 2
    assert trimmed[0].context_window == 40
    assert events.index(trimmed[0]) < next(i for i, e in enumerate(events) if isinstance(e, TextDelta))
    sent = engine._engine.requests[-1].kwargs["messages"]
    assert sent[0] == {"role": "system", "content": "sys"}  # the system prompt stays
    assert sent[-1] == {"role": "user", "content": "last one"}
    assert engine.history[0].role == "user"


def test_prompt_longer_than_context_is_a_clear_error(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    with pytest.raises(LlmchatError, match="context window"):
        list(engine.chat("word " * 100))
    with pytest.raises(LlmchatError, match="prompt"):
        list(engine.generate(list(range(100)), SamplingParams()))


def test_errors_become_llmchat_errors(mlc_stand_in, model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LlmchatError, match="could not load") as err:
        MLCLLMEngine(tmp_path / "missing")
    assert err.value.fix
    with pytest.raises(LlmchatError, match="Device is not found"):
        MLCLLMEngine(model_dir, device="tpu")
    engine = MLCLLMEngine(model_dir)
    with pytest.raises(LlmchatError, match="stand-in failure"):
        list(engine.chat("__fail__"))
    with pytest.raises(LlmchatError, match="temperature"):
        list(engine.chat("x", SamplingParams(temperature=5)))
    # still usable after an error
    text, _, _ = _run(engine.chat("fine"))
    assert text.startswith("You said: fine")


def test_close_terminates_once(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    inner = engine._engine
    engine.close()
    engine.close()
    assert inner.terminated
    with pytest.raises(LlmchatError, match="closed"):
        list(engine.chat("x"))


def test_concurrent_chat_is_refused(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    first = engine.chat("one")
    next(first)
    with pytest.raises(LlmchatError, match="already generating"):
        list(engine.chat("two"))
    list(first)


def test_consumer_stopping_early_closes_the_request(mlc_stand_in, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)
    events = engine.chat("stop reading me")
    first = next(events)
    events.close()  # e.g. the TUI's worker was cancelled
    request = engine._engine.requests[-1]
    assert request.closed
    assert engine.history == [Message("user", "stop reading me"), Message("assistant", first.text)]
    text, _, _ = _run(engine.chat("next"))  # the lock was released
    assert text.startswith("You said: next")


def test_error_in_create_becomes_llmchat_error(
    mlc_stand_in, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    engine = MLCLLMEngine(model_dir)

    def broken_create(**kwargs):  # type: ignore[no-untyped-def]
        raise TypeError("unexpected keyword argument")

    monkeypatch.setattr(engine._engine.chat.completions, "create", broken_create)
    with pytest.raises(LlmchatError, match="MLC-LLM failed"):
        list(engine.chat("x"))
    assert engine.history == []
