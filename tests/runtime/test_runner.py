"""ModelRunner on tiny random checkpoints (block copies, per-request errors, sampler plumbing, cache
sizing) and the offline LLM driver through the real scheduler and KV cache manager."""
from __future__ import annotations

import pytest
import torch

from chatserve.core.outputs import CopyOp, ScheduledSeq, SchedulerOutput
from chatserve.core.request import SamplingParams
from chatserve.runtime.kv_cache import bytes_per_block
from chatserve.config import offline_config
from chatserve.runtime.model_runner import ModelRunner
from chatserve_kernels import AttentionMetadata

GREEDY = SamplingParams(temperature=0.0)


def seq(rid: str, ids: list[int], start: int, table: list[int], sample: bool = True, *,
        prompt: list[int]) -> ScheduledSeq:
    return ScheduledSeq(request_id=rid, token_ids=ids, start_pos=start, block_table=table,
                        sample=sample, params=GREEDY, prompt_token_ids=prompt)


@pytest.fixture(scope="module")
def runner(tiny_dirs) -> ModelRunner:
    return ModelRunner.from_config(offline_config(tiny_dirs["llama"], num_blocks=32, block_size=4, num_threads=1))


def test_attributes_and_budget_sizing(tiny_dirs, runner):
    assert (runner.num_blocks, runner.block_size, runner.max_model_len) == (32, 4, 2048)
    assert runner.config.num_layers == 2 and len(runner.kv_caches) == 2
    assert runner.kv_caches[0][0].shape == (32, 4, 2, 16)
    per_block = bytes_per_block(runner.config, 16, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 2 * 16 * 2
    r = ModelRunner.from_config(offline_config(tiny_dirs["llama"], dtype="bfloat16", block_size=16, kv_cache_memory=10 * per_block + 5, num_threads=1))
    assert r.num_blocks == 10 and r.kv_caches[0][0].dtype == torch.bfloat16


def test_small_steps_keep_every_core_for_big_decode_matmuls(tiny_dirs, monkeypatch):
    """num_threads auto: decode steps of torch ops leave a core to the event loop unless the model's
    decode matmuls are big enough (BIG_MATMUL_BYTES) that the second core's bandwidth wins."""
    import os
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores")
    small = ModelRunner.from_config(offline_config(tiny_dirs["llama"], num_blocks=8, block_size=4))
    per_matmul = small.model.decode_matmul_bytes()
    assert per_matmul == small.model.decode_weight_bytes(1) / (4 * 2 + 1) > 0
    assert small._threads_small == small._threads_big - 1
    monkeypatch.setattr(ModelRunner, "BIG_MATMUL_BYTES", int(per_matmul))
    big = ModelRunner.from_config(offline_config(tiny_dirs["llama"], num_blocks=8, block_size=4))
    assert big._threads_small == big._threads_big >= 2


def test_gpu_memory_utilization_sizing_rule():
    """KV budget = free - total * (1 - utilization): the device share this process may use, less what
    is already taken (weights, other processes). Verified here by arithmetic only; GPU run pending."""
    from chatserve.runtime.model_runner import gpu_kv_budget
    GiB = 2 ** 30
    assert gpu_kv_budget(60 * GiB, 80 * GiB, 0.9) == 52 * GiB        # 72 GiB usable, 20 GiB already used
    assert gpu_kv_budget(80 * GiB, 80 * GiB, 1.0) == 80 * GiB
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            gpu_kv_budget(60 * GiB, 80 * GiB, bad)
    with pytest.raises(ValueError, match="nothing left"):             # others already use over the share
        gpu_kv_budget(10 * GiB, 80 * GiB, 0.5)


def test_gpu_memory_utilization_sizes_the_cache_on_cuda_only(runner, monkeypatch):
    """The CUDA branch of ModelRunner._num_blocks with torch.cuda.mem_get_info patched (no GPU needed):
    the free/total it reports, after the weights, decide the block count; on CPU the flag is ignored
    in favour of --kv-cache-memory, and --num-gpu-blocks-override beats both."""
    from types import SimpleNamespace

    from chatserve.config import CacheConfig
    GiB = 2 ** 30
    seen = []

    def mem_get_info(device):
        seen.append(device)
        return 6 * GiB, 8 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    per = bytes_per_block(runner.config, 16, torch.float16)
    cuda = SimpleNamespace(device=torch.device("cuda", 0), config=runner.config, block_size=16,
                           dtype=torch.float16)
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9, kv_cache_memory=GiB)
    assert ModelRunner._num_blocks(cuda, cache) == int(6 * GiB - 8 * GiB * 0.1) // per
    assert seen == [torch.device("cuda", 0)]
    cpu = SimpleNamespace(**{**vars(cuda), "device": torch.device("cpu")})
    assert ModelRunner._num_blocks(cpu, cache) == GiB // per and len(seen) == 1
    assert ModelRunner._num_blocks(cuda, CacheConfig(num_blocks=7, gpu_memory_utilization=0.9)) == 7
    with pytest.raises(ValueError, match="nothing left"):
        ModelRunner._num_blocks(cuda, CacheConfig(gpu_memory_utilization=0.2))


