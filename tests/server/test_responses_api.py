"""/v1/responses on the scripted engine: the response object, the typed event stream read by a naive
"\\n\\n" splitter, chains through previous_response_id, GET/DELETE, owner scoping, and the 400s naming
unsupported fields. The official SDK reads the same server here; tests/clients/test_responses_sdk.py runs
it against the real model."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_support import start_fake_server


@pytest.fixture(scope="module")
def srv():
    s = start_fake_server(api_keys=("alice", "bob"))
    yield s
    s.stop()


def _post(srv, body, key="alice"):
    return httpx.post(srv.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _text(resp: dict) -> str:
    return "".join(p["text"] for it in resp["output"] if it["type"] == "message" for p in it["content"])


def test_response_object(srv):
    r = _post(srv, {"input": "hello", "instructions": "be brief", "max_output_tokens": 4,
                    "metadata": {"k": "v"}, "service_tier": "auto", "user": "u1"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "response" and d["id"].startswith("resp_")
    assert d["status"] == "incomplete" and d["incomplete_details"] == {"reason": "max_output_tokens"}
    assert d["metadata"] == {"k": "v"} and d["instructions"] == "be brief" and d["store"] is True
    msg = d["output"][0]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["status"] == "completed"
    assert len(_text(d)) == 4
    u = d["usage"]
    assert u["output_tokens"] == 4 and u["total_tokens"] == u["input_tokens"] + 4
    assert u["output_tokens_details"] == {"reasoning_tokens": 0}


def _events(srv, body, key="alice") -> list[tuple[str, dict]]:
    """A naive reader: split the body on "\\n\\n", take each block's `event:` and `data:` lines."""
    out = []
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60) as r:
        assert r.status_code == 200
        buf = ""
        for piece in r.iter_text():
            buf += piece
            while "\n\n" in buf:
                block, buf = buf.split("\n\n", 1)
                lines = dict(ln.split(": ", 1) for ln in block.split("\n") if ": " in ln)
                if "data" in lines:
                    out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def test_stream_events(srv):
    ev = _events(srv, {"input": "hello", "max_output_tokens": 5})
    kinds = [k for k, _ in ev]
    assert all(k == d["type"] for k, d in ev)
    assert [d["sequence_number"] for _, d in ev] == list(range(len(ev)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert ev[-1][1]["response"]["status"] == "incomplete"
    deltas = "".join(d["delta"] for k, d in ev if k == "response.output_text.delta")
    assert len(deltas) == 5 and deltas == _text(ev[-1][1]["response"])
    assert ev[0][1]["response"]["status"] == "in_progress"


def test_chain_get_delete(srv):
    first = _post(srv, {"input": "one", "max_output_tokens": 3}).json()
    got = httpx.get(srv.url + f"/v1/responses/{first['id']}", headers={"Authorization": "Bearer alice"})
    assert got.status_code == 200 and got.json()["output"] == first["output"]
    second = _post(srv, {"input": "two", "max_output_tokens": 3, "previous_response_id": first["id"]}).json()
    assert second["previous_response_id"] == first["id"]
    # the chain's history (first input and output) is in the second prompt
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 3
    # another owner sees none of it
    other = httpx.get(srv.url + f"/v1/responses/{first['id']}", headers={"Authorization": "Bearer bob"})
    assert other.status_code == 404
    r = _post(srv, {"input": "x", "previous_response_id": first["id"]}, key="bob")
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    d = httpx.delete(srv.url + f"/v1/responses/{first['id']}", headers={"Authorization": "Bearer alice"})
    assert d.json() == {"id": first["id"], "object": "response", "deleted": True}
    assert httpx.get(srv.url + f"/v1/responses/{first['id']}",
                     headers={"Authorization": "Bearer alice"}).status_code == 404


def test_store_false_keeps_nothing(srv):
    d = _post(srv, {"input": "one", "max_output_tokens": 2, "store": False}).json()
    assert d["store"] is False
    assert httpx.get(srv.url + f"/v1/responses/{d['id']}", headers={"Authorization": "Bearer alice"}).status_code == 404


def test_items_input(srv):
    items = [{"role": "user", "content": "weather?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]
    r = _post(srv, {"input": items, "max_output_tokens": 2})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": ""}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
     "text.format"),
])
def test_unsupported_fields_are_400(srv, body, param):
    r = _post(srv, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "max_completion_tokens" not in r.json()["error"]["message"]


def test_official_sdk(srv):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="alice", max_retries=0)
    r = client.responses.create(model="fake-model", input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and len(r.output_text) == 3
    chained = client.responses.create(model="fake-model", input="more", max_output_tokens=3,
                                      previous_response_id=r.id)
    assert chained.previous_response_id == r.id
    with client.responses.stream(model="fake-model", input="hi", max_output_tokens=4) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text and len(deltas) == 4
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


@pytest.fixture()
def failing_srv():
    """A server whose runner fails on its 4th step: a stream gets a few deltas, then the failure."""
    s = start_fake_server()
    runner = s.state.models.peek(None).engine.runner       # the one (fake) model, loaded
    execute = runner.execute

    def fail_later(out):
        if runner.calls >= 3:
            runner.calls += 1
            raise RuntimeError("boom")
        return execute(out)

    runner.execute = fail_later
    yield s
    s.stop()


def test_a_stream_that_fails_ends_with_an_error_event(failing_srv):
    """Deltas, then one typed `error` event (code, message) and the end of the stream, no response.completed:
    as a naive "\\n\\n" reader and the official SDK read it."""
    ev = _events(failing_srv, {"input": "hello", "max_output_tokens": 50})
    kinds = [k for k, _ in ev]
    assert "response.output_text.delta" in kinds and "response.completed" not in kinds
    assert kinds[-1] == "error" and kinds.count("error") == 1
    err = ev[-1][1]
    assert err["type"] == "error" and err["code"] and "boom" in err["message"]
    assert [d["sequence_number"] for _, d in ev] == list(range(len(ev)))
    failing_srv.state.models.peek(None).engine.runner.calls = 0           # three good steps again
    client = openai.OpenAI(base_url=failing_srv.url + "/v1", api_key="none", max_retries=0)
    events = list(client.responses.create(model="fake-model", input="hello", max_output_tokens=50, stream=True))
    assert events[-1].type == "error" and "boom" in events[-1].message
    assert any(e.type == "response.output_text.delta" for e in events)
    assert not any(e.type == "response.completed" for e in events)
