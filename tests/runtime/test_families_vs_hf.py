"""Every supported family and RoPE scaling against transformers (fp32, eager) on tiny random checkpoints
that transformers itself built and saved (hf_checkpoints.py): as safetensors (transformers-5 config),
in the older `rope_scaling` config form, and as GGUF. First-step logits within fp32 tolerance; greedy
tokens identical alone, batched, with chunked prefill and on prefix hits."""
from __future__ import annotations

import functools

import pytest
import torch

from chatserve.core.outputs import ScheduledSeq, SchedulerOutput
from chatserve.core.request import SamplingParams

transformers = pytest.importorskip("transformers")
import hf_checkpoints as H  # noqa: E402  (tests/runtime is on sys.path via rootdir conftest)

BS = 8                                   # small blocks: a 40-token prompt spans 5 of them
N_NEW = 8
# llama.cpp has no dynamic NTK, no query_pre_attn_scalar, a fixed 10,000 base for Gemma 3's local layers
# and no dense layers among MoE ones (mlp_only_layers) nor a gpt-oss SwiGLU limit other than 7
GGUF_NAMES = [n for n in H.SPECS if n not in ("rope_dynamic", "gemma3_qpas", "qwen3moe_dense_layers",
                                               "gpt_oss_clamped")]
# prompt lengths per spec: one short, one over several blocks, one past the 24-token sliding window
PROMPTS = {n: (5, 40, 60) for n in H.SPECS}
PROMPTS["rope_dynamic"] = (5, 20, 30)    # + 8 new tokens run past its 32-token original context
PROMPTS["rope_longrope"] = (36, 44, 60)  # LongRoPE with a longer served context: every prompt is long
PROMPTS["phi3_longrope"] = (50, 56, 64)
MAX_LEN = {"rope_dynamic": 128}


