"""SSE mechanics at the ASGI level: a reader that stops reading is ended after the send timeout and
its request aborted; pings keep an idle stream alive; an admission error before the first chunk is a
plain JSON error with its status."""
from __future__ import annotations

import asyncio
import json

from server_support import VOCAB
from fakes import FakeTokenizer, fake_engine

from chatserve.config import EngineConfig
from chatserve.server.chat_service import ChunkStreamResponse, parse_chat_body, stream_chat
from chatserve.server.state import single_model_state

MSG = [{"role": "user", "content": "abc"}]


async def make_state(**kw):
    eng = fake_engine(EngineConfig(), **kw)
    state = single_model_state(EngineConfig(), eng, FakeTokenizer(), "fake-model", vocab_size=VOCAB)
    await state.models.start()                 # what the app's lifespan does
    return state


def parse(body: dict, st):
    return parse_chat_body(body, st.models.peek(None))


def scope():
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [],
            "query_string": b"", "asgi": {"version": "3.0", "spec_version": "2.4"}}


async def never_disconnect():
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


async def test_stalled_reader_is_ended_and_its_request_aborted():
    st = await make_state(delay=0.005)
    req = parse({"messages": MSG, "max_tokens": 240, "ignore_eos": True, "stream": True}, st)
    sent: list[dict] = []

    async def send(m):
        sent.append(m)
        if len(sent) > 3:                     # the client's window is full: this send never returns
            await asyncio.sleep(3600)
    resp = ChunkStreamResponse(stream_chat(st, req, owner="o"), send_timeout=0.3)
    task = asyncio.ensure_future(resp(scope(), never_disconnect, send))
    done, _ = await asyncio.wait({task}, timeout=120)     # a hang guard, not a speed limit
    assert task in done, "the stalled send was never timed out"
    err = task.exception()                    # sse-starlette raises SendTimeoutError to the server
    assert err is None or "Timeout" in type(err).__name__, err
    assert len(sent) == 4                     # the send that stalled was the last one tried
    await asyncio.sleep(0.05)
    s = st.models.peek(None).engine.stats()
    assert s.kv_used_blocks == 0 and s.running == 0 and s.requests_finished.get("abort") == 1
    await st.models.shutdown(0)


async def test_admission_error_before_first_chunk_is_a_json_response():
    st = await make_state(max_waiting=1, max_running=1, delay=0.05)
    body = {"messages": MSG, "max_tokens": 50, "ignore_eos": True, "stream": True}
    keep = [stream_chat(st, parse(body, st), owner="o") for _ in range(2)]
    waiting = []
    for k in keep:                            # one running, then one waiting: the queue (1) is full
        waiting.append(asyncio.ensure_future(k.__anext__()))
        await asyncio.sleep(0.03)
    sent: list[dict] = []

    async def send(m):
        sent.append(m)
    resp = ChunkStreamResponse(stream_chat(st, parse(body, st), owner="o"), send_timeout=1)
    await resp(scope(), never_disconnect, send)
    assert sent[0]["status"] == 503
    assert any(k == b"retry-after" and int(v) >= 1 for k, v in sent[0]["headers"])
    assert json.loads(sent[1]["body"])["error"]["code"] == "server_overloaded"
    for w in waiting:
        w.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for k in keep:
        await k.aclose()
    await st.models.shutdown(0)


async def test_pings_keep_an_idle_stream_alive():
    st = await make_state(delay=0.4)          # the first token takes a while
    req = parse({"messages": MSG, "max_tokens": 2, "stream": True}, st)
    sent: list[dict] = []

    async def send(m):
        sent.append(m)
    resp = ChunkStreamResponse(stream_chat(st, req, owner="o"), send_timeout=5, ping=0.1)
    await asyncio.wait_for(resp(scope(), never_disconnect, send), 10)
    bodies = b"".join(m.get("body", b"") for m in sent)
    assert bodies.startswith(b"\n\n") and bodies.rstrip().endswith(b"data: [DONE]")   # keep-alive first
    await st.models.shutdown(0)
