"""Servers saved in the models screen: the file (0600, atomic), the key in the keyring or the file,
and connecting — against real ``llmchat serve`` and small real ASGI servers on loopback."""

from __future__ import annotations

import contextlib
import json
import socket
import stat
import threading
from collections.abc import Iterator

import keyring
import pytest
from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.errors import LlmchatError
from app.inference.api import Message, SamplingParams, TextDelta
from app.inference.engine.remote import list_models
from app.inference.store import saved_servers
from app.inference.store.saved_servers import (
    api_key_of,
    load_servers,
    open_server,
    remove_server,
    save_server,
    screen_hints,
    servers_file,
)
from tests.serve.conftest import serving


class MemoryKeyring(KeyringBackend):
    """A keyring backend as the OS ones behave through ``keyring`` (a desktop's Secret Service is not
    running here); it also records what was stored, for the assertions."""

    priority = 5  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[tuple[str, str], str] = {}

    def set_password(self, service: str, username: str, password: str) -> None:
        self.store[(service, username)] = password

    def get_password(self, service: str, username: str) -> str | None:
        return self.store.get((service, username))

    def delete_password(self, service: str, username: str) -> None:
        if (service, username) not in self.store:
            raise PasswordDeleteError("not there")
        del self.store[(service, username)]


@pytest.fixture
def memory_keyring() -> Iterator[MemoryKeyring]:
    ring = MemoryKeyring()
    keyring.set_keyring(ring)
    yield ring


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def asgi_server(app: Starlette) -> Iterator[str]:
    """A small real ASGI app on uvicorn on a loopback port; its base URL."""
    import uvicorn

    from app.serve.run import bind, url_of

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_without_a_keyring_the_key_is_kept_in_a_file_only_its_owner_reads():
    server = save_server(" box ", "127.0.0.1:8000", "m1", "sk-123")
    assert server.name == "box" and server.endpoint == "http://127.0.0.1:8000/v1" and server.key == "file"
    assert server.ref == "server:box"
    path = servers_file()
    assert mode(path) == 0o600
    assert json.loads(path.read_text())["servers"][0]["api_key"] == "sk-123"
    assert api_key_of(load_servers()[0]) == "sk-123"
    assert not list(path.parent.glob(".servers.json*"))  # no temporary file left behind
    # saved again under the same name: replaced, not doubled; no key now
    save_server("box", "http://gpu:9000/v1", "m2", None)
    (only,) = load_servers()
    assert (only.endpoint, only.model, only.key) == ("http://gpu:9000/v1", "m2", "none")
    assert "sk-123" not in path.read_text() and api_key_of(only) is None
    # a file whose mode an editor widened is narrowed again when read
    save_server("other", "http://h:1", "m", "k2")
    path.chmod(0o644)
    load_servers()
    assert mode(path) == 0o600


def test_with_a_keyring_the_key_is_not_written_to_the_file(memory_keyring):
    server = save_server("box", "http://127.0.0.1:8000/v1", "m1", "sk-456")
    assert server.key == "keyring"
    assert "sk-456" not in servers_file().read_text()
    assert memory_keyring.store == {(saved_servers.KEYRING_SERVICE, "box"): "sk-456"}
    assert api_key_of(load_servers()[0]) == "sk-456"
    assert "keyring" in saved_servers.key_store_name()
    remove_server("box")
    assert memory_keyring.store == {} and load_servers() == []
    with pytest.raises(LlmchatError, match="no saved server 'box'"):
        remove_server("box")


def test_a_key_in_a_keyring_that_went_away_is_a_clear_error(memory_keyring):
    server = save_server("box", "http://127.0.0.1:8000/v1", "m1", "sk-456")
    from keyring.backends import fail

    keyring.set_keyring(fail.Keyring())
    with pytest.raises(LlmchatError) as err:
        api_key_of(server)
    assert "keyring" in err.value.problem and "unlock the keyring" in err.value.fix


@pytest.mark.parametrize("text", ["{not json", '{"servers": {}}', '{"servers": [{"name": "a"}]}'])
def test_a_damaged_file_names_itself_and_the_fix(text):
    path = servers_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    with pytest.raises(LlmchatError) as err:
        load_servers()
    assert str(path) in err.value.problem and "delete it" in err.value.fix


def test_names_and_models_are_checked():
    with pytest.raises(LlmchatError, match="needs a name"):
        save_server("  ", "http://h:1", "m", None)
    with pytest.raises(LlmchatError, match="not a usable name"):
        save_server("a\nb", "http://h:1", "m", None)
    with pytest.raises(LlmchatError, match="No model"):
        save_server("a", "http://h:1", "", None)
    with pytest.raises(LlmchatError, match="not an http"):
        save_server("a", "ftp://h:1", "m", None)
    assert not servers_file().exists()


def test_open_a_saved_server_and_chat(tiny_engine, monkeypatch):
    monkeypatch.delenv("LLMCHAT_API_KEY", raising=False)
    tiny_engine.reset()
    greedy = SamplingParams(temperature=0, max_tokens=6, seed=0)
    with serving(tiny_engine, api_key="s3cret") as served:
        save_server("box", served.url, tiny_engine.info.model_id, "s3cret")
        remote = open_server("box")
        try:
            assert remote.saved_as == "server:box" and remote.info.model_id == tiny_engine.info.model_id
            text = "".join(e.text for e in remote.chat("Hello!", greedy) if isinstance(e, TextDelta))
        finally:
            remote.close()
        expected = "".join(
            e.text
            for e in tiny_engine.complete([Message("user", "Hello!")], greedy)
            if isinstance(e, TextDelta)
        )
        assert text == expected and text
        # the key changed on the server's side: the error says where to enter the new one
        save_server("box", served.url, tiny_engine.info.model_id, "old-key")
        with pytest.raises(LlmchatError) as err:
            open_server("box")
        assert "refused the API key" in err.value.problem and "enter the server's API key" in err.value.fix
        # the model is gone from the server
        save_server("box", served.url, "not-there", "s3cret")
        with pytest.raises(LlmchatError) as err:
            open_server("box")
        assert "has no model 'not-there'" in err.value.problem and "pick one of its models" in err.value.fix
    with pytest.raises(LlmchatError, match="no saved server 'nobody'"):
        open_server("nobody")
    tiny_engine.reset()


def test_list_models_errors_name_the_fix():
    hints = screen_hints()
    with pytest.raises(LlmchatError) as err:
        list_models(f"http://127.0.0.1:{closed_port()}/v1", hints=hints)
    assert "Cannot reach the server" in err.value.problem and err.value.fix == hints.url

    async def empty(request):
        return JSONResponse({"object": "list", "data": []})

    with asgi_server(Starlette(routes=[Route("/v1/models", empty)])) as url:
        assert list_models(url) == []  # the form says "no model" with its own fix
        with pytest.raises(LlmchatError) as err:
            list_models(url + "/api", hints=hints)  # no OpenAI API there: Starlette's 404
        assert "has no OpenAI API at this URL (404)" in err.value.problem and err.value.fix == hints.path