@functools.lru_cache(maxsize=None)
def reference(name: str):
    return H.hf_model(name, seed=sum(map(ord, name)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """checkpoints(name, form) → path; form: safetensors | legacy (rope_scaling config) | gguf."""
    root = tmp_path_factory.mktemp("families")

    @functools.lru_cache(maxsize=None)
    def make(name: str, form: str) -> str:
        m = reference(name)
        if form == "gguf":
            return H.save_gguf(m, root / f"{name}.gguf")
        return H.save_safetensors(m, root / f"{name}-{form}", legacy_rope=form == "legacy")

    return make


def prompt_ids(name: str, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1000 + n)
    return torch.randint(3, H.TINY["vocab_size"], (n,), generator=g).tolist()


def hf_greedy(name: str, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = reference(name).generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def runner_for(path: str, name: str, fused: bool = True):
    """A ModelRunner on the checkpoint; fused=False swaps in the model built on the plain-torch ops."""
    from chatserve.config import offline_config
    from chatserve.runtime.model_runner import ModelRunner
    from chatserve.runtime.models import build_model
    from chatserve.runtime.weights import load_weights
    w = load_weights(path, "float32", progress=False)
    r = ModelRunner.from_config(offline_config(path, num_blocks=64, block_size=BS, num_threads=1, max_model_len=MAX_LEN.get(name)), weights=w)
    if not fused:
        r.model = build_model(w.config, w.tensors, torch.float32, "cpu", r.max_model_len, fused=False)
    return r


def run_greedy(runner, prompts: list[list[int]], chunk: int | None = None,
               shared: tuple[int, int] | None = None) -> list[list[int]]:
    """Greedy-decode the prompts as one batch through ModelRunner.execute with explicit block tables.
    chunk: prefill at most this many tokens per step. shared (src, dst): sequence dst starts with
    sequence src's full prompt blocks already computed (a prefix hit), after src finished its prefill."""
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW)
    per_seq = (max(map(len, prompts)) + N_NEW + BS - 1) // BS
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    pos = [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    active = set(range(len(prompts)))
    if shared is not None:
        src, dst = shared
        active.discard(dst)
    step = 0
    while any(len(outs[i]) < N_NEW for i in range(len(prompts))):
        if shared is not None and dst not in active and pos[src] >= len(prompts[src]):
            common = next((j for j, (a, b) in enumerate(zip(prompts[src], prompts[dst])) if a != b),
                          min(len(prompts[src]), len(prompts[dst])))
            k = min(common, len(prompts[dst]) - 1) // BS                # full blocks they share
            assert k > 0
            tables[dst][:k] = tables[src][:k]
            pos[dst] = k * BS
            active.add(dst)
        seqs, todo = [], []
        for i in sorted(active):
            if len(outs[i]) >= N_NEW:
                continue
            full = prompts[i] + outs[i]
            toks = full[pos[i]:]
            if chunk and len(toks) > chunk:
                toks = toks[:chunk]
            sample = pos[i] + len(toks) == len(full)
            seqs.append(ScheduledSeq(request_id=str(i), token_ids=toks, start_pos=pos[i],
                                     block_table=tables[i], sample=sample, params=params,
                                     prompt_token_ids=prompts[i], output_token_ids=list(outs[i])))
            todo.append((i, len(toks), sample))
        res = runner.execute(SchedulerOutput(step_id=step, seqs=seqs))
        assert not res.errors, res.errors
        for i, n, sample in todo:
            pos[i] += n
            if sample:
                outs[i].append(res.sampled[str(i)])
        step += 1
    return outs


def first_logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one prompt in one step (float32 [T, V])."""
    from chatserve_kernels import AttentionMetadata
    n = -(-len(ids) // BS)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n))], BS)
    with torch.inference_mode():
        h = runner.model.forward(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, meta)
        return runner.model.compute_logits(h)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


FORMS = [(n, f) for n in H.SPECS for f in ("safetensors", "legacy", "gguf")
         if f != "gguf" or n in GGUF_NAMES]


@pytest.mark.parametrize("name,form", FORMS, ids=[f"{n}-{f}" for n, f in FORMS])
def test_first_step_logits_match_transformers(checkpoints, name, form):
    runner = runner_for(checkpoints(name, form), name)
    ids = prompt_ids(name, PROMPTS[name][-1] if name != "rope_dynamic" else 30)
    ours = first_logits(runner, ids)
    with torch.inference_mode():
        ref = reference(name)(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


GREEDY_FORMS = [(n, f) for n in H.SPECS for f in ("safetensors", "gguf") if f != "gguf" or n in GGUF_NAMES]


@pytest.mark.parametrize("name,form", GREEDY_FORMS, ids=[f"{n}-{f}" for n, f in GREEDY_FORMS])
def test_greedy_tokens_match_transformers_alone_batched_chunked_and_on_prefix_hits(checkpoints, name, form):
    runner = runner_for(checkpoints(name, form), name)
    prompts = [prompt_ids(name, n) for n in PROMPTS[name]]
    expected = [hf_greedy(name, p) for p in prompts]
    assert any(len(set(e)) > 1 for e in expected)                 # not a degenerate repeat
    assert [run_greedy(runner, [p])[0] for p in prompts] == expected, "alone"
    assert run_greedy(runner, prompts) == expected, "batched"
    assert run_greedy(runner, prompts, chunk=BS + 3) == expected, "chunked prefill"
    # a prefix hit: the last prompt reuses the second one's blocks (same first 2 blocks of tokens)
    hit = prompts[1][:2 * BS] + prompts[2][2 * BS:]
    want = hf_greedy(name, hit)
    assert run_greedy(runner, [prompts[0], prompts[1], hit], shared=(1, 2))[2] == want, "prefix hit"


def test_torch_ops_and_fused_cpu_ops_agree(checkpoints):
    """The plain-torch oracle and the fused CPU backend run the same model to the same tokens."""
    for name in ("gemma3", "phi4mini", "qwen3"):
        path = checkpoints(name, "safetensors")
        a, b = runner_for(path, name), runner_for(path, name, fused=False)
        assert (a.model.ops.name, b.model.ops.name) == ("cpu_fused", "torch")
        prompts = [prompt_ids(name, n) for n in PROMPTS[name]]
        assert run_greedy(a, prompts) == run_greedy(b, prompts)


@pytest.mark.parametrize("name", ["mistral", "gemma3_qpas"])
def test_blocks_freed_past_the_window_keep_outputs_through_the_scheduler(checkpoints, name):
    """Every layer slides: the KV cache manager releases blocks that left the window while the real
    scheduler runs chunked prefills, batches and prefix hits, and the tokens still match transformers."""
    from chatserve.engine.llm import LLM
    llm = LLM(checkpoints(name, "safetensors"), block_size=BS, num_blocks=48, max_num_batched_tokens=24,
              num_threads=1, eos_token_ids=[])
    assert llm.kv.sliding_window == H.WINDOW
    prompts = [prompt_ids(name, n) for n in PROMPTS[name]]
    prompts.append(prompts[2][:40] + prompt_ids(name, 20, seed=1))       # a prefix hit on prompt 2
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW)
    assert llm.generate(prompts[:3], params) == [hf_greedy(name, p) for p in prompts[:3]]
    assert llm.generate(prompts[3:], params) == [hf_greedy(name, prompts[3])]
    assert llm.kv.window_drops > 0 and llm.kv.prefix_hits > 0
    llm.kv.check_integrity()


@pytest.mark.parametrize("name", ["qwen2moe", "gpt_oss_clamped"])
def test_moe_families_through_the_scheduler(checkpoints, name):
    """A MoE family (gpt-oss: sinks, alternating windows, so the cache keeps every block) under the real
    scheduler: chunked prefills, a batch and a prefix hit, tokens equal to transformers'."""
    from chatserve.engine.llm import LLM
    llm = LLM(checkpoints(name, "safetensors"), block_size=BS, num_blocks=48, max_num_batched_tokens=24,
              num_threads=1, eos_token_ids=[])
    assert llm.kv.sliding_window is None
    prompts = [prompt_ids(name, n) for n in PROMPTS[name]]
    prompts.append(prompts[2][:40] + prompt_ids(name, 20, seed=1))       # a prefix hit on prompt 2
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW)
    assert llm.generate(prompts[:3], params) == [hf_greedy(name, p) for p in prompts[:3]]
    assert llm.generate(prompts[3:], params) == [hf_greedy(name, prompts[3])]
    assert llm.kv.prefix_hits > 0
    llm.kv.check_integrity()
