"""Prompt logprobs through the official openai SDK against the tiny random-weight model served by
`chatserve serve`: completions `echo` + `logprobs` (what lm-eval sends: echo=True, max_tokens=0) and
vLLM's `prompt_logprobs` on completions and chat, checked against transformers' own LlamaForCausalLM
loaded from the same checkpoint; over chunked prefill (a 32-token step budget) and after a prefix hit."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_support import start_real_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 2e-3
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)   # ~70 tokens: 3 chunks of 32


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # float32: the reference is fp32 (bf16 is auto on some CPUs)
    srv = start_real_server(str(tmp_path_factory.mktemp("plp")), "--model", tiny_model, "--kv-blocks", "256",
                            "--max-model-len", "1024", "--max-num-batched-tokens", "32", "--dtype", "float32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """ids → log_softmax [T, V] from transformers' LlamaForCausalLM on the same checkpoint (fp32, eager)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                              attn_implementation="eager").eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return run


def ids_of(server, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def check_echo(lp, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """Legacy completions logprobs of an echoed prompt: null first, then each token's logprob."""
    assert len(lp.tokens) >= len(ids) > 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    got = torch.tensor(lp.token_logprobs[1:len(ids)])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(got, want, atol=TOL), float((got - want).abs().max())
    for p in range(1, len(ids)):
        top = lp.top_logprobs[p]
        assert k <= len(top) <= k + 1                     # the k most likely, and the prompt token
        best = float(ref[p - 1].max())
        assert abs(max(top.values()) - best) < TOL


def check_vllm(plp: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs: null first, then {token id: {logprob, rank, decoded_token}}."""
    assert len(plp) == len(ids) > 1 and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        tid = ids[p]
        row = ref[p - 1]
        mine = entry[str(tid)]
        assert abs(mine["logprob"] - float(row[tid])) < TOL
        v = float(row[tid])
        assert int((row > v + TOL).sum()) + 1 <= mine["rank"] <= int((row > v - TOL).sum()) + 1
        assert isinstance(mine["decoded_token"], str)
        top = torch.topk(row, k)
        for want, i in zip(top.values.tolist(), top.indices.tolist()):
            if str(i) != str(tid):
                assert str(i) in entry and abs(entry[str(i)]["logprob"] - want) < TOL
        assert k <= len(entry) <= k + 1


def test_echo_logprobs_max_tokens_0_as_lm_eval_sends_it(client, server, reference):
    text = "Paris is the capital of France"
    ids = ids_of(server, text)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=text, echo=True,
                                  logprobs=2, max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    assert len(c.logprobs.tokens) == len(ids)
    check_echo(c.logprobs, ids, reference(ids), 2)
    # lm-eval's own form: token-id prompts in a batch, logprobs=1
    batch = [ids, ids_of(server, LONG)]
    rb = client.completions.create(model=r.model, prompt=batch, echo=True, logprobs=1, max_tokens=0)
    assert [ch.index for ch in rb.choices] == [0, 1]
    for ch, p in zip(rb.choices, batch):
        assert len(ch.logprobs.token_logprobs) == len(p)
        check_echo(ch.logprobs, p, reference(p), 1)


def test_echo_logprobs_then_generated_tokens(client, server, reference):
    text = "One two three four"
    ids = ids_of(server, text)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=text, echo=True, logprobs=3,
                                  max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.text.startswith(text) and r.usage.completion_tokens == 4
    assert len(c.logprobs.tokens) == len(ids) + 4
    assert None not in c.logprobs.token_logprobs[1:]
    check_echo(c.logprobs, ids, reference(ids), 3)
    # the generated tokens' offsets continue after the prompt text
    assert c.logprobs.text_offset[len(ids)] == len(text)
    # streamed (as vLLM): the choice's first chunk carries the prompt and its logprobs
    chunks = [ch for ch in client.completions.create(
        model=r.model, prompt=text, echo=True, logprobs=3, max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert chunks and chunks[0].choices[0].text.startswith(text)
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and len(first.tokens) >= len(ids)
    check_echo(first, ids, reference(ids), 3)
    streamed = sum((ch.choices[0].logprobs.token_logprobs for ch in chunks if ch.choices[0].logprobs), [])
    assert streamed[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs_on_completions_chunked_and_after_a_prefix_hit(client, server, reference):
    model = client.models.list().data[0].id
    ids = ids_of(server, LONG)
    assert len(ids) > 64                                  # three prefill chunks at 32 tokens a step
    warm = client.completions.create(model=model, prompt=LONG + " again", max_tokens=1)
    again = client.completions.create(model=model, prompt=LONG + " again", max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 48 and warm.usage.prompt_tokens > 64
    r = client.completions.create(model=model, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    assert r.usage.prompt_tokens_details.cached_tokens == 0   # recomputed from position 0
    check_vllm(r.choices[0].model_extra["prompt_logprobs"], ids, reference(ids), 2)
    assert r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=ids, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 2})
    assert e.value.body["param"] == "prompt_logprobs"


def test_vllm_prompt_logprobs_on_chat(client, server, reference):
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    t = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=30)
    ids = t.json()["tokens"]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=2, n=2,
                                       extra_body={"prompt_logprobs": 1})
    plp = r.model_extra["prompt_logprobs"]
    check_vllm(plp, ids, reference(ids), 1)
    assert len(r.choices) == 2 and all(c.finish_reason for c in r.choices)
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=1)
    assert plain.model_extra.get("prompt_logprobs") is None
