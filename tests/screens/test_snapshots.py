"""Snapshot tests (pytest-textual-snapshot) of the chat, models, first-run and hardware screens.

Deterministic by construction: fixed terminal sizes, a fixed hardware report from a fixture sysroot,
the built-in catalog, a resumed conversation (no timings) and a fixed model name and device.
Update after an intended change with ``pytest tests/screens/test_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

from pathlib import Path

from app.chat_app import LlmchatApp, StartOptions
from app.history import HistoryStore
from app.screens.chat import ChatScreen
from app.screens.first_run import FirstRunScreen
from app.screens.hardware import HardwareScreen
from app.screens.models import ModelsScreen
from app.widgets.catalog_table import CatalogTable
from app.widgets.chat_log import AssistantMessage
from tests.screens.conftest import SharedEngine, StandInServices, probe_fixture
from tests.screens.test_chat import wait_until

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


async def _settled(pilot) -> None:
    """Wait until the app has nothing left to do: its workers (the catalog's fit, the hardware
    report) finished, its animations done and its messages processed; not for time to pass."""
    await pilot.app.workers.wait_for_complete()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


def _no_models_services(probe_name: str) -> StandInServices:
    return StandInServices(
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
    services = StandInServices(
        load_engine=lambda model, device, progress: engine, installed_model_path=lambda m: Path("/models")
    )
    app = LlmchatApp(StartOptions(continue_last=True, device="cpu"), services)

    async def ready(pilot):
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, ChatScreen))
        await wait_until(pilot, lambda: len(pilot.app.screen.query(AssistantMessage)) == 2)
        await _settled(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=ready)


def test_models_screen(snap_compare):
    """The catalog with fit badges for an RX 7900 XTX (20 GiB budget)."""
    app = LlmchatApp(StartOptions(), _no_models_services("amd-rx7900xtx"))

    async def ready(pilot):
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, FirstRunScreen))
        pilot.app.action_open_models()
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, ModelsScreen))
        await wait_until(pilot, lambda: pilot.app.screen.query_one(CatalogTable).row_count > 0)
        await _settled(pilot)

    assert snap_compare(app, terminal_size=(100, 40), run_before=ready)


def test_first_run_screen_on_a_steam_deck(snap_compare):
    """The guided start: Steam Deck hardware summary, catalog, default model preselected."""
    app = LlmchatApp(StartOptions(), _no_models_services("amd-vangogh"))

    async def ready(pilot):
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, FirstRunScreen))
        await wait_until(pilot, lambda: pilot.app.screen.query_one(CatalogTable).row_count > 0)
        await _settled(pilot)

    assert snap_compare(app, terminal_size=(100, 44), run_before=ready)


def test_hardware_screen_on_a_steam_deck(snap_compare):
    """The doctor report of the Steam Deck fixture."""
    app = LlmchatApp(StartOptions(), _no_models_services("amd-vangogh"))

    async def ready(pilot):
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, FirstRunScreen))
        pilot.app.action_open_hardware()
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, HardwareScreen))
        report = lambda: str(pilot.app.screen.query_one("#hardware-report").render())  # noqa: E731
        await wait_until(pilot, lambda: "Steam Deck" in report())
        await _settled(pilot)

    assert snap_compare(app, terminal_size=(100, 40), run_before=ready)
