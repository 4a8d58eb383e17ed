"""Snapshot tests (pytest-textual-snapshot) of the chat, models, first-run and hardware screens.

Deterministic by construction: fixed terminal sizes, a fixed hardware report from a fixture sysroot,
the built-in catalog, a resumed conversation (no timings) and a fixed model name and device.
Update after an intended change with ``pytest tests/screens/test_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from textual.css.query import NoMatches

from app.chat_app import LlmchatApp, Services, StartOptions
from app.history import HistoryStore
from app.screens.chat import ChatScreen
from app.screens.first_run import FirstRunScreen
from app.screens.hardware import HardwareScreen
from app.screens.models import ModelsScreen
from app.widgets.catalog_table import CatalogTable
from app.widgets.chat_log import AssistantMessage
from tests.screens.conftest import SharedEngine, probe_fixture

SIZE = (100, 32)

CONVERSATION = [
    ("user", "Show me a Python function that adds two numbers."),
    (
        "assistant",
        "Here it is:\n\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```\n\n"
        "Call it as `add(2, 3)`; it returns **5**.",
    ),
    ("user", "And in one line?"),
    ("assistant", "`add = lambda a, b: a + b`"),
]


async def _until(predicate, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not _true(predicate):
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _true(predicate) -> bool:
    try:
        return bool(predicate())
    except NoMatches:  # the screen is not mounted yet
        return False


def _no_models_services(probe_name: str) -> Services:
    return Services(
        probe=probe_fixture(probe_name), list_installed=lambda: [], installed_model_path=lambda m: None
    )


def test_chat_screen(snap_compare, chat_engine):
    """A resumed conversation with a system prompt, Markdown and a code block; the context meter."""
    store = HistoryStore()
    conversation = store.new_conversation("tiny-llama", "You are a concise coding assistant.")
    for role, content in CONVERSATION:
        store.add_message(conversation, role, content)
    store.close()
    engine = SharedEngine(chat_engine, model_id="tiny-llama", model_path="/models/tiny-llama")
    services = Services(
        load_engine=lambda model, device, progress: engine, installed_model_path=lambda m: Path("/models")
    )
    app = LlmchatApp(StartOptions(continue_last=True, device="cpu"), services)

    async def ready(pilot):
        await _until(lambda: isinstance(pilot.app.screen, ChatScreen))
        await _until(lambda: len(pilot.app.screen.query(AssistantMessage)) == 2)
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_models_screen(snap_compare):
    """The catalog with fit badges for an RX 7900 XTX (20 GiB budget)."""
    app = LlmchatApp(StartOptions(), _no_models_services("amd-rx7900xtx"))

    async def ready(pilot):
        await _until(lambda: isinstance(pilot.app.screen, FirstRunScreen))
        pilot.app.action_open_models()
        await _until(lambda: isinstance(pilot.app.screen, ModelsScreen))
        await _until(lambda: pilot.app.screen.query_one(CatalogTable).row_count > 0)
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(100, 40), run_before=ready)


def test_first_run_screen_on_a_steam_deck(snap_compare):
    """The guided start: Steam Deck hardware summary, catalog, default model preselected."""
    app = LlmchatApp(StartOptions(), _no_models_services("amd-vangogh"))

    async def ready(pilot):
        await _until(lambda: isinstance(pilot.app.screen, FirstRunScreen))
        await _until(lambda: pilot.app.screen.query_one(CatalogTable).row_count > 0)
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(100, 44), run_before=ready)


def test_hardware_screen_on_a_steam_deck(snap_compare):
    """The doctor report of the Steam Deck fixture."""
    app = LlmchatApp(StartOptions(), _no_models_services("amd-vangogh"))

    async def ready(pilot):
        await _until(lambda: isinstance(pilot.app.screen, FirstRunScreen))
        pilot.app.action_open_hardware()
        await _until(lambda: isinstance(pilot.app.screen, HardwareScreen))
        await _until(lambda: "Steam Deck" in str(pilot.app.screen.query_one("#hardware-report").render()))
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(100, 40), run_before=ready)
