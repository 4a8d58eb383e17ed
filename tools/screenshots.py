"""The README's pictures, taken from the real app under Textual's Pilot (``App.save_screenshot``):

* ``assets/first-run.svg``  — the first run on a Steam Deck (the probe reads a real Deck's sysfs snapshot
  from ``tests/fixtures/sysroots``): hardware summary, the catalog with fit and speed, the default model
* ``assets/chat.svg``       — a chat with the default model on this machine's CPU, caught mid-reply with
  its live stats line (tokens, tok/s, time to first token) under the finished reply before it
* ``assets/models.svg``     — the models screen for an RX 7900 XTX (fit and estimated speed per model)
* ``assets/hardware.svg``   — the hardware report (``llmchat doctor``) of the Steam Deck

Run ``make screenshots`` (or ``.venv/bin/python tools/screenshots.py [--out DIR] [--only NAME …]``)
after a change to the UI. The chat needs the default model: it is set up on first use as by
``llmchat ask`` (LLMCHAT_DATA_DIR / LLMCHAT_CACHE_DIR choose where). Everything but the chat is
deterministic; the snapshot tests (tests/screens/test_snapshots.py) guard the same screens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.chat_app import LlmchatApp, StartOptions  # noqa: E402
from app.inference.services import LocalServices  # noqa: E402

SYSROOTS = ROOT / "tests" / "fixtures" / "sysroots"
SIZE = (110, 36)
SYSTEM = "You are a friendly assistant. Keep answers short."
PROMPTS = ("What is the capital of Japan?", "Write a short poem about the sea.")
#: text pieces of the last reply on screen when the chat's picture is taken
HOLD_AT = 9


def fixture_probe(name: str) -> Callable[[], object]:
    from app.inference.hardware import probe

    return lambda: probe(sysroot=SYSROOTS / name, tvm_runtimes={"vulkan", "rocm", "cpu"})


async def until(pilot, predicate: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except Exception:  # a widget not mounted yet
            pass
        if time.monotonic() > deadline:
            shown = pilot.app.save_screenshot(filename="llmchat-screenshots-timeout.svg",
                                              path=tempfile.gettempdir())
            raise TimeoutError(f"the app did not get there: {type(pilot.app.screen).__name__} "
                               f"({shown} shows it)")
        await pilot.pause(0.05)


async def settled(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


class FixtureServices(LocalServices):
    """The real services on a recorded machine (a sysfs snapshot under tests/fixtures/sysroots)."""

    def __init__(self, probe_name: str) -> None:
        super().__init__()
        self.report = fixture_probe(probe_name)()

    def probe(self):
        return self.report


class NoModels(FixtureServices):
    """... with nothing installed (a first run)."""

    def list_installed(self) -> list[str]:
        return []

    def installed_model_path(self, model_id: str) -> Path | None:
        return None


def no_models(probe_name: str) -> NoModels:
    return NoModels(probe_name)


async def first_run(pilot) -> None:
    from app.screens.first_run import FirstRunScreen
    from app.widgets.catalog_table import CatalogTable

    await until(pilot, lambda: isinstance(pilot.app.screen, FirstRunScreen)
                and pilot.app.screen.query_one(CatalogTable).row_count > 0)
    await settled(pilot)


async def models(pilot) -> None:
    from app.screens.models import ModelsScreen
    from app.widgets.catalog_table import CatalogTable

    await first_run(pilot)
    pilot.app.action_open_models()
    await until(pilot, lambda: isinstance(pilot.app.screen, ModelsScreen)
                and pilot.app.screen.query_one(CatalogTable).row_count > 0)
    await settled(pilot)


async def hardware(pilot) -> None:
    from app.screens.hardware import HardwareScreen

    await first_run(pilot)
    pilot.app.action_open_hardware()
    await until(pilot, lambda: isinstance(pilot.app.screen, HardwareScreen)
                and "Steam Deck" in str(pilot.app.screen.query_one("#hardware-report").render()))
    await settled(pilot)


async def chat(pilot) -> Callable[[], None]:
    import threading

    from app.inference.api import TextDelta
    from app.screens.chat import ChatScreen
    from app.widgets.prompt_input import PromptInput

    app = pilot.app
    await until(pilot, lambda: isinstance(app.screen, ChatScreen)
                and app.screen.query_one(PromptInput).has_focus)
    screen = app.screen
    app.set_sampling({"seed": 1, "max_tokens": 200})  # not saved: the user's settings stay as they are
    engine = screen.engine
    real_chat = engine.chat
    held, release = threading.Event(), threading.Event()

    def chat_held(text, params=None):
        """The real reply, held after HOLD_AT pieces of the last prompt until the picture is taken
        (the live line's rate is measured between tokens, so the hold does not change it)."""
        pieces = 0
        for event in real_chat(text, params):
            yield event
            pieces += isinstance(event, TextDelta)
            if text == PROMPTS[-1] and pieces == HOLD_AT:
                held.set()
                release.wait(60)

    def let_go() -> None:
        release.set()
        del engine.chat

    engine.chat = chat_held
    box = screen.query_one(PromptInput)
    box.load_text(f"/system {SYSTEM}")
    box.focus()
    await pilot.press("enter")
    await until(pilot, lambda: app.system_prompt == SYSTEM)
    for n, prompt in enumerate(PROMPTS):
        box = screen.query_one(PromptInput)
        box.load_text(prompt)
        box.focus()
        await pilot.press("enter")
        if n + 1 < len(PROMPTS):
            await until(pilot, lambda n=n: engine.session_stats.replies > n and not screen.replying,
                        timeout=120)
    await until(pilot, held.is_set, timeout=120)
    await pilot.pause(1.0)  # the UI pulls the held text and redraws the live line
    await pilot.wait_for_scheduled_animations()
    return let_go  # after the picture


SHOTS: dict[str, tuple[Callable[[], LlmchatApp], Callable[[object], Awaitable[object]]]] = {
    "first-run": (lambda: LlmchatApp(StartOptions(), no_models("amd-vangogh")), first_run),
    "chat": (lambda: LlmchatApp(StartOptions(model="smollm2-135m-instruct", device="cpu"),
                                FixtureServices("amd-vangogh")), chat),
    "models": (lambda: LlmchatApp(StartOptions(), no_models("amd-rx7900xtx")), models),
    "hardware": (lambda: LlmchatApp(StartOptions(), no_models("amd-vangogh")), hardware),
}


async def take(name: str, out: Path) -> Path:
    make, ready = SHOTS[name]
    app = make()
    path = out / f"{name}.svg"
    async with app.run_test(size=SIZE) as pilot:
        after = await ready(pilot)
        app.save_screenshot(filename=path.name, path=str(out))
        if after is not None:
            after()
        await pilot.press("ctrl+q")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets", help="folder (default: assets/)")
    parser.add_argument("--only", nargs="*", choices=sorted(SHOTS), help="take only these")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only or list(SHOTS):
        started = time.monotonic()
        if name == "chat":  # the default model, set up as `llmchat ask` would (a download on first use)
            from app.inference.store.default_model import ensure_default_model

            ensure_default_model(lambda event: print(f"  [{event.stage}] {event.message}", file=sys.stderr))
        path = asyncio.run(take(name, args.out))
        print(f"{path} ({time.monotonic() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
