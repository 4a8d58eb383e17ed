"""The chat app on Vulkan (lavapipe in CI): a reply streams with live stats, /stats names the
device, Esc stops a reply within a step, /reset starts over — the same as on the CPU."""

from __future__ import annotations

import pytest

from app.widgets.chat_log import AssistantMessage, ChatLog, Notice
from tests.inference.backends.vulkan_env import need_vulkan
from tests.screens.conftest import SharedEngine, greedy
from tests.screens.test_chat import open_chat, type_and_send, wait_until


@pytest.fixture(scope="module")
def vulkan_engine(chat_model_dir):
    need_vulkan()
    from app.inference.engine.tvm_engine import load_engine

    engine = load_engine(chat_model_dir, device="vulkan")
    yield engine
    engine.close()


async def test_chat_on_vulkan_streams_stops_and_resets(make_app, vulkan_engine, chat_engine):
    app = make_app(engine=SharedEngine(vulkan_engine))
    app.params = greedy(12)
    async with app.run_test(size=(100, 40)) as pilot:
        await open_chat(pilot)
        await type_and_send(pilot, "Hello there")
        log = pilot.app.screen.query_one(ChatLog)
        await wait_until(pilot, lambda: not pilot.app.screen.replying, timeout=300)
        reply = log.query(AssistantMessage).last().source
        assert reply.strip(), "no reply on vulkan"
        # the same greedy reply as the CPU engine gives (same weights, float32 tiny model)
        chat_engine.reset()
        from app.inference.api import TextDelta

        cpu = "".join(e.text for e in chat_engine.chat("Hello there", greedy(12)) if isinstance(e, TextDelta))
        assert reply.strip() == cpu.strip()
        await type_and_send(pilot, "/stats")
        await wait_until(pilot, lambda: "vulkan" in log.query(Notice).last().source.lower(), timeout=60)
        # Esc stops a long reply: the reply is held at its third batch of greedy steps until Esc
        # has been pressed (no end-of-text token can end it first), then goes on and must stop
        import threading

        reached, go_on = threading.Event(), threading.Event()
        rt = vulkan_engine.runtime
        real_start, calls = rt.start_greedy_ahead, [0]

        def gated(token, steps):
            calls[0] += 1
            if calls[0] == 3:
                reached.set()
                assert go_on.wait(60), "the test never let the reply go on"
            return real_start(token, steps)

        stop_ids = vulkan_engine.stop_token_ids
        vulkan_engine.stop_token_ids = ()
        rt.start_greedy_ahead = gated
        try:
            app.params = greedy(400)
            await type_and_send(pilot, "Tell me a long story")
            await wait_until(pilot, reached.is_set, timeout=120)
            await pilot.press("escape")
            go_on.set()
            await wait_until(pilot, lambda: not pilot.app.screen.replying, timeout=120)
        finally:
            go_on.set()
            del rt.start_greedy_ahead
            vulkan_engine.stop_token_ids = stop_ids
        assert vulkan_engine.last_stats.generated_tokens < 400
        assert vulkan_engine.last_stats.finish_reason == "cancelled"
        await type_and_send(pilot, "/reset")
        await wait_until(pilot, lambda: vulkan_engine.runtime.sequence_length == 0, timeout=60)
