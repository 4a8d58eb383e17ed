"""Saved conversations: stdlib sqlite3 in ``data_dir()/history.sqlite3`` (WAL).

Every message is committed on its own as soon as it is complete, so killing the app mid-reply loses
at most that reply. A conversation row is created with its first message.

A damaged file (random bytes written into it, a truncated header, something that is not SQLite)
is found by an integrity check at open, or by any later query that trips over it: the file is moved
aside (``history.sqlite3.damaged-<time>``), a new empty history takes its place and ``notice`` says
so; the failing call raises ``HistoryDamaged`` (an ``LlmchatError``), so the chat keeps running.
Every other ``sqlite3`` error also becomes an ``LlmchatError``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from app import paths
from app.errors import LlmchatError
from app.inference.api import Message

#: sqlite's result codes of a damaged file: SQLITE_CORRUPT, SQLITE_NOTADB
_DAMAGE_CODES = (11, 26)


class HistoryDamaged(LlmchatError):
    """The history file was damaged: it has been moved aside and a new one started."""


def _is_damage(err: sqlite3.DatabaseError) -> bool:
    code = getattr(err, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGE_CODES
    text = str(err).lower()
    return "malformed" in text or "not a database" in text


def _guarded(method):
    """Run a store method; sqlite errors become LlmchatErrors (damage: moved aside, HistoryDamaged)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.DatabaseError as err:
            if _is_damage(err):
                raise self._recover(err) from err
            raise LlmchatError(
                f"The chat history {self.path} cannot be used: {err}.",
                "check that the data directory is writable and the disk not full",
            ) from err

    return wrapper


#: the schema's history, in order: migration N takes a file of version N - 1 (``PRAGMA
#: user_version``; 0: a new file) to version N. Append only: a released migration never changes
#: (tests/test_history_migrations.py opens a file of every earlier version).
MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        """
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
""",
    ),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def migrate(db: sqlite3.Connection, migrations: list[tuple[int, str]] | None = None) -> int:
    """Bring ``db`` to the newest schema: each migration after the file's ``user_version``, in
    order, in a transaction of its own with the version it reaches (an interrupted upgrade leaves
    the file at the last version completed). The version before. A file of a newer llmchat is
    refused, never changed."""
    migrations = MIGRATIONS if migrations is None else migrations
    version = refuse_newer(db, migrations[-1][0])
    for target, script in migrations:
        if target <= version:
            continue
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement in _statements(script):
                db.execute(statement)
            db.execute(f"PRAGMA user_version={int(target)}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    return version


def refuse_newer(db: sqlite3.Connection, newest: int = SCHEMA_VERSION) -> int:
    """The file's schema version; an LlmchatError when a newer llmchat wrote it."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    if version > newest:
        raise LlmchatError(
            f"The chat history {db.execute('PRAGMA database_list').fetchone()[2]} was written by a newer "
            f"llmchat (schema version {version}; this one reads up to {newest}).",
            "update llmchat, or set LLMCHAT_DATA_DIR to another directory to start a new history",
        )
    return version


def _statements(script: str) -> list[str]:
    """The statements of a migration script (``executescript`` would commit the transaction)."""
    out, current = [], ""
    for line in script.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            out.append(current.strip())
            current = ""
    if current.strip():
        out.append(current.strip())
    return out


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
        #: what the user should be told about the history (it was damaged and moved aside), or None
        self.notice: str | None = None
        #: how many times a damaged file was replaced by a new one (ids from before are gone)
        self.generation = 0
        self._lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            from app.errors import os_error

            raise os_error(
                err,
                f"Cannot create the directory of the chat history {self.path}",
                "set LLMCHAT_DATA_DIR to a writable directory",
            ) from err
        try:
            self._db = self._connect()
        except sqlite3.DatabaseError as err:
            if not _is_damage(err):
                raise self._open_error(err) from err
            self._move_aside(err)
            try:
                self._db = self._connect()
            except sqlite3.DatabaseError as err2:
                raise self._open_error(err2) from err2

    def _connect(self) -> sqlite3.Connection:
        """Open the file, check its integrity and create the schema (DatabaseError when damaged)."""
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            refuse_newer(db)  # before anything writes to the file
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            problems = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                err = sqlite3.DatabaseError(f"database disk image is malformed: {'; '.join(problems[:3])}")
                err.sqlite_errorcode = 11
                raise err
            migrate(db)
        except BaseException:
            db.close()
            raise
        return db

    def _open_error(self, err: sqlite3.Error) -> LlmchatError:
        return LlmchatError(
            f"Cannot open the chat history {self.path}: {err}.",
            "check that the data directory is writable, or set LLMCHAT_DATA_DIR to another directory",
        )

    def _move_aside(self, err: BaseException) -> Path:
        """Rename the damaged file (and its -wal/-shm) out of the way; set ``notice``."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.damaged-{stamp}")
        n = 1
        while aside.exists():
            n += 1
            aside = self.path.with_name(f"{self.path.name}.damaged-{stamp}-{n}")
        for suffix in ("", "-wal", "-shm", "-journal"):
            src = Path(str(self.path) + suffix)
            with contextlib.suppress(FileNotFoundError):
                os.replace(src, Path(str(aside) + suffix))
        self.notice = (
            f"The chat history was damaged ({err}): it was moved to {aside.name} and a new, "
            "empty history started. The conversation on screen is saved in the new one."
        )
        return aside

    def _recover(self, err: sqlite3.DatabaseError) -> HistoryDamaged:
        """A query found damage: move the file aside, open a fresh one; the error to raise."""
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._move_aside(err)
            self.generation += 1
            try:
                self._db = self._connect()
            except sqlite3.DatabaseError as err2:
                return HistoryDamaged(
                    f"The chat history {self.path} is damaged and a new one cannot be created: {err2}.",
                    "set LLMCHAT_DATA_DIR to another directory",
                )
        return HistoryDamaged(
            self.notice or "The chat history was damaged.",
            "nothing to do: new messages are saved in the new history",
        )

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._db.close()

    # -- writing -------------------------------------------------------------------------------
    @_guarded
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

    @_guarded
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
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                raise
            return int(cur.lastrowid or 0)

    @_guarded
    def set_system_prompt(self, conversation_id: int, text: str | None) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conversation_id)
            )

    @_guarded
    def delete(self, conversation_id: int) -> None:
        with self._lock:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    @_guarded
    def delete_message(self, message_id: int) -> None:
        """Remove one message (a user turn whose reply failed: not left as an orphan)."""
        with self._lock:
            self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    @_guarded
    def drop_unanswered_tail(self, conversation_id: int) -> list[Message]:
        """Remove the user turns at the end of a conversation that never got a reply (the app was
        killed mid-reply) and return them: templates that require alternating roles would fail
        on every later message otherwise."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, role, content FROM messages WHERE conversation_id = ? ORDER BY id DESC",
                (conversation_id,),
            ).fetchall()
            dropped = []
            for row_id, role, content in rows:
                if role != "user":
                    break
                dropped.append((row_id, content))
            if dropped:
                self._db.executemany("DELETE FROM messages WHERE id = ?", [(i,) for i, _ in dropped])
        return [Message("user", content) for _, content in reversed(dropped)]

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

    @_guarded
    def messages(self, conversation_id: int) -> list[Message]:
        with self._lock:
            rows = self._db.execute(
                "SELECT role, content FROM messages WHERE conversation_id = ? ORDER BY id",
                (conversation_id,),
            ).fetchall()
        return [Message(role, content) for role, content in rows]

    @_guarded
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
