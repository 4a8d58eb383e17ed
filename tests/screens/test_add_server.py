"""The models screen's "add a server" under Textual's Pilot, against ``llmchat serve`` (and small real
ASGI servers) on loopback: the form checks the URL and key against the server, saves it, the server is
listed with the local models, chatting with it works, and ``--continue`` reconnects to it."""

from __future__ import annotations

import json
import stat

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from textual.widgets import Button, Input, Select

from app.inference.api import Message, TextDelta
from app.inference.engine.remote import RemoteEngine
from app.inference.store.saved_servers import load_servers, servers_file
from app.screens.add_server import AddServerScreen
from app.screens.chat import ChatScreen
from app.screens.models import ModelsScreen
from app.widgets.chat_log import AssistantMessage, ChatLog, UserMessage
from app.widgets.servers_panel import ServersPanel, ServerTable
from tests.inference.test_saved_servers import asgi_server, closed_port
from tests.screens.conftest import greedy
from tests.screens.test_chat import open_chat, screen_text, send_and_finish, wait_until
from tests.serve.conftest import serving


async def open_form(pilot) -> AddServerScreen:
    app = pilot.app
    await pilot.press("f2")
    await wait_until(pilot, lambda: isinstance(app.screen, ModelsScreen))
    await pilot.press("a")
    await wait_until(pilot, lambda: isinstance(app.screen, AddServerScreen))
    return app.screen


async def fetch(pilot, form: AddServerScreen, url: str, key: str = "") -> None:
    form.query_one("#server-url", Input).value = url
    form.query_one("#server-key", Input).value = key
    form.query_one("#server-key", Input).focus()
    before = form.status_text
    await pilot.press("enter")
    await wait_until(
        pilot,
        lambda: not form.busy and form.status_text != before and not form.status_text.startswith("asking"),
    )


async def test_add_a_server_chat_with_it_and_continue(make_app, tiny_engine, monkeypatch):
    monkeypatch.delenv("LLMCHAT_API_KEY", raising=False)
    tiny_engine.reset()
    model = tiny_engine.info.model_id
    with serving(tiny_engine, api_key="s3cret-key") as served:
        app = make_app()
        async with app.run_test(size=(120, 44)) as pilot:
            await open_chat(pilot)
            local = app.engine
            form = await open_form(pilot)
            save = form.query_one("#save", Button)
            # no key, then a wrong one: the form says so, with the fix, and nothing can be saved yet
            await fetch(pilot, form, served.root)  # /v1 is added to a URL without a path
            assert "needs an API key. (401)" in form.status_text
            assert "fix: enter the server's API key in the API key field" in form.status_text
            assert save.disabled and form.query_one("#server-model", Select).disabled
            await fetch(pilot, form, served.root, "wrong-key")
            assert "refused the API key. (401)" in form.status_text and save.disabled
            await fetch(pilot, form, served.root, "s3cret-key")
            assert "1 model on the server" in form.status_text, form.status_text
            assert f"kept in {servers_file()} (mode 0600" in form.status_text  # no keyring here
            assert form.query_one("#server-model", Select).value == model
            name = form.query_one("#server-name", Input)
            assert name.value == served.root.removeprefix("http://")  # host:port proposed
            # a changed key needs fetching again before saving
            form.query_one("#server-key", Input).value = "s3cret-ke"
            await pilot.pause()
            assert save.disabled
            form.query_one("#server-key", Input).value = "s3cret-key"
            await pilot.pause()
            assert not save.disabled
            name.value = "box"
            await pilot.click("#save")
            await wait_until(
                pilot,
                lambda: (
                    isinstance(app.screen, ModelsScreen) and app.screen.query_one(ServerTable).row_count == 1
                ),
            )
            models = app.screen
            table = models.query_one(ServerTable)
            row = [str(cell) for cell in table.get_row_at(0)]
            assert row == ["box", served.url, model, "in servers.json (0600)"]
            await wait_until(pilot, lambda: models.query_one(ServersPanel).has_focus_within)  # selected
            path = servers_file()
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert json.loads(path.read_text())["servers"] == [
                {
                    "name": "box",
                    "endpoint": served.url,
                    "model": model,
                    "key": "file",
                    "api_key": "s3cret-key",
                }
            ]
            # Enter on the server: the chat's engine becomes the server's model
            await pilot.press("enter")
            await wait_until(
                pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not local, timeout=60
            )
            chat = await open_chat(pilot)
            remote = app.engine
            assert isinstance(remote, RemoteEngine) and remote.saved_as == "server:box"
            assert remote.info.model_id == model and remote.endpoint == served.url
            app.params = greedy(6)
            await send_and_finish(pilot, chat, "Hello!")
            reply = chat.query_one(ChatLog).query_one(AssistantMessage).source
            expected = "".join(
                e.text
                for e in tiny_engine.complete([Message("user", "Hello!")], greedy(6))
                if isinstance(e, TextDelta)
            )
            assert reply == expected and reply
            conversation = app.history.get(app.conversation_id)
            assert conversation.model == "server:box"  # resuming reconnects to the saved server
            conversation_id = app.conversation_id
        # llmchat --continue: the saved server is connected again and the conversation goes on
        again = make_app(continue_last=True, model=None)
        async with again.run_test(size=(120, 44)) as pilot:
            chat = await open_chat(pilot)
            await wait_until(pilot, lambda: len(chat.query_one(ChatLog).query(UserMessage)) == 1)
            assert isinstance(again.engine, RemoteEngine) and again.engine.saved_as == "server:box"
            assert again.conversation_id == conversation_id
            assert [m.content for m in again.engine.history] == ["Hello!", reply]
            # x twice on the server in use: refused; the list is unchanged
            await pilot.press("f2")
            await wait_until(
                pilot,
                lambda: (
                    isinstance(again.screen, ModelsScreen)
                    and again.screen.query_one(ServerTable).row_count == 1
                ),
            )
            again.screen.query_one(ServerTable).focus()
            await pilot.press("x", "x")
            await pilot.pause()
            assert [s.name for s in load_servers()] == ["box"]
    tiny_engine.reset()


