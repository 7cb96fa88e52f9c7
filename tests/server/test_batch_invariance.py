"""Batch invariance with the real default model at its default settings (dtype auto, int4 decode
matmuls where the CPU has them): one greedy request gets the same tokens and the same logprobs,
bit for bit, alone, amid 1, 7 and 15 concurrent requests with other prompts, on a prefix-cache hit,
and with its prompt prefilled in 16-token chunks by a second server.

The first server is the session's shared one (tests/conftest.py live_server: default settings but for a
512-block KV cache and a 2048 context, LIVE_SERVER_ARGS; nothing else runs on it while this test does);
the chunked one has the same flags plus --max-num-batched-tokens 16, so the chunking is the one difference.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from server_support import LIVE_SERVER_ARGS, real_model_available, start_real_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not real_model_available(), reason="default model not installed")]

SYSTEM = ("You are a concise assistant for a travel agency. Answer questions about geography, "
          "history and culture in plain sentences, and never make up facts you are unsure of.")
TARGET = "What is the capital of France? Answer in one sentence, then name one museum there."
OTHERS = [
    "Write a haiku about autumn leaves.",
    "List three prime numbers greater than 50.",
    "Explain what a hash table is to a child.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 times 23? Show the steps.",
    "Name the planets of the solar system in order.",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue? Two sentences.",
    "Write a Python function that reverses a string.",
    "Who wrote Pride and Prejudice?",
    "Describe the water cycle briefly.",
    "What are the three states of matter?",
    "Suggest a name for a black cat.",
    "Summarize the plot of Romeo and Juliet in two lines.",
    "How many continents are there? Name them.",
]


def _body(prompt: str, max_tokens: int) -> dict:
    return {"temperature": 0, "max_tokens": max_tokens, "logprobs": True,
            "top_logprobs": 5, "messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": prompt}]}


def _answer(resp: httpx.Response) -> tuple[str, list]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    steps = [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
             for t in choice["logprobs"]["content"]]
    return choice["message"]["content"], steps


async def _target_amid(url: str, others: int) -> tuple[str, list]:
    """The target request beside `others` concurrent ones: half start with it, half while it decodes,
    so its steps mix with their prefill chunks and their decodes."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def other(i: int) -> None:
            if i % 2:
                await asyncio.sleep(0.2 + 0.1 * i)
            r = await client.post("/v1/chat/completions", json=_body(OTHERS[i], 8 + 2 * i))
            assert r.status_code == 200, r.text

        results = await asyncio.gather(client.post("/v1/chat/completions", json=_body(TARGET, 24)),
                                       *(other(i) for i in range(others)))
    return _answer(results[0])


def test_greedy_output_is_batch_invariant(live_server, tmp_path):
    url = live_server.url
    alone = _answer(httpx.post(url + "/v1/chat/completions", json=_body(TARGET, 24), timeout=600))
    text, steps = alone
    assert text.strip() and len(steps) >= 8
    again = _answer(httpx.post(url + "/v1/chat/completions", json=_body(TARGET, 24), timeout=600))
    assert again == alone, "a prefix-cache hit changed the answer"
    for others in (1, 7, 15):
        got = asyncio.run(_target_amid(url, others))
        assert got[0] == text, f"beside {others} others: {got[0]!r} != {text!r}"
        assert got[1] == steps, f"beside {others} others the logprobs differ"
    chunked = start_real_server(str(tmp_path), *LIVE_SERVER_ARGS, "--max-num-batched-tokens", "16",
                                startup_timeout=900)
    try:
        got = _answer(httpx.post(chunked.url + "/v1/chat/completions", json=_body(TARGET, 24), timeout=600))
    finally:
        chunked.stop()
    assert got == alone, "prefilling in 16-token chunks changed the answer"
