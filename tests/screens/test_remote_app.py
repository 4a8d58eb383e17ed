"""The chat app on a remote engine (``llmchat --endpoint``), under Textual's Pilot, against
``llmchat serve`` on loopback: a full chat with /stats, Esc mid-reply, /system, and --continue."""

from __future__ import annotations

from app.chat_app import LlmchatApp, StartOptions
from app.inference.api import Message, SamplingParams, TextDelta
from app.inference.services import RemoteServices
from app.widgets.chat_log import AssistantMessage, ChatLog, UserMessage
from tests.screens.test_chat import notices, open_chat, send_and_finish, type_and_send, wait_until
from tests.serve.conftest import DecodeGate, serving


def direct(engine, messages: list[Message], params: SamplingParams) -> str:
    return "".join(e.text for e in engine.complete(messages, params) if isinstance(e, TextDelta))


async def test_a_full_chat_with_stats_against_llmchat_serve(tiny_engine):
    engine = tiny_engine
    engine.reset()
    greedy = SamplingParams(temperature=0, max_tokens=8, seed=0)
    with serving(engine) as served:
        app = LlmchatApp(StartOptions(), RemoteServices(served.url))
        app.params = greedy
        async with app.run_test(size=(110, 36)) as pilot:
            chat = await open_chat(pilot)
            remote = chat.engine
            assert remote.info.backend == "remote" and remote.info.model_id == engine.info.model_id
            assert "(remote)" in str(chat.query_one("#chat-title").render())
            await send_and_finish(pilot, chat, "Hello!")
            reply = chat.query_one(ChatLog).query_one(AssistantMessage)
            assert reply.source == direct(engine, [Message("user", "Hello!")], greedy)
            await type_and_send(pilot, "/stats")
            await wait_until(pilot, lambda: len(notices(chat)) == 1)
            text = notices(chat)[0].source
            assert f"last reply: {remote.last_stats.format()}" in text and "TTFT" in text
            assert "server: " in text and "completion tokens" in text and "decode" in text
            assert f"on the server {served.url}" in text
            # /system and /set go into the next request
            await type_and_send(pilot, "/system Be brief.")
            await type_and_send(pilot, "/set max_tokens=5")
            await wait_until(pilot, lambda: app.params.max_tokens == 5)
            await send_and_finish(pilot, chat, "Tell me about llamas.")
            sent = [
                Message("system", "Be brief."),
                Message("user", "Hello!"),
                Message("assistant", reply.source),
                Message("user", "Tell me about llamas."),
            ]
            assert remote.last_stats.prompt_tokens == engine.count_prompt_tokens(sent)
            assert remote.last_stats.generated_tokens == 5
            # Esc stops a reply mid-stream, keeping what arrived
            with DecodeGate(engine, at_step=3) as gate:
                app.params = SamplingParams(temperature=0, max_tokens=200)
                await type_and_send(pilot, "More, please.")
                await wait_until(
                    pilot,
                    lambda: gate.reached.is_set() and chat._buffer is not None and chat._buffer.deltas > 0,
                )
                await pilot.press("escape")
                await wait_until(pilot, lambda: not chat.replying)
                gate.release.set()
            assert remote.last_stats.finish_reason == "cancelled"
            saved = app.history.messages(app.conversation_id)
            assert [m.role for m in saved] == ["user", "assistant"] * 3
            assert saved[-1].content and saved[-1].content == remote.history[-1].content
            conversation_id = app.conversation_id
        # --continue: the saved conversation goes to the server again
        again = LlmchatApp(StartOptions(continue_last=True), RemoteServices(served.url))
        again.params = greedy
        async with again.run_test(size=(110, 36)) as pilot:
            chat = await open_chat(pilot)
            log = chat.query_one(ChatLog)
            await wait_until(pilot, lambda: len(log.query(UserMessage)) == 3)
            assert again.conversation_id == conversation_id
            assert [m.content for m in chat.engine.history] == [m.content for m in saved]
            await send_and_finish(pilot, chat, "Thanks.")
            resent = [Message("system", "Be brief."), *saved, Message("user", "Thanks.")]
            assert chat.engine.last_stats.prompt_tokens == engine.count_prompt_tokens(resent)
    engine.reset()
