"""Fixtures for the app's Pilot and snapshot tests: the real tiny engine (random weights, compiled with
TVM for the CPU once per session) and apps wired to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from app.chat_app import LlmchatApp, StartOptions
from app.inference.api import SamplingParams
from app.inference.services import DEFAULT_MODEL_ID, EngineKind, LocalServices, Services

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SYSROOTS = FIXTURES / "sysroots"

#: a context long enough that a greedy reply (random weights never pick the stop token) runs for
#: seconds — the time to press Esc or quit mid-reply
CHAT_CONTEXT = 8192


@pytest.fixture(scope="session")
def chat_model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama", "q4f32_1", context_window=CHAT_CONTEXT)


@pytest.fixture(scope="session")
def chat_engine(chat_model_dir: Path, _session_dirs: Path) -> Iterator[Any]:
    """The real engine on the tiny model (shared by the tests; each app resets it)."""
    from app.inference.engine.tvm_engine import load_engine

    engine = load_engine(chat_model_dir, device="cpu")
    yield engine
    engine.close()


class SharedEngine:
    """The session's engine as an app sees it: everything passes through, except that an app
    quitting does not close it (the next test uses it again)."""

    def __init__(self, engine: Any, **info_overrides: Any) -> None:
        self._engine = engine
        if info_overrides:
            self.info = replace(engine.info, **info_overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        """Kept open for the next test."""


class StandInServices(LocalServices):
    """The app's real services with some methods replaced by the test's own (plain callables taking
    the method's arguments): the tiny engine as the loader, a fixture as the probe. The rest stay
    real, and it is a ``Services`` like the one the app makes."""

    def __init__(
        self,
        *,
        engine: EngineKind = "tvm",
        default_model_id: str = DEFAULT_MODEL_ID,
        **replaced: Callable[..., Any],
    ) -> None:
        super().__init__(engine=engine, default_model_id=default_model_id)
        for name, function in replaced.items():
            if not callable(getattr(LocalServices, name, None)):
                raise TypeError(f"Services has no method {name!r}")
            setattr(self, name, function)


def greedy(max_tokens: int) -> SamplingParams:
    """Deterministic sampling: the tiny model's greedy reply never stops before max_tokens."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)


def probe_fixture(name: str) -> Callable[[], Any]:
    from app.inference.hardware import probe

    return lambda: probe(sysroot=SYSROOTS / name, tvm_runtimes={"vulkan", "cpu"})


@pytest.fixture
def make_app(chat_engine) -> Callable[..., LlmchatApp]:
    """An app whose model loader hands out the already loaded tiny engine."""

    def make(engine: Any = None, services: Services | None = None, **options: Any) -> LlmchatApp:
        engine = engine or SharedEngine(chat_engine)
        engine.cancel()
        engine.reset()
        engine.set_system_prompt(None)
        model_id = engine.info.model_id
        services = services or StandInServices(
            load_engine=lambda model, device, progress: engine,
            list_installed=lambda: [model_id],
            installed_model_path=lambda wanted: Path(engine.info.model_path) if wanted == model_id else None,
            probe=probe_fixture("amd-rx7900xtx"),
        )
        options.setdefault("model", model_id)
        app = LlmchatApp(StartOptions(**options), services)
        app.params = greedy(16)
        return app

    return make