def test_prefill_then_decode_samples_greedy_argmax(runner, contiguous_forward):
    prompt = [11, 22, 33, 44, 55, 66, 77]
    table = [9, 3]
    res = runner.execute(SchedulerOutput(1, [seq("a", prompt[:5], 0, table, sample=False, prompt=prompt)]))
    assert res.sampled == {} and not res.errors
    res = runner.execute(SchedulerOutput(2, [seq("a", prompt[5:], 5, table, prompt=prompt)]))
    first = res.sampled["a"]
    assert first == int(contiguous_forward(runner.model, prompt)[-1].argmax())
    res = runner.execute(SchedulerOutput(3, [seq("a", [first], 7, table, prompt=prompt)]))
    assert res.step_id == 3
    assert res.sampled["a"] == int(contiguous_forward(runner.model, prompt + [first])[-1].argmax())


def test_a_scheduled_row_names_its_prompt_and_prompt_rows_reach_the_linears_as_prompt_rows(runner, linear_rows):
    """The runner tells a prompt row from a generated one by position < len(prompt_token_ids): a caller
    that could leave the prompt out would send its prompt chunk down the decode kernels unnoticed."""
    with pytest.raises(TypeError, match="prompt_token_ids"):
        ScheduledSeq("a", [1, 2, 3], 0, [0], True, GREEDY)
    prompt = [11, 22, 33, 44, 55, 66]
    runner.execute(SchedulerOutput(1, [seq("a", prompt[:4], 0, [9, 3], sample=False, prompt=prompt)]))
    first = runner.execute(SchedulerOutput(2, [seq("a", prompt[4:], 4, [9, 3], prompt=prompt)])).sampled["a"]
    runner.execute(SchedulerOutput(3, [seq("a", [first], 6, [9, 3], prompt=prompt)]))
    assert runner.batch_invariant and linear_rows
    kinds = [r.all_gen for r in linear_rows]               # every Linear of a step sees the same split
    per_layer = len(kinds) // 3
    assert kinds == [False] * (2 * per_layer) + [True] * per_layer      # two prompt steps, one decode step


def test_copy_ops_copy_blocks_in_every_layer(runner):
    prompt = list(range(100, 108))
    runner.execute(SchedulerOutput(1, [seq("p", prompt, 0, [20, 21], sample=False, prompt=prompt)]))
    res = runner.execute(SchedulerOutput(2, [], copy_ops=[CopyOp(21, 30), CopyOp(20, 31)]))
    assert not res.errors
    for k, v in runner.kv_caches:
        assert torch.equal(k[30], k[21]) and torch.equal(v[31], v[20]) and k[21].abs().sum() > 0
    # the copied blocks serve a forked sequence: decoding from them matches decoding the original
    a = runner.execute(SchedulerOutput(3, [seq("p", [5], 8, [20, 21, 22], prompt=prompt)])).sampled["p"]
    b = runner.execute(SchedulerOutput(4, [seq("q", [5], 8, [31, 30, 23], prompt=prompt)])).sampled["q"]
    assert a == b


def test_bad_request_errors_alone(runner):
    ok = seq("ok", [1, 2, 3], 0, [4], prompt=[1, 2, 3])
    bad_block = seq("bad-block", [1, 2], 0, [999], prompt=[1, 2])
    bad_token = seq("bad-token", [10 ** 9], 0, [5], prompt=[10 ** 9])
    short_table = seq("short", [1, 2, 3, 4, 5], 0, [6], prompt=[1, 2, 3, 4, 5])
    res = runner.execute(SchedulerOutput(7, [bad_block, ok, bad_token, short_table]))
    assert set(res.errors) == {"bad-block", "bad-token", "short"}
    assert set(res.sampled) == {"ok"}


