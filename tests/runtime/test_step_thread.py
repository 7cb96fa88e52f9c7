"""The engine loads the model and runs every step on one dedicated thread (torch's OpenMP keeps a
worker team per calling thread; a model loaded on another thread stepped up to 2x slower)."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from chatserve.config import EngineConfig
from chatserve.core.outputs import RunnerOutput
from chatserve.core.request import SamplingParams
from chatserve.engine import AsyncEngine
from chatserve.runtime.device import resolve_dtype
from chatserve.runtime.tiny import default_tokenizer_dir
from chatserve.text import Tokenizer


@pytest.mark.parametrize("start", ["load", "start"])
def test_load_and_steps_share_one_thread(monkeypatch, start):
    import chatserve.runtime.model_runner as mr
    threads = {"init": set(), "step": set()}

    class StubRunner:
        def __init__(self):
            threads["init"].add(threading.get_ident())
            self.num_blocks, self.max_model_len, self.block_size = 32, 64, 16
            self.model_path, self.model_key, self.kv_window = "/nonexistent.gguf", "stub", None
            self.vocab_size, self.eos_token_ids, self.kv_cache_dtype = 64, (), "auto"

        @classmethod
        def from_config(cls, config, **kw):              # the builder's one call
            return cls()

        def warm_up(self):
            threads["step"].add(threading.get_ident())
            return 0.0

        def execute(self, out):
            threads["step"].add(threading.get_ident())
            return RunnerOutput(step_id=out.step_id, sampled={s.request_id: 5 for s in out.seqs if s.sample})

    monkeypatch.setattr(mr, "ModelRunner", StubRunner)
    base = EngineConfig()
    tok = Tokenizer.from_model(str(default_tokenizer_dir()))
    eng = AsyncEngine(replace(base, model=replace(base.model, model="/nonexistent.gguf")), tokenizer=tok)

    async def run():
        if start == "load":
            eng.load()
        await eng.start()
        async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), request_id="r"):
            pass
        await eng.shutdown(drain_timeout=1)

    asyncio.run(run())
    assert len(threads["init"]) == 1 and threads["init"] == threads["step"]
    assert threading.get_ident() not in threads["step"]


def test_dtype_auto():
    import torch
    assert resolve_dtype("float32", torch.device("cpu")) == "float32"
    assert resolve_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu")) in ("bfloat16", "float32")
