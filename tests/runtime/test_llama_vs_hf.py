"""The default model (SmolLM2 GGUF) against transformers loading the same file itself (fp32), and the
weight-only quantized Linear. Every other family and RoPE scaling: test_families_vs_hf.py."""
from __future__ import annotations

import pytest
import torch

from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
from chatserve.core.request import SamplingParams

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "How do I boil an egg?",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    from chatserve.runtime.tiny import default_tokenizer_dir
    return transformers.AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):   # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_default_last_logits_match_transformers(default_model, default_hf, contiguous_forward,
                                                hf_tokenizer):
    ids = chat_ids(hf_tokenizer, CHAT_PROMPTS[0])
    ours = contiguous_forward(default_model, ids)[-1]
    with torch.inference_mode():
        ref = default_hf(torch.tensor([ids])).logits[0, -1].float()
    assert rel_err(ours, ref) < 1e-3
    assert int(ours.argmax()) == int(ref.argmax())


def greedy_with_runner(runner, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Greedy decode all prompts as one batch through ModelRunner.execute on the paged cache."""
    bs = runner.block_size
    params = SamplingParams(temperature=0.0, max_tokens=n_new)
    per_seq = (max(map(len, prompts)) + n_new + bs - 1) // bs
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(len(prompts))]
    outs: list[list[int]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]
    pos = [0] * len(prompts)
    for step in range(n_new):
        seqs = [ScheduledSeq(request_id=str(i), token_ids=pending[i], start_pos=pos[i],
                             block_table=tables[i], sample=True, params=params,
                             prompt_token_ids=prompts[i], output_token_ids=list(outs[i]))
                for i in range(len(prompts))]
        res = runner.execute(SchedulerOutput(step_id=step, seqs=seqs))
        assert not res.errors, res.errors
        for i in range(len(prompts)):
            pos[i] += len(pending[i])
            tok = res.sampled[str(i)]
            outs[i].append(tok)
            pending[i] = [tok]
    return outs


@pytest.fixture(scope="module")
def default_runner(default_path, default_weights):
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner
    return ModelRunner.from_config(offline_config(default_path, num_blocks=5 * 8, block_size=16, max_model_len=4096, num_threads=1), weights=default_weights)


def test_default_greedy_32_tokens_match_transformers(default_runner, default_hf, hf_tokenizer):
    prompts = [chat_ids(hf_tokenizer, p) for p in CHAT_PROMPTS]
    ours = greedy_with_runner(default_runner, prompts, 32)
    for ids, got in zip(prompts, ours):
        with torch.inference_mode():
            ref = default_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert got == ref, (hf_tokenizer.decode(got), hf_tokenizer.decode(ref))


def test_capital_of_france_is_paris(default_runner):
    from chatserve.text import Tokenizer
    tok = Tokenizer.from_model(default_runner.model_path)
    ids = list(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = greedy_with_runner(default_runner, [ids], 16)[0]
    assert "Paris" in tok.decode(out)


def test_bf16_model_close_to_fp32(default_path, default_weights, default_model, contiguous_forward,
                                  hf_tokenizer):
    from chatserve.runtime.models.llama import LlamaModel
    ids = chat_ids(hf_tokenizer, CHAT_PROMPTS[1])
    bf = LlamaModel(default_weights.config, default_weights.tensors, torch.bfloat16, "cpu",
                    max_model_len=1024)
    a = contiguous_forward(bf, ids)[-1]
    b = contiguous_forward(default_model, ids)[-1]
    assert a.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99
    assert int(a.argmax()) == int(b.argmax())


def test_int8_weight_only_linear_close_to_dense():
    from chatserve.runtime.models.layers import Linear
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(3, 64, generator=g)
    lin = Linear(w, b, "int8", small_m=4)
    if lin.qw is not None:                                            # cpu_qmatmul: 8-bit codes
        assert (lin.qw.bits, lin.qw.n, lin.qw.k) == (8, 96, 64)
    else:                                                             # torch's int8 kernel
        assert lin.wq.dtype == torch.int8 and lin.wq.shape == (96, 64)
    dense = torch.nn.functional.linear(x, w, b)
    assert rel_err(lin(x), dense) < 2e-2                              # int8 path (3 rows <= 4)
    assert torch.equal(lin(x.repeat(2, 1)), torch.nn.functional.linear(x.repeat(2, 1), w, b))  # dense
    with pytest.raises(ValueError):
        Linear(w, None, "int3")


def test_int4_weight_only_linear_close_to_dense():
    from chatserve.runtime.models.layers import Linear
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(3, 64, generator=g)
    lin = Linear(w, b, "int4", small_m=4)
    assert lin.kind == "int4"
    if lin.qw is not None:                                            # cpu_qmatmul's packed codes
        assert (lin.qw.bits, lin.qw.n, lin.qw.k) == (4, 96, 64)
    else:                                                             # [K/32 groups, N, (scale, zero)]
        assert lin.scales.shape == (2, 96, 2)
    dense = torch.nn.functional.linear(x, w, b)
    assert rel_err(lin(x), dense) < 0.15                              # 16 levels per group of 32
    # a weight already on a 16-level grid per group (as GGUF Q4_1 is) comes back near-exactly
    lo = torch.randn(96, 2, 1, generator=g)
    grid = lo + 0.05 * torch.randint(0, 16, (96, 2, 32), generator=g)
    grid[..., 0], grid[..., 1] = lo[..., 0], lo[..., 0] + 0.75      # codes 0 and 15 in every group
    wg = grid.reshape(96, 64)
    assert rel_err(Linear(wg, None, "int4", small_m=4)(x), x @ wg.t()) < 1e-2   # bf16 or int8 activations
    assert torch.equal(lin(x.repeat(2, 1)), torch.nn.functional.linear(x.repeat(2, 1), w, b))  # dense
    assert Linear(torch.randn(8, 48), None, "int4").kind == "int8"    # K % 32 != 0 falls back


def test_int4_decode_model_tracks_fp32(default_weights, default_model, contiguous_forward, hf_tokenizer):
    from chatserve.runtime.models.llama import LlamaModel
    q = LlamaModel(default_weights.config, default_weights.tensors, torch.float32, "cpu",
                   max_model_len=1024, weight_quant="int4")
    assert q.lm_head.kind == "int8"                                   # the head stays int8
    ids = chat_ids(hf_tokenizer, CHAT_PROMPTS[2])
    step_q = contiguous_forward(q, ids[-1:])[-1]                      # one row: the int4 path
    step_f = contiguous_forward(default_model, ids[-1:])[-1]
    assert torch.nn.functional.cosine_similarity(step_q, step_f, dim=0) > 0.99
    assert int(step_q.argmax()) == int(step_f.argmax())


def test_int8_decode_model_tracks_fp32(default_weights, default_model, contiguous_forward, hf_tokenizer):
    from chatserve.runtime.models.llama import LlamaModel
    q = LlamaModel(default_weights.config, default_weights.tensors, torch.float32, "cpu",
                   max_model_len=1024, weight_quant="int8")
    ids = chat_ids(hf_tokenizer, CHAT_PROMPTS[2])
    # the prompt's layers run dense (more than 8 rows); one-row steps run int8
    a = contiguous_forward(q, ids)[-1]
    b = contiguous_forward(default_model, ids)[-1]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999
    assert int(a.argmax()) == int(b.argmax())
    step_q = contiguous_forward(q, ids[-1:])[-1]
    step_f = contiguous_forward(default_model, ids[-1:])[-1]
    assert torch.nn.functional.cosine_similarity(step_q, step_f, dim=0) > 0.99
    assert int(step_q.argmax()) == int(step_f.argmax())
