"""Fixtures for the app's Pilot and snapshot tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from app.chat_app import LlmchatApp, Services, StartOptions
from app.inference.api import (
    EngineInfo,
    Message,
    ReplyStats,
    SamplingParams,
    SessionStats,
    TextDelta,
)


class DevEngine:
    """DEVELOPMENT STAND-IN until the real tiny engine lands (replaced by tiny_engine)."""

    def __init__(self, delay: float = 0.01) -> None:
        self.info = EngineInfo("dev-model", "/models/dev", "cpu", "cpu:0", "q4f16_1", 2048, 1000)
        self.last_stats: ReplyStats | None = None
        self.session_stats = SessionStats()
        self._history: list[Message] = []
        self._cancel = threading.Event()
        self.delay = delay
        self.system: str | None = None

    @property
    def history(self) -> list[Message]:
        return list(self._history)

    def set_system_prompt(self, text):
        self.system = text

    def load_history(self, messages):
        self._history = list(messages)

    def chat(self, user_message: str, params: SamplingParams | None = None) -> Iterator:
        params = params or SamplingParams()
        self._cancel.clear()
        start = time.perf_counter()
        self._history.append(Message("user", user_message))
        words = []
        finish = "length"
        for i in range(params.max_tokens):
            if self._cancel.is_set():
                finish = "cancelled"
                break
            time.sleep(self.delay)
            word = f"w{i} "
            words.append(word)
            yield TextDelta(word)
        end = time.perf_counter()
        stats = ReplyStats(3, len(words), 0.01, 0.01, end - start - 0.01, finish)
        self._history.append(Message("assistant", "".join(words)))
        self.last_stats = stats
        self.session_stats.add(stats)
        yield stats

    def generate(self, prompt_ids, params):
        raise NotImplementedError

    def cancel(self):
        self._cancel.set()

    def reset(self):
        self._history.clear()

    def memory_in_use_bytes(self):
        return 123_000_000

    def close(self):
        pass


@pytest.fixture
def app_dirs(tmp_path, monkeypatch):
    for name in ("DATA", "CACHE", "CONFIG"):
        monkeypatch.setenv(f"LLMCHAT_{name}_DIR", str(tmp_path / name.lower()))
    return tmp_path


@pytest.fixture
def chat_engine():
    return DevEngine()


@pytest.fixture
def make_app(app_dirs, chat_engine):
    def make(engine=None, **options) -> LlmchatApp:
        engine = engine or chat_engine
        services = Services(
            load_engine=lambda model, device, progress: engine,
            list_installed=lambda: [engine.info.model_id],
            installed_model_path=lambda model_id: app_dirs,
        )
        options.setdefault("model", engine.info.model_id)
        return LlmchatApp(StartOptions(**options), services)

    return make