async def test_add_server_errors_say_what_to_fix(make_app):
    async def empty(request):
        return JSONResponse({"object": "list", "data": []})

    app = make_app()
    async with app.run_test(size=(120, 44)) as pilot:
        await open_chat(pilot)
        form = await open_form(pilot)
        await fetch(pilot, form, f"http://127.0.0.1:{closed_port()}/v1")
        assert "Cannot reach the server" in form.status_text
        assert "fix: check the URL and that the server is running" in form.status_text
        await fetch(pilot, form, "ftp://example")
        assert "is not an http(s) URL" in form.status_text
        with asgi_server(Starlette(routes=[Route("/v1/models", empty)])) as url:
            await fetch(pilot, form, url)
            assert "offers no model" in form.status_text
            assert "fix: load a model on the server" in form.status_text
            await fetch(pilot, form, url + "/api")
            assert "has no OpenAI API at this URL (404)" in form.status_text
            assert "fix: check the URL (usually ending in /v1)" in form.status_text
        assert form.query_one("#save", Button).disabled
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, ModelsScreen))
        assert not servers_file().exists(), screen_text(app)


async def test_a_saved_server_that_is_down_then_removed(make_app):
    from app.inference.store.saved_servers import save_server
    from app.screens.loading import LoadingScreen

    save_server("gone", f"http://127.0.0.1:{closed_port()}/v1", "m", "k")
    app = make_app()
    async with app.run_test(size=(120, 44)) as pilot:
        await open_chat(pilot)
        local = app.engine
        await pilot.press("f2")
        await wait_until(
            pilot,
            lambda: isinstance(app.screen, ModelsScreen) and app.screen.query_one(ServerTable).row_count == 1,
        )
        app.screen.query_one(ServerTable).focus()
        await pilot.press("enter")  # connecting fails: the loading screen says why and what to do
        await wait_until(pilot, lambda: isinstance(app.screen, LoadingScreen) and app.screen.failed)
        error = str(app.screen.query_one("#loading-error").render())
        assert "Cannot reach the server" in error and "check the URL and that the server is running" in error
        assert app.engine is local  # the chat's engine is unchanged
        await pilot.press("escape")
        await wait_until(pilot, lambda: isinstance(app.screen, ModelsScreen))
        app.screen.query_one(ServerTable).focus()
        await pilot.press("x")
        assert load_servers() != []  # the first x only asks
        await pilot.press("x")
        await wait_until(pilot, lambda: app.screen.query_one(ServerTable).row_count == 0)
        assert load_servers() == []
        assert "add a server" in str(app.screen.query_one("#servers-heading").render())
