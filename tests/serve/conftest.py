"""``llmchat serve``'s app on a real uvicorn in a thread, on a loopback port of its own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class Served:
    url: str  # base URL of the API: http://127.0.0.1:PORT/v1
    state: Any  # app.serve.server.ServerState

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")


@contextlib.contextmanager
def serving(engine: Any, **options: Any) -> Iterator[Served]:
    """Serve ``engine`` with ``create_app(engine, **options)`` until the block ends."""
    import uvicorn

    from app.serve.run import bind, url_of
    from app.serve.server import create_app

    app = create_app(engine, **options)
    sock = bind("127.0.0.1", 0)  # listening already: early connections wait in the backlog
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield Served(url_of(sock) + "/v1", app.state.llmchat)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture
def engine(tiny_engine: Any) -> Iterator[Any]:
    """The shared tiny CPU engine, its conversation and KV cache cleared."""
    tiny_engine.set_system_prompt(None)
    tiny_engine.reset()
    yield tiny_engine
    tiny_engine.set_system_prompt(None)
    tiny_engine.reset()


class DecodeGate:
    """Holds the engine at one decode step until released (``reached`` says it is there)."""

    def __init__(self, engine: Any, at_step: int) -> None:
        self.runtime = engine.runtime
        self.at_step = at_step
        self.steps = 0
        self.steps_after_release = 0
        self.reached = threading.Event()
        self.release = threading.Event()
        self._real = self.runtime.decode

    def __enter__(self) -> DecodeGate:
        def decode(token: int) -> Any:
            self.steps += 1
            if self.release.is_set():
                self.steps_after_release += 1
            if self.steps == self.at_step:
                self.reached.set()
                assert self.release.wait(30), "the test never released the gate"
            return self._real(token)

        self.runtime.decode = decode
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release.set()
        del self.runtime.decode
