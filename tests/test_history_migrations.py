"""Versioned schema upgrades of the chat history (``PRAGMA user_version`` and ordered migrations,
``app.history.MIGRATIONS``): a file of every earlier schema version opens with its conversations
intact and is brought to the newest; a file of a newer llmchat is refused unchanged; an upgrade
that fails leaves the file at the last version completed.

The earlier schemas are tests/fixtures/history/schema-vN.sql, each copied from its definition in
git history (the commit is named in the file)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from app import history
from app.errors import LlmchatError
from app.history import HistoryStore

SCHEMAS = Path(__file__).resolve().parent / "fixtures" / "history"


def _old_schemas() -> dict[int, str]:
    found = {
        int(re.fullmatch(r"schema-v(\d+)\.sql", p.name).group(1)): p.read_text()
        for p in SCHEMAS.glob("schema-v*.sql")
    }
    return dict(sorted(found.items()))


def _old_file(path: Path, version: int, schema: str) -> None:
    """A history file as llmchat of schema ``version`` left it: one conversation, two messages."""
    db = sqlite3.connect(path)
    db.executescript(schema)
    db.execute(
        "INSERT INTO conversations (id, title, model, system_prompt, created_at, updated_at) "
        "VALUES (7, 'llamas', 'smollm2-135m-instruct', 'Be brief.', 100.0, 101.0)"
    )
    db.execute(
        "INSERT INTO messages (conversation_id, role, content, stats, created_at) "
        "VALUES (7, 'user', 'Tell me about llamas.', NULL, 100.5)"
    )
    db.execute(
        "INSERT INTO messages (conversation_id, role, content, stats, created_at) "
        "VALUES (7, 'assistant', 'They live in the Andes.', '{\"decode_tok_s\": 12.5}', 101.0)"
    )
    db.execute(f"PRAGMA user_version={version}")
    db.commit()
    db.close()


def test_every_earlier_version_has_its_schema_and_the_migrations_are_ordered():
    versions = [v for v, _ in history.MIGRATIONS]
    assert versions == list(range(1, history.SCHEMA_VERSION + 1))  # 1, 2, ... with no gap
    assert list(_old_schemas()) == versions  # a fixture for every version ever released


@pytest.mark.parametrize("version", list(_old_schemas()))
def test_a_file_of_an_earlier_version_opens_with_its_conversations(tmp_path, version):
    path = tmp_path / "history.sqlite3"
    _old_file(path, version, _old_schemas()[version])
    store = HistoryStore(path)
    try:
        assert store.notice is None  # nothing moved aside
        conv = store.get(7)
        assert conv is not None and conv.title == "llamas" and conv.system_prompt == "Be brief."
        assert [(m.role, m.content) for m in store.messages(7)] == [
            ("user", "Tell me about llamas."),
            ("assistant", "They live in the Andes."),
        ]
        new = store.new_conversation("qwen2.5-0.5b-instruct")
        store.add_message(new, "user", "hi")
        assert [c.id for c in store.list()][:2] == [new, 7]
    finally:
        store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA_VERSION
    db.close()


def test_a_new_file_gets_the_newest_schema(tmp_path):
    path = tmp_path / "history.sqlite3"
    HistoryStore(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA_VERSION
    assert {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")} >= {
        "conversations",
        "messages",
    }
    db.close()


def test_a_file_of_a_newer_llmchat_is_refused_unchanged(tmp_path):
    path = tmp_path / "history.sqlite3"
    _old_file(path, history.SCHEMA_VERSION + 1, history.MIGRATIONS[-1][1])
    before = path.read_bytes()
    with pytest.raises(LlmchatError, match="newer llmchat") as info:
        HistoryStore(path)
    assert "LLMCHAT_DATA_DIR" in info.value.fix
    assert path.read_bytes() == before
    assert not list(tmp_path.glob("*.damaged-*"))  # not taken for damage


def test_migrations_run_in_order_and_a_failing_one_keeps_the_last_version(tmp_path):
    """The mechanism with two later versions: v2 adds a column (filled for old rows), v3 fails
    half-way: the file ends at v2, v3's first statement rolled back."""
    path = tmp_path / "history.sqlite3"
    _old_file(path, 1, _old_schemas()[1])
    v2 = (
        2,
        "ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0;\n"
        "UPDATE conversations SET pinned = 1 WHERE title = 'llamas';",
    )
    v3 = (3, "CREATE TABLE tags (name TEXT);\nINSERT INTO no_such_table VALUES (1);")
    db = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        history.migrate(db, [*history.MIGRATIONS, v2, v3])
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    assert db.execute("SELECT pinned FROM conversations WHERE id = 7").fetchone()[0] == 1
    assert db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'tags'").fetchone()[0] == 0
    assert history.migrate(db, [*history.MIGRATIONS, v2]) == 2  # current: nothing to do
    db.close()
