"""The app on MLC-LLM's engine (`llmchat --engine mlc`), against the documented stand-in of mlc_llm."""

from __future__ import annotations

import json
from pathlib import Path

from app.chat_app import LlmchatApp, StartOptions
from app.widgets.chat_log import AssistantMessage, ChatLog, StatsLine
from tests.screens.conftest import StandInServices, probe_fixture
from tests.screens.test_chat import open_chat, type_and_send, wait_until


async def test_chat_streams_through_mlc_engine(mlc_stand_in, tmp_path: Path) -> None:
    model_dir = tmp_path / "Tiny-q4f16_1-MLC"
    model_dir.mkdir()
    (model_dir / "mlc-chat-config.json").write_text(
        json.dumps({"model_type": "llama", "quantization": "q4f16_1", "context_window_size": 4096})
    )
    (model_dir / "tensor-cache.json").write_text(json.dumps({"metadata": {"ParamBytes": 1}, "records": []}))
    services = StandInServices(engine="mlc", probe=probe_fixture("amd-rx7900xtx"))
    app = LlmchatApp(StartOptions(model=str(model_dir), device="cpu"), services)
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await open_chat(pilot)
        await type_and_send(pilot, "Hello MLC")
        log = chat.query_one(ChatLog)
        await wait_until(pilot, lambda: "prefill:" in str(log.query_one(StatsLine).render()))
        assert "You said: Hello MLC" in log.query_one(AssistantMessage).source
        assert app.engine is not None and app.engine.info.backend.startswith("mlc-llm")
