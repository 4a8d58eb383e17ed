"""The remote engine (``llmchat --endpoint``) against real servers on loopback: ``llmchat serve`` on the
tiny CPU model, and small HTTP servers for the faults a real server cannot be made to show on cue
(a connection that breaks mid-reply, a redirect to another host)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.cli import main
from app.errors import LlmchatError
from app.inference.api import Message, ReplyStats, SamplingParams, TextDelta
from app.inference.engine.remote import RemoteEngine, list_models, normalize_endpoint
from tests.serve.conftest import DecodeGate, serving

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(events) -> tuple[str, ReplyStats | None]:
    text, stats = [], None
    for event in events:
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ReplyStats):
            stats = event
    return "".join(text), stats


def direct(engine, messages: list[Message], params: SamplingParams) -> str:
    return run(engine.complete(messages, params))[0]


def test_endpoint_urls_are_normalized_and_credentials_refused():
    assert normalize_endpoint("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_endpoint("127.0.0.1:8080/") == "http://127.0.0.1:8080/v1"
    assert normalize_endpoint("https://example.org/api/v1/") == "https://example.org/api/v1"
    with pytest.raises(LlmchatError, match="user name or password"):
        normalize_endpoint("http://me:secret@127.0.0.1:8000/v1")
    with pytest.raises(LlmchatError, match="not an http"):
        normalize_endpoint("ftp://127.0.0.1/")


def test_remote_chat_streams_measures_and_keeps_the_conversation(engine):
    with serving(engine) as served:
        remote = RemoteEngine(served.url)
        try:
            assert remote.info.model_id == engine.info.model_id == list_models(served.url)[0]
            assert remote.info.backend == "remote"
            assert remote.info.context_window == engine.info.context_window
            text, stats = run(remote.chat("Hello!", GREEDY))
            assert text == direct(engine, [Message("user", "Hello!")], GREEDY)
            assert remote.history == [Message("user", "Hello!"), Message("assistant", text)]
            # measured here: time to first token and the decode rate over the stream
            assert stats.generated_tokens == 12 and stats.finish_reason == "length"
            assert stats.time_to_first_token_s > 0 and stats.decode_s > 0 and stats.decode_tok_s > 0
            # and the server's own usage, MLC's extra figures included
            assert stats.server_usage["completion_tokens"] == 12
            assert stats.prompt_tokens == engine.count_prompt_tokens([Message("user", "Hello!")])
            assert stats.server_usage["extra"]["decode_tokens_per_s"] > 0
            assert "server: " in stats.server_line() and "decode" in stats.server_line()
            assert remote.last_stats is stats and remote.session_stats.replies == 1
            # the second turn sends the whole conversation, with the system prompt
            remote.set_system_prompt("Be brief.")
            second, stats2 = run(remote.chat("Tell me about llamas.", GREEDY))
            sent = [
                Message("system", "Be brief."),
                Message("user", "Hello!"),
                Message("assistant", text),
                Message("user", "Tell me about llamas."),
            ]
            assert stats2.prompt_tokens == engine.count_prompt_tokens(sent)
            assert second == direct(engine, sent, GREEDY)
            # /reset: a new conversation (the system prompt stays)
            remote.reset()
            assert remote.history == []
            _, stats3 = run(remote.chat("Hi", GREEDY))
            assert stats3.prompt_tokens == engine.count_prompt_tokens(
                [Message("system", "Be brief."), Message("user", "Hi")]
            )
            # a resumed conversation (--continue) is sent as it was saved
            remote.load_history([Message("user", "Hello!"), Message("assistant", text)])
            remote.set_system_prompt(None)
            again, _ = run(remote.chat("Tell me about llamas.", GREEDY))
            assert again == direct(engine, sent[1:], GREEDY)
        finally:
            remote.close()


def test_set_values_become_the_request(engine):
    params = SamplingParams(
        temperature=1.1,
        top_p=0.8,
        max_tokens=15,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
    )
    full = direct(engine, [Message("user", "Hi")], SamplingParams(temperature=0, max_tokens=30))
    stop = next(full[i : i + 3] for i in range(4, len(full) - 3) if full.find(full[i : i + 3]) == i)
    with serving(engine) as served:
        remote = RemoteEngine(served.url)
        try:
            text, _ = run(remote.chat("Hi", params))
            assert text == direct(engine, [Message("user", "Hi")], params)
            remote.reset()
            text, stats = run(remote.chat("Hi", SamplingParams(temperature=0, max_tokens=30, stop=[stop])))
            assert text == full[: full.find(stop)] and stats.finish_reason == "stop"
        finally:
            remote.close()


def test_cancel_closes_the_stream_and_frees_the_server(engine):
    with serving(engine) as served, DecodeGate(engine, at_step=3) as gate:
        remote = RemoteEngine(served.url)
        try:
            events = remote.chat("Hello!", SamplingParams(temperature=0, max_tokens=200))
            first = next(events)
            assert isinstance(first, TextDelta)
            assert gate.reached.wait(30)
            job = served.state.scheduler.running
            canceller = threading.Thread(target=remote.cancel)  # Esc, from the UI's thread
            canceller.start()
            rest = list(events)  # ends although the server sends nothing more
            canceller.join()
            assert isinstance(rest[-1], ReplyStats) and rest[-1].finish_reason == "cancelled"
            kept = first.text + "".join(e.text for e in rest if isinstance(e, TextDelta))
            assert remote.history == [Message("user", "Hello!"), Message("assistant", kept)]
            assert job.cancel.wait(30), "the server did not see the stream close"
            gate.release.set()
            _, stats = run(remote.chat("Hi", SamplingParams(temperature=0, max_tokens=4)))
            assert stats.generated_tokens == 4
            assert job.done.stats.finish_reason == "cancelled" and job.done.stats.generated_tokens == 4
        finally:
            remote.close()


def test_api_keys_wrong_keys_and_unknown_models_are_readable_errors(engine, monkeypatch):
    monkeypatch.delenv("LLMCHAT_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-for-openai-only")  # never sent to another host
    with serving(engine, api_key="right-key") as served:
        with pytest.raises(LlmchatError, match="needs an API key") as missing:
            RemoteEngine(served.url)
        assert "LLMCHAT_API_KEY" in missing.value.fix
        with pytest.raises(LlmchatError, match="refused the API key") as wrong:
            RemoteEngine(served.url, api_key="wrong-key")
        assert "wrong-key" not in str(wrong.value)
        monkeypatch.setenv("LLMCHAT_API_KEY", "right-key")
        remote = RemoteEngine(served.url)
        assert "right-key" not in repr(remote)
        assert run(remote.chat("Hi", SamplingParams(temperature=0, max_tokens=2)))[1].generated_tokens == 2
        remote.close()
        with pytest.raises(LlmchatError, match="no model 'gpt-9'") as unknown:
            RemoteEngine(served.url, model="gpt-9")
        assert engine.info.model_id in str(unknown.value)
    with pytest.raises(LlmchatError, match="Cannot reach the server"):
        RemoteEngine(served.url)  # the server is gone


class _Recorder(BaseHTTPRequestHandler):
    """Answers what the test scripts: ``server.routes[path] -> callable(handler)``; records requests."""

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append((self.command, self.path, self.headers, body))  # case-blind
        self.server.routes[self.path](self)

    def json(self, status: int, data: object) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def recorder(routes: dict) -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.routes, server.seen = routes, []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "test"}]}


def test_the_key_is_not_sent_to_a_host_the_server_redirects_to(monkeypatch):
    monkeypatch.delenv("LLMCHAT_API_KEY", raising=False)
    with recorder({}) as elsewhere:
        elsewhere.routes["/v1/models"] = lambda h: h.json(200, MODELS)

        def redirect(h: _Recorder) -> None:
            h.send_response(307)
            h.send_header("Location", f"http://127.0.0.1:{elsewhere.server_port}/v1/models")
            h.send_header("Content-Length", "0")
            h.end_headers()

        with recorder({"/v1/models": redirect}) as first:
            with pytest.raises(LlmchatError):
                RemoteEngine(f"http://127.0.0.1:{first.server_port}/v1", api_key="secret-key")
            assert first.seen[0][2].get("Authorization") == "Bearer secret-key"
        assert elsewhere.seen == []
    with recorder({"/v1/models": lambda h: h.json(200, MODELS)}) as keyless:
        RemoteEngine(f"http://127.0.0.1:{keyless.server_port}").close()
        assert "Authorization" not in keyless.seen[0][2]


def test_a_server_gone_mid_reply_keeps_what_arrived_and_says_so(monkeypatch):
    def half_a_reply(h: _Recorder) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Content-Length", "100000")  # promises more than it sends
        h.end_headers()
        for text in ("Llamas ", "live in "):
            chunk = {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            }
            h.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        h.wfile.flush()
        h.close_connection = True  # and the server goes away

    with recorder(
        {"/v1/models": lambda h: h.json(200, MODELS), "/v1/chat/completions": half_a_reply}
    ) as server:
        remote = RemoteEngine(f"http://127.0.0.1:{server.server_port}/v1")
        received: list[str] = []
        with pytest.raises(LlmchatError, match="broke mid-reply") as broke:
            for event in remote.chat("Where do llamas live?", GREEDY):
                if isinstance(event, TextDelta):
                    received.append(event.text)
        assert "kept" in str(broke.value)
        assert "".join(received) == "Llamas live in "
        assert remote.history == [
            Message("user", "Where do llamas live?"),
            Message("assistant", "Llamas live in "),
        ]
        sent = json.loads(server.seen[-1][3])
        assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
        assert sent["messages"] == [{"role": "user", "content": "Where do llamas live?"}]
        remote.close()


def test_ask_with_an_endpoint(engine, capsys):
    with serving(engine) as served:
        code = main(
            ["ask", "--endpoint", served.url, "--temperature", "0", "--max-tokens", "12", "--stats", "Hello!"]
        )
    out, err = capsys.readouterr()
    assert code == 0
    assert out == direct(engine, [Message("user", "Hello!")], GREEDY) + "\n"
    assert "prefill:" in err and "decode:" in err and "server: " in err


@pytest.fixture
def engine(tiny_engine):
    tiny_engine.set_system_prompt(None)
    tiny_engine.reset()
    yield tiny_engine
    tiny_engine.reset()
