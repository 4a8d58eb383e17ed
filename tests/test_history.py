"""The conversation store: real sqlite in a temporary data directory."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap

import pytest

from app.errors import LlmchatError
from app.history import HistoryStore, default_path
from app.inference.api import Message


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCHAT_DATA_DIR", str(tmp_path / "data"))
    history = HistoryStore()
    yield history
    history.close()


def test_lives_in_the_data_dir_in_wal_mode(store, tmp_path):
    assert store.path == tmp_path / "data" / "history.sqlite3" == default_path()
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_messages_round_trip_and_title_from_first_user_message(store):
    cid = store.new_conversation("tiny", system_prompt="Be terse.")
    store.add_message(cid, "user", "What is   TVM?\nTell me.")
    store.add_message(cid, "assistant", "A compiler.", stats={"decode_tok_s": 10.0})
    assert store.messages(cid) == [
        Message("user", "What is   TVM?\nTell me."),
        Message("assistant", "A compiler."),
    ]
    conversation = store.get(cid)
    assert conversation.title == "What is TVM? Tell me."
    assert conversation.system_prompt == "Be terse."
    assert conversation.message_count == 2


def test_latest_is_the_most_recently_updated_non_empty(store):
    first = store.new_conversation("m")
    store.add_message(first, "user", "one")
    second = store.new_conversation("m")
    store.add_message(second, "user", "two")
    store.new_conversation("m")  # empty: not listed
    assert store.latest().id == second
    store.add_message(first, "assistant", "later")
    assert [c.id for c in store.list()] == [first, second]


def test_each_message_is_durable_without_close(tmp_path):
    """A process killed right after add_message keeps the message (what a mid-reply kill relies on)."""
    db = tmp_path / "h.sqlite3"
    script = textwrap.dedent(
        f"""
        import os
        from app.history import HistoryStore
        store = HistoryStore({str(db)!r})
        cid = store.new_conversation("m")
        store.add_message(cid, "user", "saved before the kill")
        os._exit(9)  # no close, no cleanup
        """
    )
    assert subprocess.run([sys.executable, "-c", script]).returncode == 9
    reopened = HistoryStore(db)
    assert reopened.messages(reopened.latest().id) == [Message("user", "saved before the kill")]


def test_export_markdown(store, tmp_path):
    cid = store.new_conversation("tiny", system_prompt="Be terse.")
    store.add_message(cid, "user", "Show code")
    store.add_message(cid, "assistant", "```python\nprint(1)\n```")
    out = store.export_markdown(cid, tmp_path / "out" / "chat.md")
    text = out.read_text()
    assert text.startswith("# Show code")
    assert "## System\n\nBe terse." in text
    assert "## You\n\nShow code" in text
    assert "## Assistant\n\n```python\nprint(1)\n```" in text
    assert not list(out.parent.glob("*.tmp"))
    into_dir = store.export_markdown(cid, tmp_path / "out")
    assert into_dir.name == f"llmchat-conversation-{cid}.md"


def test_export_errors_are_readable(store, tmp_path):
    with pytest.raises(LlmchatError, match="no conversation"):
        store.export_markdown(999, tmp_path / "x.md")
    cid = store.new_conversation("m")
    store.add_message(cid, "user", "hi")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LlmchatError) as info:
        store.export_markdown(cid, blocker / "sub" / "x.md")
    assert info.value.fix


def test_unwritable_location_is_a_readable_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LlmchatError) as info:
        HistoryStore(blocker / "history.sqlite3")
    assert "LLMCHAT_DATA_DIR" in info.value.fix
