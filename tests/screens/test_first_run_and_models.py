"""First run, the models screen and load errors — with real downloads from the loopback hub
(tests/hub_server.py), the real catalog (plus the test entry), real compile and load of a tiny model."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from app.chat_app import LlmchatApp, StartOptions
from app.errors import LlmchatError
from app.inference.store.catalog import installed_model_path, list_installed
from app.screens.chat import ChatScreen
from app.screens.first_run import FirstRunScreen
from app.screens.loading import LoadingScreen
from app.screens.models import ModelsScreen
from app.widgets.catalog_table import CatalogTable
from app.widgets.chat_log import AssistantMessage, ChatLog
from tests.hub_server import TINY_ID, TINY_REPO, HubServer, use_hub
from tests.screens.conftest import StandInServices, greedy, probe_fixture
from tests.screens.test_chat import open_chat, screen_text, type_and_send, wait_until

SHARD = "params_shard_0.bin"


def model_files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file()}


@pytest.fixture
def hub(tmp_path, monkeypatch, chat_model_dir):
    """The hub serves the tiny chat model as TINY_REPO (catalog id TINY_ID); fresh data/cache dirs."""
    server = HubServer().start()
    server.add_repo(TINY_REPO, model_files(chat_model_dir))
    use_hub(server, tmp_path, monkeypatch)
    yield server
    server.release_stall.set()
    server.stop()


def real_services(**overrides) -> StandInServices:
    return StandInServices(default_model_id=TINY_ID, **{"probe": probe_fixture("amd-vangogh"), **overrides})


async def test_first_run_guides_from_hardware_to_download_compile_and_chat(hub):
    events = []

    def load_engine(model, device, progress):
        from app.inference.engine.tvm_engine import load_engine as real_load_engine

        def record(event):
            events.append(event)
            progress(event)

        return real_load_engine(model, device=device, progress=record)

    app = LlmchatApp(StartOptions(device="cpu"), real_services(load_engine=load_engine))
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, FirstRunScreen))
        screen = app.screen
        table = screen.query_one(CatalogTable)
        await wait_until(pilot, lambda: table.row_count > 0)
        summary = str(screen.query_one("#hardware-summary").render())
        assert "Steam Deck" in summary and "vulkan" in summary and "Memory budget" in summary
        assert table.selected_id == TINY_ID  # the default model, preselected
        assert table.row_count > 1  # the whole catalog with fit badges
        fit_cells = [str(table.get_row_at(i)[4]) for i in range(table.row_count)]
        assert set(fit_cells) <= {"fits", "tight", "does not fit"} and "fits" in fit_cells
        # the estimated decode speed on this Deck (its bandwidth ÷ the weights): the 8B one is slow
        speeds = {
            str(table.coordinate_to_cell_key((i, 0))[0].value): str(table.get_row_at(i)[5])
            for i in range(table.row_count)
        }
        assert all(re.fullmatch(r"~[\d.,]+ tok/s(\nslow)?", cell) for cell in speeds.values()), speeds
        assert speeds["llama-3.1-8b-instruct"].endswith("slow")
        assert not speeds["smollm2-135m-instruct"].endswith("slow")
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, (LoadingScreen, ChatScreen)))
        loading = app.screen
        assert isinstance(loading, LoadingScreen)
        await wait_until(pilot, lambda: isinstance(app.screen, ChatScreen) or loading.failed, timeout=180)
        assert not loading.failed, screen_text(app)
        stages = "\n".join(loading.stages)
        assert "Downloading" in stages
        assert any(e.stage == "compile" for e in events), events
        assert "Compiling" in stages and "Loading" in stages
        assert installed_model_path(TINY_ID) is not None
        chat = await open_chat(pilot)
        app.params = greedy(8)
        await type_and_send(pilot, "Hello")
        await wait_until(pilot, lambda: chat.engine.session_stats.replies == 1 and not chat.replying)
        assert chat.query_one(ChatLog).query_one(AssistantMessage).source


async def test_models_screen_download_progress_cancel_then_install_and_remove(hub):
    hub.faults.stall_after[SHARD] = 50_000
    app = LlmchatApp(StartOptions(device="cpu"), real_services())
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, FirstRunScreen))
        app.action_open_models()
        await wait_until(pilot, lambda: app.screen.query_one(CatalogTable).row_count > 0)
        screen = app.screen
        assert isinstance(screen, ModelsScreen)
        table = screen.query_one(CatalogTable)
        table.select(TINY_ID)
        await pilot.press("d")
        progress = screen.query_one("#download-progress")
        await wait_until(pilot, lambda: progress.display and screen.downloading == TINY_ID)
        await wait_until(pilot, lambda: hub.counters.bytes_sent.get(SHARD, 0) >= 50_000)
        await pilot.press("c")
        await wait_until(pilot, lambda: screen.downloading is None, timeout=30)
        status = str(screen.query_one("#models-status").render())
        assert "cancelled" in status
        assert list_installed() == []
        hub.faults.stall_after.clear()
        hub.release_stall.set()
        await pilot.press("d")
        await wait_until(pilot, lambda: not screen.downloading and TINY_ID in list_installed(), timeout=60)
        await wait_until(pilot, lambda: "✓ yes" in str(table.get_row(TINY_ID)[6]))
        # the library step after the weights: no prebuilt library is published for this model
        status = str(screen.query_one("#models-status").render())
        assert "installed" in status and "compiles here on first use" in status
        await pilot.press("x")
        assert TINY_ID in list_installed()  # the first x only asks
        await pilot.press("x")
        await wait_until(pilot, lambda: TINY_ID not in list_installed())


async def test_models_screen_shows_a_broken_install_and_d_repairs_it(hub):
    """Issue 19 item 6: a shard deleted from an installed model shows as broken with the fix, and d
    (download) on it fetches only what is missing."""
    from app.inference.store.downloads import download_model

    path = download_model(TINY_ID)
    (path / SHARD).unlink()
    hub.counters.reset()
    app = LlmchatApp(
        StartOptions(device="cpu", model=TINY_ID),
        real_services(
            load_engine=lambda *a, **k: (_ for _ in ()).throw(LlmchatError("not loaded in this test"))
        ),
    )
    async with app.run_test(size=(110, 40)) as pilot:
        app.action_open_models()
        await wait_until(
            pilot,
            lambda: isinstance(app.screen, ModelsScreen) and app.screen.query_one(CatalogTable).row_count > 0,
        )
        screen = app.screen
        table = screen.query_one(CatalogTable)
        await wait_until(pilot, lambda: "broken" in str(table.get_row(TINY_ID)[6]))
        status = str(screen.query_one("#models-status").render())
        assert f"{TINY_ID} is broken: {SHARD} is missing" in status and "d on it fetches" in status
        table.select(TINY_ID)
        await pilot.press("d")
        await wait_until(pilot, lambda: not screen.downloading and (path / SHARD).is_file(), timeout=60)
        await wait_until(pilot, lambda: "✓ yes" in str(table.get_row(TINY_ID)[6]))
        assert hub.counters.gets == {SHARD: 1}


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (LlmchatError("The GPU ran out of memory.", "pick a smaller model"), "pick a smaller model"),
        (RuntimeError("kaboom"), "Unexpected error: RuntimeError: kaboom"),
    ],
)
async def test_load_errors_are_messages_with_the_fix(error, expected):
    def failing(model, device, progress):
        raise error

    services = StandInServices(load_engine=failing, installed_model_path=lambda m: Path("/"))
    app = LlmchatApp(StartOptions(model="some-model", device="cpu"), services)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, LoadingScreen) and app.screen.failed)
        panel = str(app.screen.query_one("#loading-error").render())
        assert expected in panel
        assert "Traceback" not in panel
        assert "retry" in panel


@pytest.mark.parametrize("keys", [["ctrl+q"], ["ctrl+c", "ctrl+c"]])
async def test_quit_mid_download_cancels_it(hub, keys):
    hub.faults.stall_after[SHARD] = 50_000
    app = LlmchatApp(StartOptions(device="cpu"), real_services())
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, FirstRunScreen))
        await wait_until(pilot, lambda: app.screen.query_one(CatalogTable).selected_id == TINY_ID)
        await pilot.press("enter")  # download the default model
        await wait_until(pilot, lambda: hub.counters.bytes_sent.get(SHARD, 0) >= 50_000)
        events = set(app.cancel_events)
        assert events
        await pilot.press(*keys)
        await wait_until(pilot, lambda: not app.is_running, timeout=15)
    assert all(event.is_set() for event in events)
    assert list_installed() == []


async def test_ctrl_c_mid_download_stops_the_download_not_the_app(hub):
    hub.faults.stall_after[SHARD] = 50_000
    app = LlmchatApp(StartOptions(device="cpu"), real_services())
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, FirstRunScreen))
        await wait_until(pilot, lambda: app.screen.query_one(CatalogTable).selected_id == TINY_ID)
        await pilot.press("enter")
        await wait_until(pilot, lambda: hub.counters.bytes_sent.get(SHARD, 0) >= 50_000)
        events = set(app.cancel_events)
        await pilot.press("ctrl+c")
        await wait_until(
            pilot, lambda: isinstance(app.screen, LoadingScreen) and app.screen.failed, timeout=15
        )
        assert app.is_running
        assert all(event.is_set() for event in events)
        assert "cancelled" in str(app.screen.query_one("#loading-error").render())
        assert list_installed() == []
        await pilot.press("ctrl+c")  # nothing running now: quit
        await wait_until(pilot, lambda: not app.is_running, timeout=15)


async def test_probe_errors_are_messages_and_the_catalog_still_shows():
    def failing_probe():
        raise LlmchatError("Cannot read /sys/class/drm: permission denied.", "run llmchat as your own user")

    services = StandInServices(
        probe=failing_probe, list_installed=lambda: [], installed_model_path=lambda m: None
    )
    app = LlmchatApp(StartOptions(), services)
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_until(pilot, lambda: app.screen.query_one(CatalogTable).row_count > 0)
        summary = str(app.screen.query_one("#hardware-summary").render())
        assert "probe failed" in summary and "permission denied" in summary
        app.action_open_hardware()
        await wait_until(pilot, lambda: "fix:" in str(app.screen.query_one("#hardware-report").render()))
        report = str(app.screen.query_one("#hardware-report").render())
        assert "permission denied" in report and "run llmchat as your own user" in report
        assert "Traceback" not in report


@pytest.mark.parametrize("size", [(90, 30), (80, 24), (100, 44)])
async def test_first_run_parts_do_not_overlap(size):
    """#20 item 10: at 90×30 the hint, the catalog and the hardware summary (the Steam Deck's, the
    longest) each have rows of their own above the footer; a smaller terminal scrolls the page."""
    from textual.widgets import Footer

    app = LlmchatApp(StartOptions(device="cpu"), real_services(list_installed=lambda: []))
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, FirstRunScreen))
        table = app.screen.query_one(CatalogTable)
        await wait_until(pilot, lambda: table.row_count > 0)
        await app.workers.wait_for_complete()
        await pilot.pause()
        parts = [
            app.screen.query_one(f"#{name}")
            for name in ("welcome", "hardware-summary", "first-run-catalog", "first-run-status")
        ]
        regions = [part.region for part in parts]
        footer = app.screen.query_one(Footer).region
        assert all(r.height > 0 for r in regions), regions
        assert regions[2].height >= 7  # a few rows of the catalog are always visible
        for a, b in itertools.combinations(regions, 2):
            assert not a.overlaps(b), (a, b)
        page = app.screen.query_one("#first-run")
        if size[1] < 30:  # too short for everything: the page scrolls (nothing is drawn over another)
            assert page.max_scroll_y > 0
        else:
            assert page.max_scroll_y == 0 and not any(r.overlaps(footer) for r in regions)
        assert "Enter: download and chat" in str(parts[3].render())


async def test_the_hardware_screens_refresh_probes_afresh():
    """The start shares one probe (catalog, device, budget); the hardware screen's refresh (r)
    drops it and probes again."""
    calls: list[str] = []
    fixture = probe_fixture("amd-vangogh")

    def probe():
        calls.append("probe")
        return fixture()

    services = StandInServices(
        probe=probe,
        forget_probe=lambda: calls.append("forget"),
        list_installed=lambda: [],
        installed_model_path=lambda m: None,
    )
    app = LlmchatApp(StartOptions(), services)
    async with app.run_test(size=(110, 40)) as pilot:
        await wait_until(pilot, lambda: app.screen.query_one(CatalogTable).row_count > 0)
        app.action_open_hardware()
        await wait_until(pilot, lambda: "Steam Deck" in report_text(app))
        assert calls == ["probe"]  # the hardware screen shows the catalog's probe
        await pilot.press("r")
        await wait_until(pilot, lambda: calls == ["probe", "forget", "probe"])
        await wait_until(pilot, lambda: "Steam Deck" in report_text(app))


def report_text(app) -> str:
    return str(app.screen.query_one("#hardware-report").render())