def test_drafts_are_verified_by_the_argmax_and_only_for_rows_that_may_draft(runner, contiguous_forward):
    prompt = [3, 1, 4, 1, 5]
    chain = list(prompt)
    for _ in range(3):                                           # the greedy continuation, 3 tokens
        chain.append(int(contiguous_forward(runner.model, chain)[-1].argmax()))
    nxt, g1, g2 = chain[len(prompt):]
    assert runner.execute(SchedulerOutput(1, [seq("ok", prompt, 0, [0, 1], prompt=prompt)])).sampled == {"ok": nxt}
    wrong = (g2 + 1) % runner.vocab_size
    drafted = seq("ok", [nxt, g1, wrong], len(prompt), [0, 1], prompt=prompt)
    drafted.draft_token_ids = [g1, wrong]
    sampled = ScheduledSeq(request_id="sampled", token_ids=[nxt, 7], start_pos=len(prompt), block_table=[2, 3],
                           sample=True, params=SamplingParams(temperature=0.8), prompt_token_ids=prompt,
                           draft_token_ids=[7])
    res = runner.execute(SchedulerOutput(2, [drafted, sampled]))
    assert res.accepted["ok"] == [g1, g2] and res.sampled["ok"] == g2    # g1 accepted, `wrong` replaced
    assert set(res.errors) == {"sampled"} and "sampled" not in res.accepted    # never drafted: an error


def test_sampler_interface(runner, monkeypatch):
    calls = {}

    class Recorder:
        def __call__(self, logits, seqs):
            calls["shape"] = tuple(logits.shape)
            calls["dtype"] = logits.dtype
            calls["ids"] = [s.request_id for s in seqs]
            return [7] * len(seqs), [None] * len(seqs)

        def drop(self, ids):
            calls["dropped"] = list(ids)

        def prefetch_masks(self, seqs, vocab_size):
            calls["prefetched"] = [s.request_id for s in seqs]

    monkeypatch.setattr(runner, "sampler", Recorder())
    res = runner.execute(SchedulerOutput(1, [seq("x", [1, 2], 0, [10], sample=False, prompt=[1, 2]),
                                             seq("y", [3], 0, [11], prompt=[3]), seq("z", [4, 5], 0, [12], prompt=[4, 5])],
                                         finished_ids=["gone"]))
    assert calls == {"dropped": ["gone"], "prefetched": ["y", "z"], "shape": (2, runner.vocab_size),
                     "dtype": torch.float32, "ids": ["y", "z"]}
    assert res.sampled == {"y": 7, "z": 7}


def test_sampler_failure_isolated_to_its_row(runner, monkeypatch):
    class Picky:
        def __call__(self, logits, seqs):
            if any(s.request_id == "boom" for s in seqs):
                raise ValueError("bad params")
            return [1] * len(seqs), [None] * len(seqs)

        def drop(self, ids):
            pass

        def prefetch_masks(self, seqs, vocab_size):
            pass

    monkeypatch.setattr(runner, "sampler", Picky())
    res = runner.execute(SchedulerOutput(1, [seq("fine", [1], 0, [13], prompt=[1]), seq("boom", [2], 0, [14], prompt=[2])]))
    assert res.sampled == {"fine": 1} and "boom" in res.errors


# --------------------------------------------------------------------------- the offline driver
@pytest.fixture(scope="module")
def llm(tiny_dirs):
    from chatserve.engine.llm import LLM
    return LLM(tiny_dirs["qwen2"], block_size=4, num_blocks=64, max_num_batched_tokens=16,
               max_num_seqs=4, num_threads=1, eos_token_ids=[])


def test_llm_generate_greedy_matches_stepwise_argmax(llm, contiguous_forward):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [40, 41], [7] * 9]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [len(o) for o in outs] == [6, 6, 6]
    for p, o in zip(prompts, outs):       # chunked prefill (16-token budget) + batched decode
        seqn = list(p)
        for tok in o:
            assert tok == int(contiguous_forward(llm.runner.model, seqn)[-1].argmax())
            seqn.append(tok)
    llm.kv.check_integrity()
    # every block is allocatable again: clean, or cached for prefix hits and evictable
    assert llm.kv.enable_prefix_caching and llm.kv.pool.num_used == 0
    assert llm.kv.num_free_blocks == llm.kv.num_blocks


