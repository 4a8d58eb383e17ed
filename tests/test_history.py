"""The conversation store: real sqlite in a temporary data directory."""

from __future__ import annotations

import os
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


# -- damage ------------------------------------------------------------------------------------
def _filled(path, conversations=30, per=10):
    """A history of ~100 KB (many pages), checkpointed into the main file, closed."""
    store = HistoryStore(path)
    for i in range(conversations):
        cid = store.new_conversation("m")
        for j in range(per):
            store.add_message(cid, "user" if j % 2 == 0 else "assistant", f"message {i} {j} " * 20)
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    return path


def _scribble_middle(path, seed=0, length=8192, start=None):
    """Random bytes written into the file from ``start`` (default: its middle); ``length`` None: to
    its end."""
    import random

    size = path.stat().st_size
    start = size // 2 if start is None else start
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(random.Random(seed).randbytes(length or size - start))


def _aside(path):
    return sorted(path.parent.glob(path.name + ".damaged-*"))


@pytest.mark.parametrize("damage", ["random bytes in the middle", "garbage file", "truncated header"])
def test_damaged_history_is_moved_aside_at_open(tmp_path, damage):
    import random

    db = _filled(tmp_path / "history.sqlite3")
    original = db.read_bytes()
    if damage == "random bytes in the middle":
        _scribble_middle(db)
    elif damage == "garbage file":
        db.write_bytes(random.Random(1).randbytes(5000))
    else:
        os.truncate(db, 50)
    damaged = db.read_bytes()
    store = HistoryStore(db)
    assert store.notice and "moved to" in store.notice
    assert store.list() == []
    cid = store.new_conversation("m")
    store.add_message(cid, "user", "after the damage")
    assert store.messages(cid) == [Message("user", "after the damage")]
    (aside,) = [p for p in _aside(db) if not p.name.endswith(("-wal", "-shm"))]
    assert aside.read_bytes() == damaged != original  # kept for the user, byte for byte
    store.close()


def test_damage_found_mid_session_raises_a_message_and_the_store_goes_on(tmp_path):
    """The file is damaged while the app runs (another process writes, so this one's page cache is
    dropped): the next read raises HistoryDamaged, an LlmchatError; the store is usable again."""
    from app.history import HistoryDamaged

    db = _filled(tmp_path / "history.sqlite3")
    store = HistoryStore(db)
    assert store.notice is None and len(store.list()) == 30
    _scribble_middle(db)
    other = sqlite3.connect(db)
    other.execute("PRAGMA user_version=7")
    other.close()
    with pytest.raises(HistoryDamaged) as err:
        [store.messages(c.id) for c in store.list()]
    assert isinstance(err.value, LlmchatError) and "moved to" in str(err.value)
    assert _aside(db)
    cid = store.new_conversation("m")
    store.add_message(cid, "user", "still saving")
    assert store.latest().id == cid
    store.close()


def test_damaged_history_cli_continue_runs_in_a_real_process(tmp_path):
    """`--continue`-style use in a fresh interpreter over a damaged file: no traceback, rc 0."""
    db = _filled(tmp_path / "history.sqlite3")
    _scribble_middle(db)
    script = textwrap.dedent(f"""
        from app.history import HistoryStore
        store = HistoryStore({str(db)!r})
        print("NOTICE", bool(store.notice), store.latest())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "NOTICE True None" in out.stdout


# -- kill -9 mid-reply ---------------------------------------------------------------------------
def test_sigkill_mid_reply_leaves_a_tail_that_resume_repairs(tmp_path):
    """A real SIGKILL after the user turn was saved and before its reply: the unanswered turn is
    taken out (and returned), so alternating-role templates work again; the rest is untouched."""
    db = tmp_path / "h.sqlite3"
    script = textwrap.dedent(f"""
        import os, signal
        from app.history import HistoryStore
        store = HistoryStore({str(db)!r})
        cid = store.new_conversation("m")
        store.add_message(cid, "user", "first")
        store.add_message(cid, "assistant", "answer")
        store.add_message(cid, "user", "never answered")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -9
    store = HistoryStore(db)
    cid = store.latest().id
    assert store.drop_unanswered_tail(cid) == [Message("user", "never answered")]
    assert store.messages(cid) == [Message("user", "first"), Message("assistant", "answer")]
    assert store.drop_unanswered_tail(cid) == []
    store.close()
