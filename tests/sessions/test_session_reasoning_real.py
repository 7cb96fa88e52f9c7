"""Sessions on a real server and engine with a tiny Qwen3 checkpoint (its real chat template, output
scripted: tests/reasoning/think_models.py): the reply's reasoning is stored apart from its answer,
and after the turn the history is re-prefilled as the next prompt starts (rewarm.py), so turn 2 is
served from the cache past the end of turn 1's prompt although Qwen3's template drops the thinking."""
from __future__ import annotations

import os
import re
import sys
import time

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "reasoning"))
import think_models  # noqa: E402
from server_support import start_real_server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BLOCK = 16                       # --block-size default


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = think_models.build(tmp_path_factory.mktemp("qwen3") / "ckpt", "qwen3", think_models.qwen3_chains())
    srv = start_real_server(str(tmp_path_factory.mktemp("qwen3-log")), "--model", str(d),
                            "--max-model-len", "1024", "--kv-blocks", "128", "--served-model-name", "qwen3")
    yield srv
    srv.stop()


def counter(c: httpx.Client, name: str) -> float:
    m = re.search(rf"^chatserve:{name}(?:_total)?(?:\{{[^}}]*\}})?\s+(\S+)$", c.get("/metrics").text, re.M)
    assert m, f"no chatserve:{name} in /metrics"
    return float(m.group(1))


def system_prompt_crossing_a_block(c: httpx.Client, answer: str, thought: str) -> tuple[str, int, int]:
    """A system prompt for which the history after turn 1 (the stripped reply included) fills more
    full blocks than turn 1's prompt does: only then can a cache hit show the reply was re-prefilled.
    Returns it, turn 1's prompt length, and the length of the next prompt up to the reply's end."""
    for n in range(2 * BLOCK):
        system = "Be kind." + " ok" * n
        first = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
        reply = {"role": "assistant", "content": answer, "reasoning_content": thought}
        p1 = c.post("/tokenize", json={"messages": first}).json()["count"]
        strs = c.post("/tokenize", json={"messages": [*first, reply, {"role": "user", "content": "hi"}],
                                         "return_token_strs": True}).json()["token_strs"]
        ends = [i for i, t in enumerate(strs) if t == "<|im_end|>"]      # system, user, the reply, user
        assert len(ends) == 4 and thought not in "".join(strs)         # Qwen3 drops earlier thinking
        prefix = ends[2] + 1
        if prefix // BLOCK > p1 // BLOCK and prefix < len(strs) - 1:
            return system, p1, prefix
    raise AssertionError("no system prompt length puts the reply across a block boundary")


def test_a_session_reply_keeps_its_reasoning_and_turn_2_hits_the_rewarmed_history(qwen3):
    thought, answer = "".join(think_models.THOUGHT), "".join(think_models.ANSWER)
    with httpx.Client(base_url=qwen3.url, timeout=120) as c:
        system, p1, prefix = system_prompt_crossing_a_block(c, answer, thought)
        sid = c.post("/v1/sessions", json={"system_prompt": system, "params": {"temperature": 0}}).json()["id"]
        before = counter(c, "prompt_tokens")
        r = c.post(f"/v1/sessions/{sid}/messages", json={"content": "hi"})
        assert r.status_code == 200, r.text
        msgs = c.get(f"/v1/sessions/{sid}").json()["messages"]
        assert msgs[1]["content"] == answer and msgs[1]["reasoning_content"] == thought
        assert msgs[1]["usage"]["reasoning_tokens"] > 0
        # the rewarm is admitted after the reply: turn 1's prompt + the rewarmed history's tokens
        deadline = time.monotonic() + 60
        while counter(c, "prompt_tokens") < before + p1 + prefix and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counter(c, "prompt_tokens") == before + p1 + prefix
        while counter(c, "num_requests_running") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.post(f"/v1/sessions/{sid}/messages", json={"content": "hi"})
        assert r.status_code == 200, r.text
        usage = c.get(f"/v1/sessions/{sid}").json()["messages"][3]["usage"]
        # served from the cache: every full block of the re-rendered history, past turn 1's prompt
        assert usage["cached_tokens"] == prefix // BLOCK * BLOCK > p1 // BLOCK * BLOCK
