"""The app over a history that a kill or a damaged file left behind: it repairs, warns and goes on."""

from __future__ import annotations

import sqlite3

from app.history import HistoryStore, default_path
from app.inference.api import Message
from app.screens.conversations import ConversationsScreen
from app.widgets.chat_log import ChatLog, UserMessage
from tests.screens.test_chat import open_chat, send_and_finish, wait_until
from tests.test_history import _aside, _scribble_middle


def _notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_continue_after_a_kill_mid_reply_drops_the_unanswered_turn(make_app, chat_engine):
    store = HistoryStore()
    cid = store.new_conversation(chat_engine.info.model_id)
    store.add_message(cid, "user", "first question")
    store.add_message(cid, "assistant", "first answer")
    store.add_message(cid, "user", "cut off by kill -9")  # what a SIGKILL mid-reply leaves
    store.close()
    app = make_app(continue_last=True, model=None)
    app.params.max_tokens = 4
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        assert [m.role for m in chat.engine.history] == ["user", "assistant"]
        assert any("had no reply" in n for n in _notes(app))
        assert app.prompt_history[-1] == "cut off by kill -9"  # Up brings it back
        await send_and_finish(pilot, chat, "asked again")
        await pilot.press("ctrl+c")
    store = HistoryStore()
    roles = [m.role for m in store.messages(cid)]
    store.close()
    assert roles == ["user", "assistant", "user", "assistant"]


async def test_history_damaged_mid_chat_keeps_the_chat_and_the_conversation(make_app):
    app = make_app()
    app.params.max_tokens = 4
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await send_and_finish(pilot, chat, "before the damage")
        app.history._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        _scribble_middle(default_path(), length=None, start=4096)  # all but the header page
        other = sqlite3.connect(default_path())
        other.execute("PRAGMA user_version=7")
        other.close()
        await chat.run_command_text("/history")
        await wait_until(pilot, lambda: isinstance(app.screen, ConversationsScreen))
        await wait_until(pilot, lambda: any("damaged" in n for n in _notes(app)))
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.screen is chat)
        await send_and_finish(pilot, chat, "after the damage")
        log = chat.query_one(ChatLog)
        assert [m.source for m in log.query(UserMessage)] == ["before the damage", "after the damage"]
        await pilot.press("ctrl+c")
    assert _aside(default_path())
    store = HistoryStore()
    latest = store.latest()
    messages = store.messages(latest.id)
    store.close()
    assert [m.content for m in messages if m.role == "user"] == ["before the damage", "after the damage"]
    assert messages[0] == Message("user", "before the damage") and len(messages) == 4