def test_llm_generate_n_and_eos(llm):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    outs = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=5, n=3, seed=11))
    assert len(outs) == 1 and len(outs[0]) == 3 and all(len(o) == 5 for o in outs[0])
    again = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=5, n=3, seed=11))
    assert again == outs                                  # per-request seeds
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0]
    llm._eos = frozenset([greedy[2]])
    try:
        stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5))[0]
    finally:
        llm._eos = frozenset()
    assert stopped == greedy[:greedy.index(greedy[2]) + 1]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_cache_tracks_full_precision(tiny_dirs, runner, contiguous_forward, kv_dtype):
    q = ModelRunner.from_config(offline_config(tiny_dirs["llama"], num_blocks=8, block_size=4, num_threads=1, kv_cache_dtype=kv_dtype))
    k, v, ks, vs = q.kv_caches[0]
    assert ks.shape == (8, 4, 2) and k.element_size() == 1
    # 2 layers x 4 tokens x (K and V: 2 heads x 16 one-byte codes + 2 fp32 scales)
    assert q.bytes_per_block == 2 * 4 * 2 * (2 * 16 + 2 * 4) == 640
    assert runner.bytes_per_block == 2 * 4 * 2 * (2 * 16 * 4) == 2048
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99]
    q.execute(SchedulerOutput(1, [seq("a", prompt[:-1], 0, [5, 1, 7], sample=False, prompt=prompt)]))
    # CoW of the two full blocks (codes and scales), then decode the last token from the copies
    q.execute(SchedulerOutput(2, [], copy_ops=[CopyOp(5, 2), CopyOp(1, 3)]))
    assert torch.equal(q.kv_caches[1][2][2], q.kv_caches[1][2][5])
    logits = {}
    for table in ([5, 1, 7], [2, 3, 6]):
        q.execute(SchedulerOutput(3, [seq("a", prompt[-1:], 8, table, sample=False, prompt=prompt)]))
        meta_ids = torch.tensor(prompt[-1:])
        meta = AttentionMetadata.build([1], [9], [table], 4)
        with torch.inference_mode():
            h = q.model.forward(meta_ids, torch.tensor([8]), q.kv_caches, meta)
            logits[tuple(table)] = q.model.compute_logits(h)[0]
    a, b = logits.values()
    assert torch.equal(a, b)
    ref = contiguous_forward(runner.model, prompt)[-1]
    assert torch.nn.functional.cosine_similarity(a, ref, dim=0) > 0.99


def test_prompt_logprobs_only_for_the_sequences_that_ask(runner, contiguous_forward):
    """A 4-token chunk of a 6-token prompt yields the logprobs of prompt tokens 1..4 (log_softmax of the
    contiguous forward's logits at positions 0..3); the last chunk adds token 5; others get none."""
    prompt = [5, 9, 2, 7, 11, 3]
    ask = SamplingParams(temperature=0.0, prompt_logprobs=2)
    ref = torch.log_softmax(contiguous_forward(runner.model, prompt), -1)
    a = ScheduledSeq("a", prompt[:4], 0, [0, 1], False, ask, prompt)
    b = ScheduledSeq("b", prompt[:4], 0, [2, 3], False, GREEDY, prompt)
    res = runner.execute(SchedulerOutput(step_id=1, seqs=[a, b]))
    assert list(res.prompt_logprobs) == ["a"]
    got = res.prompt_logprobs["a"]
    assert [lp.token_id for lp in got] == prompt[1:5]
    for p, lp in enumerate(got):
        assert abs(lp.logprob - float(ref[p, prompt[p + 1]])) < 1e-4
        assert lp.rank == int((ref[p] > ref[p, prompt[p + 1]]).sum()) + 1
        assert [i for i, _ in lp.top] == ref[p].topk(2).indices.tolist()
    last = runner.execute(SchedulerOutput(step_id=2, seqs=[ScheduledSeq("a", prompt[4:], 4, [0, 1], True,
                                                                        ask, prompt)]))
    assert [lp.token_id for lp in last.prompt_logprobs["a"]] == [prompt[5]] and "a" in last.sampled
