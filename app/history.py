"""Saved conversations: stdlib sqlite3 in ``data_dir()/history.sqlite3`` (WAL).

Every message is committed on its own as soon as it is complete, so killing the app mid-reply loses
at most that reply. A conversation row is created with its first message.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from app import paths
from app.errors import LlmchatError
from app.inference.api import Message

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    system_prompt TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    stats TEXT,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


@dataclass(frozen=True)
class Conversation:
    """One saved conversation (without its messages)."""

    id: int
    title: str
    model: str
    system_prompt: str | None
    created_at: float
    updated_at: float
    message_count: int = 0


def default_path() -> Path:
    """Where the history lives: ``data_dir()/history.sqlite3``."""
    return paths.data_dir() / "history.sqlite3"


class HistoryStore:
    """Conversations and their messages in one SQLite file; safe to call from any thread."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except (sqlite3.Error, OSError) as err:
            raise LlmchatError(
                f"Cannot open the chat history {self.path}: {err}.",
                "check that the data directory is writable, or set LLMCHAT_DATA_DIR to another directory",
            ) from err
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writing -------------------------------------------------------------------------------
    def new_conversation(self, model: str, system_prompt: str | None = None, title: str = "") -> int:
        """Create an empty conversation and return its id."""
        now = time.time()
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO conversations(title, model, system_prompt, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (title, model, system_prompt, now, now),
            )
            return int(cur.lastrowid or 0)

    def add_message(self, conversation_id: int, role: str, content: str, stats: dict | None = None) -> int:
        """Append one complete message (committed at once); the first user message titles the chat."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN")
            try:
                cur = self._db.execute(
                    "INSERT INTO messages(conversation_id, role, content, stats, created_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (conversation_id, role, content, json.dumps(stats) if stats else None, now),
                )
                self._db.execute(
                    "UPDATE conversations SET updated_at = ?,"
                    " title = CASE WHEN title = '' AND ? = 'user' THEN ? ELSE title END WHERE id = ?",
                    (now, role, _title(content), conversation_id),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return int(cur.lastrowid or 0)

    def set_system_prompt(self, conversation_id: int, text: str | None) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conversation_id)
            )

    def delete(self, conversation_id: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # -- reading -------------------------------------------------------------------------------
    def get(self, conversation_id: int) -> Conversation | None:
        rows = self._conversations("WHERE c.id = ?", (conversation_id,))
        return rows[0] if rows else None

    def list(self, limit: int = 100) -> list[Conversation]:
        """Conversations with at least one message, most recently updated first."""
        return self._conversations("WHERE n > 0 ORDER BY c.updated_at DESC, c.id DESC LIMIT ?", (limit,))

    def latest(self) -> Conversation | None:
        rows = self.list(limit=1)
        return rows[0] if rows else None

    def messages(self, conversation_id: int) -> list[Message]:
        with self._lock:
            rows = self._db.execute(
                "SELECT role, content FROM messages WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            ).fetchall()
        return [Message(role, content) for role, content in rows]

    def _conversations(self, where: str, params: tuple) -> list[Conversation]:
        query = (
            "SELECT c.id, c.title, c.model, c.system_prompt, c.created_at, c.updated_at,"
            " (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n"
            f" FROM conversations c {where}"
        )
        with self._lock:
            rows = self._db.execute(query, params).fetchall()
        return [Conversation(*row) for row in rows]

    # -- export --------------------------------------------------------------------------------
    def to_markdown(self, conversation_id: int) -> str:
        """The conversation as a Markdown document."""
        conversation = self.get(conversation_id)
        if conversation is None:
            raise LlmchatError(f"There is no conversation {conversation_id}.", "type /history to list them")
        started = datetime.fromtimestamp(conversation.created_at).strftime("%Y-%m-%d %H:%M")
        parts = [f"# {conversation.title or 'Conversation'}", "", f"*{conversation.model} · {started}*", ""]
        if conversation.system_prompt:
            parts += ["## System", "", conversation.system_prompt, ""]
        names = {"user": "You", "assistant": "Assistant", "system": "System"}
        for message in self.messages(conversation_id):
            parts += [f"## {names[message.role]}", "", message.content.rstrip(), ""]
        return "\n".join(parts)

    def export_markdown(self, conversation_id: int, path: Path) -> Path:
        """Write the conversation to ``path`` (temp file, then rename) and return the path."""
        text = self.to_markdown(conversation_id)
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / f"llmchat-conversation-{conversation_id}.md"
        tmp = path.with_name(path.name + ".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            fix = "give another path: /export PATH"
            raise LlmchatError(f"Cannot write {path}: {err.strerror}.", fix) from err
        return path


def _title(text: str, width: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"
