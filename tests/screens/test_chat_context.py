"""Pilot tests: the system prompt is visible (header line, /system, /reset, --continue) and the context
window's use is counted (after each reply, while typing, for a paste)."""

from __future__ import annotations

import json
import re

from textual import events

from app.widgets.chat_log import ChatLog, Notice
from app.widgets.prompt_input import PromptInput
from tests.screens.test_chat import notices, open_chat, send_and_finish, type_and_send, wait_until

LONG_LINE = "The quick brown fox jumps over the lazy dog. "


def system_line(chat) -> str:
    line = chat.query_one("#system-line")
    return str(line.render()) if line.display else ""


def meter(chat) -> str:
    return str(chat.query_one("#context-meter").render())


def used_tokens(chat) -> int:
    match = re.match(r"context ([\d,]+)", meter(chat))
    assert match, meter(chat)
    return int(match[1].replace(",", ""))


async def test_system_prompt_is_shown_printed_cleared_and_kept_by_reset(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        assert system_line(chat) == ""
        await type_and_send(pilot, "/system")
        await wait_until(pilot, lambda: len(notices(chat)) == 1)
        assert "No system prompt" in notices(chat)[-1].source
        await type_and_send(pilot, "/system You are terse.")
        await wait_until(pilot, lambda: system_line(chat) == "system: You are terse.")
        assert chat.engine._system == "You are terse."
        await type_and_send(pilot, "/system")
        await wait_until(pilot, lambda: len(notices(chat)) == 3)
        assert "You are terse." in notices(chat)[-1].source and "/system clear" in notices(chat)[-1].source
        await send_and_finish(pilot, chat, "Hello")
        await type_and_send(pilot, "/reset")
        await wait_until(pilot, lambda: len(notices(chat)) == 1 and "cleared" in notices(chat)[0].source)
        assert "Kept: the system prompt (You are terse." in notices(chat)[0].source
        assert system_line(chat) == "system: You are terse."
        await type_and_send(pilot, "/system clear")
        await wait_until(pilot, lambda: system_line(chat) == "")
        assert app.system_prompt is None and chat.engine._system is None
        assert notices(chat)[-1].source == "*System prompt cleared.*"


async def test_continue_shows_the_system_prompt(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await type_and_send(pilot, "/system Answer in French.")
        await wait_until(pilot, lambda: bool(system_line(chat)))
        await send_and_finish(pilot, chat, "remember me")
        await pilot.press("ctrl+q")
    again = make_app(engine=chat.engine, continue_last=True, model=None)
    async with again.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await wait_until(pilot, lambda: any("Resumed" in n.source for n in notices(chat)))
        assert system_line(chat) == "system: Answer in French."
        resumed = next(n.source for n in notices(chat) if "Resumed" in n.source)
        assert "2 messages" in resumed and "Answer in French." in resumed
        assert chat.engine._system == "Answer in French."


async def test_context_meter_counts_the_conversation_and_the_typed_text(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        window = chat.engine.info.context_window
        await wait_until(pilot, lambda: meter(chat).startswith(f"context 0 / {window:,} tokens"))
        await send_and_finish(pilot, chat, "Hello there")
        await wait_until(pilot, lambda: used_tokens(chat) > 0)
        used = used_tokens(chat)
        assert used > chat.engine.last_stats.prompt_tokens  # the prompt and now the reply too
        chat.query_one(PromptInput).focus()
        await pilot.press(*"fox")
        typed = chat.engine.count_tokens("fox")
        await wait_until(pilot, lambda: f"+ {typed} typed" in meter(chat))
        assert used_tokens(chat) == used
        assert not chat.query_one("#context-meter").has_class("warning")
        await type_and_send(pilot, "/reset")
        await wait_until(pilot, lambda: meter(chat).startswith(f"context 0 / {window:,}"))


async def test_a_paste_is_counted_and_a_nearly_full_window_warns(make_app):
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        window = chat.engine.info.context_window
        prompt = chat.query_one(PromptInput)
        text = LONG_LINE * 200 + "\nand a second line"
        tokens = chat.engine.count_tokens(text)
        assert 0.8 * window <= tokens < window
        app.post_message(events.Paste(text))
        await wait_until(pilot, lambda: prompt.text == text)
        await wait_until(pilot, lambda: f"+ {tokens:,} typed" in meter(chat))
        shown = [n.message for n in app._notifications]
        assert f"Pasted 2 lines, {tokens:,} tokens." in shown
        assert chat.query_one("#context-meter").has_class("warning")
        assert "nearly full" in meter(chat) and "/reset" in meter(chat)
        app.post_message(events.Paste(LONG_LINE * 100))
        await wait_until(pilot, lambda: "does not fit" in meter(chat))
        prompt.clear()
        await wait_until(pilot, lambda: not chat.query_one("#context-meter").has_class("warning"))
        assert not chat.query_one(ChatLog).query(Notice)  # nothing was sent


async def test_a_long_message_is_folded_and_expands_on_click(make_app):
    from app.widgets.chat_log import UserMessage

    app = make_app()
    async with app.run_test(size=(100, 40)) as pilot:
        chat = await open_chat(pilot)
        text = "\n".join(f"line {i}: {LONG_LINE.strip()}" for i in range(40))
        tokens = chat.engine.count_tokens(text)
        await send_and_finish(pilot, chat, text)
        message = chat.query_one(ChatLog).query_one(UserMessage)
        assert chat.engine.history[0].content == text  # the model got all of it
        assert f"… 40 lines, {tokens:,} tokens — click to expand" in message.source
        assert "line 5:" in message.source and "line 6:" not in message.source
        await pilot.click(message)
        await wait_until(pilot, lambda: message.source == text)
        await pilot.click(message)
        await wait_until(pilot, lambda: "click to expand" in message.source)
        await send_and_finish(pilot, chat, "short")  # a short one is shown as it is
        assert chat.query_one(ChatLog).query(UserMessage).last().source == "short"


async def test_set_lists_where_each_value_comes_from_and_reset_restores_the_models(make_app):
    app = make_app()  # the fixture /set every value (greedy, 16 tokens)
    async with app.run_test(size=(100, 40)) as pilot:
        chat = await open_chat(pilot)
        await type_and_send(pilot, "/set reset")
        await wait_until(pilot, lambda: len(notices(chat)) == 1)
        text = notices(chat)[0].source
        # the tiny model's mlc-chat-config.json says temperature 0.7, top_p 0.95 and no penalty
        assert "- temperature = 0.7 (mlc-chat-config.json)" in text
        assert "- repetition_penalty = 1.1 (repetition guard" in text
        assert "- seed = random (llmchat default)" in text
        assert app.params.temperature == 0.7 and app.params.repetition_penalty == 1.1
        await type_and_send(pilot, "/set seed=3; repetition_penalty=1")
        await type_and_send(pilot, "/set")
        await wait_until(pilot, lambda: len(notices(chat)) == 3)
        text = notices(chat)[-1].source
        assert "- seed = 3 (/set)" in text and "- repetition_penalty = 1 (/set)" in text
        assert app.params.repetition_penalty == 1.0 and app.params.temperature == 0.7
        await type_and_send(pilot, "/reset")
        await wait_until(pilot, lambda: len(notices(chat)) == 1)
        assert "Kept: your sampling settings (seed=3, repetition_penalty=1" in notices(chat)[0].source


async def test_set_values_stick_per_model_across_restarts(make_app, chat_engine):
    """#20 item 9: /set is kept per model in the config directory; a new app on that model starts
    with it; /set reset forgets it; another model does not inherit it."""
    from app import settings
    from tests.screens.conftest import SharedEngine

    model_id = chat_engine.info.model_id
    app = make_app()
    async with app.run_test(size=(100, 40)) as pilot:
        chat = await open_chat(pilot)
        await type_and_send(pilot, "/set temperature=0.3; seed=5; stop=###")
        await wait_until(pilot, lambda: any("kept for" in n.source for n in notices(chat)))
    saved, problems = settings.load_overrides(model_id)
    assert problems == [] and saved["temperature"] == 0.3 and saved["seed"] == 5 and saved["stop"] == ["###"]

    again = make_app()
    again.sampling_overrides = {}  # nothing set by the test: what comes back is what was saved
    async with again.run_test(size=(100, 40)) as pilot:
        chat = await open_chat(pilot)
        assert again.params.temperature == 0.3 and again.params.seed == 5 and again.params.stop == ["###"]
        await type_and_send(pilot, "/set")
        await wait_until(pilot, lambda: notices(chat))
        assert "- temperature = 0.3 (/set)" in notices(chat)[-1].source
        # another model (nothing saved for it) starts from its own defaults
        other = SharedEngine(chat_engine, model_id="other-model")
        again.services.load_engine = lambda model, device, progress: other
        await again.engine_ready(other)
        assert "temperature" not in again.sampling_overrides and again.params.seed is None
        await again.engine_ready(SharedEngine(chat_engine))  # back: its values return
        assert again.params.temperature == 0.3
        chat = await open_chat(pilot)
        await type_and_send(pilot, "/set reset")
        back = "back to this model's defaults"
        await wait_until(pilot, lambda: any(back in n.source for n in notices(chat)))
    assert settings.load_overrides(model_id) == (None, [])


async def test_a_damaged_settings_file_is_reported_and_ignored(make_app, chat_engine):
    from app import settings

    model_id = chat_engine.info.model_id
    settings.path().parent.mkdir(parents=True, exist_ok=True)
    cases = [
        ("{not json", "is not valid JSON", None),
        ('{"models": [1, 2]}', 'has no "models" table', None),
        (
            json.dumps({"models": {model_id: {"temperature": 9, "top_p": 0.5, "colour": 1}}}),
            "temperature=9 is out of range",
            0.5,
        ),
    ]
    for text, problem, top_p in cases:
        settings.path().write_text(text)
        app = make_app()
        app.sampling_overrides = {}
        async with app.run_test(size=(100, 40)) as pilot:
            chat = await open_chat(pilot)
            shown = [n.message for n in app._notifications]
            assert any(problem in message for message in shown), shown
            assert app.params.temperature == app.model_sampling.params.temperature  # the default
            if top_p is not None:
                assert app.params.top_p == top_p  # the good value still applies
                assert any("unknown sampling setting 'colour'" in message for message in shown), shown
            await send_and_finish(pilot, chat, "still works")
            await type_and_send(pilot, "/set seed=1")  # rewrites the file whole
            await wait_until(pilot, lambda chat=chat: any("kept for" in n.source for n in notices(chat)))
        assert settings.load_overrides(model_id)[0]["seed"] == 1
