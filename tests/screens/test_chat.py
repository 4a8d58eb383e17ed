"""Pilot tests of the chat screen with a real engine."""

from __future__ import annotations

import asyncio

from app.screens.chat import ChatScreen
from app.widgets.chat_log import AssistantMessage, ChatLog, Notice, StatsLine, UserMessage
from app.widgets.prompt_input import PromptInput


async def wait_until(pilot, predicate, timeout: float = 30.0) -> None:
    """Poll the app until ``predicate()`` is true (a single pause is flaky)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


async def open_chat(pilot) -> ChatScreen:
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
    return pilot.app.screen


async def type_and_send(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.load_text(text)
    prompt.focus()
    await pilot.press("enter")


async def test_message_streams_with_live_and_final_stats(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await type_and_send(pilot, "Hello there")
        await wait_until(pilot, lambda: chat.replying)
        log = chat.query_one(ChatLog)
        reply = log.query_one(AssistantMessage)
        stats = log.query_one(StatsLine)
        await wait_until(pilot, lambda: "tok/s" in str(stats.render()))
        assert stats.has_class("live")
        await wait_until(pilot, lambda: not chat.replying)
        assert log.query_one(UserMessage).source == "Hello there"
        assert reply.source.strip()
        final = str(stats.render())
        assert "prefill:" in final and "decode:" in final and "TTFT" in final
        assert not stats.has_class("live")
        # saved: user message and the reply
        messages = app.history.messages(app.conversation_id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].content == reply.source
