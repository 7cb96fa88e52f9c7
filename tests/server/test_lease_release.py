"""A parsed request gives its model lease back on every exit path, deterministically: not when the
request object is collected (Lease.__del__ is only a backstop). Here the collector fails before it reads
a chunk (a 500): the failed task and its traceback hold the request in a reference cycle, and the cyclic
collector is off, so only an explicit release can bring the pool's lease count to 0."""
from __future__ import annotations

import gc

import httpx
import pytest

from fakes import FakeTokenizer, fake_engine
from server_support import VOCAB

from chatserve.config import EngineConfig
from chatserve.server import openai_routes
from chatserve.server.app import build_app
from chatserve.server.responses import service
from chatserve.server.state import single_model_state

MSG = [{"role": "user", "content": "abc"}]


async def _never_reads(chunks, req):
    raise RuntimeError("the collector failed before it read a chunk")


@pytest.mark.parametrize("path, body, target", [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 3}, (openai_routes, "collect_chat")),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 3}, (openai_routes, "collect_completion")),
    ("/v1/responses", {"input": "abc", "max_output_tokens": 3}, (service, "collect")),
])
async def test_a_request_whose_stream_never_started_gives_its_lease_back(monkeypatch, path, body, target):
    state = single_model_state(EngineConfig(), fake_engine(EngineConfig()), FakeTokenizer(), "fake-model",
                               vocab_size=VOCAB)
    await state.models.start()                   # what the app's lifespan does
    app = build_app(state)
    monkeypatch.setattr(*target, _never_reads)
    gc.disable()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post(path, json={"model": "fake-model", **body})
            assert r.status_code == 500
            assert [i.leases for i in state.models.info()] == [0]
            monkeypatch.undo()
            r = await c.post(path, json={"model": "fake-model", **body})
            assert r.status_code == 200 and [i.leases for i in state.models.info()] == [0]
    finally:
        gc.enable()
        await state.models.shutdown(0)
