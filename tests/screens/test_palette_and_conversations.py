"""The command palette runs the chat commands and switches to a saved server; saved conversations are
listed and resumed."""

from __future__ import annotations

from textual.command import CommandList, CommandPalette

from app.inference.api import Message, TextDelta
from app.inference.engine.remote import RemoteEngine
from app.inference.store.saved_servers import save_server, servers_file
from app.screens.chat import ChatScreen
from app.screens.conversations import ConversationsScreen
from app.widgets.chat_log import AssistantMessage, ChatLog, Notice, UserMessage
from app.widgets.prompt_input import PromptInput
from tests.inference.test_saved_servers import closed_port
from tests.screens.conftest import greedy
from tests.screens.test_chat import open_chat, send_and_finish, wait_until
from tests.serve.conftest import serving


def highlighted_command(app) -> str | None:
    """The command the open palette would run on Enter: its highlighted search result."""
    if not isinstance(app.screen, CommandPalette):
        return None
    results = app.screen.query_one(CommandList)
    if results.highlighted is None:
        return None
    return str(results.get_option_at_index(results.highlighted).hit.text)


async def test_palette_runs_stats_and_prefills_set(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"/stats")
        await wait_until(pilot, lambda: highlighted_command(app) == "/stats")  # the search has answered
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.screen is chat and len(chat.query(Notice)) == 1)
        assert "memory in use" in chat.query_one(Notice).source
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"/set")
        await wait_until(pilot, lambda: highlighted_command(app) == "/set")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.screen is chat and chat.query_one(PromptInput).text == "/set ")


def palette_hits(app) -> dict[str, str]:
    """The open palette's results: title -> help."""
    results = app.screen.query_one(CommandList)
    hits = (results.get_option_at_index(i).hit for i in range(results.option_count))
    return {str(hit.text): str(hit.help) for hit in hits}


async def test_palette_switches_the_chat_to_a_saved_server(make_app, tiny_engine, monkeypatch):
    monkeypatch.delenv("LLMCHAT_API_KEY", raising=False)
    model = tiny_engine.info.model_id
    tiny_engine.reset()
    with serving(tiny_engine, api_key="s3cret") as served:
        save_server("box", served.url, model, "s3cret")
        save_server("gpu-box", f"http://127.0.0.1:{closed_port()}/v1", "llama-70b", None)
        app = make_app()
        async with app.run_test(size=(110, 30)) as pilot:
            await open_chat(pilot)
            local = app.engine
            await pilot.press("ctrl+p")
            await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette))
            await pilot.press(*"server:")
            await wait_until(pilot, lambda: "/model server:gpu-box" in palette_hits(app))
            hits = palette_hits(app)
            assert hits["/model server:box"] == f"chat with {model} on the saved server {served.url}"
            assert hits["/model server:gpu-box"].startswith("chat with llama-70b on the saved server")
            await pilot.press(*"box")  # "server:box" also matches server:gpu-box: the closer one first
            await wait_until(pilot, lambda: highlighted_command(app) == "/model server:box")
            await pilot.press("enter")
            await wait_until(
                pilot, lambda: isinstance(app.screen, ChatScreen) and app.engine is not local, timeout=60
            )
            chat = await open_chat(pilot)
            remote = app.engine
            assert isinstance(remote, RemoteEngine) and remote.saved_as == "server:box"
            assert remote.endpoint == served.url and remote.info.model_id == model
            app.params = greedy(6)
            await send_and_finish(pilot, chat, "Hello!")
            reply = chat.query_one(ChatLog).query_one(AssistantMessage).source
            expected = "".join(
                e.text
                for e in tiny_engine.complete([Message("user", "Hello!")], greedy(6))
                if isinstance(e, TextDelta)
            )
            assert reply == expected and reply
            assert app.history.get(app.conversation_id).model == "server:box"
            assert served.state.scheduler.completed == 1
    tiny_engine.reset()


async def test_palette_works_when_the_saved_servers_file_is_damaged(make_app):
    servers_file().parent.mkdir(parents=True, exist_ok=True)
    servers_file().write_text("{not json")
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await pilot.press("ctrl+p")
        await wait_until(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"/stats")
        await wait_until(pilot, lambda: highlighted_command(app) == "/stats")
        assert not any("server:" in title for title in palette_hits(app))
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.screen is chat and len(chat.query(Notice)) == 1)


async def test_conversations_are_listed_and_resumed(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await send_and_finish(pilot, chat, "the first conversation")
        first = app.conversation_id
        await chat.run_command_text("/reset")
        await send_and_finish(pilot, chat, "the second conversation")
        assert app.conversation_id != first
        await chat.run_command_text("/history")
        await wait_until(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        await wait_until(pilot, lambda: app.screen.query_one("OptionList").option_count == 2)
        options = app.screen.query_one("OptionList")
        assert "the second conversation" in str(options.get_option_at_index(0).prompt)
        options.highlighted = 1
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.conversation_id == first and app.screen.query(PromptInput))
        log = app.screen.query_one(ChatLog)
        first_only = ["the first conversation"]
        await wait_until(pilot, lambda: [m.source for m in log.query(UserMessage)] == first_only)
        assert app.engine.history[0].content == "the first conversation"
