"""The command palette runs the chat commands; saved conversations are listed and resumed."""

from __future__ import annotations

from textual.command import CommandList, CommandPalette

from app.screens.conversations import ConversationsScreen
from app.widgets.chat_log import ChatLog, Notice, UserMessage
from app.widgets.prompt_input import PromptInput
from tests.screens.test_chat import open_chat, send_and_finish, wait_until


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
