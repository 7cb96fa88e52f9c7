"""Loading is exact: a checkpoint tensor nothing consumes, or a needed one that is missing, refuses to
load naming them (known harmless extras excepted); unsupported architectures say so in one line;
a GGUF's sliding window is read (issue 23)."""
from __future__ import annotations

import pytest
import torch

import hf_checkpoints as H
from chatserve.runtime.arch_config import UnsupportedModelError
from chatserve.runtime.weights import load_weights

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return H.save_safetensors(H.hf_model("llama_bias"), tmp_path_factory.mktemp("exact") / "m")


_with_tensors, _build = H.with_tensors, H.build_exact


def test_unused_tensor_is_a_load_error_naming_it(llama_dir, tmp_path):
    def add(t):
        t["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
        t["model.layers.1.rotary_emb.inv_freq"] = torch.zeros(8)          # harmless: allowed
    with pytest.raises(UnsupportedModelError, match="would not use: model.layers.0.self_attn.q_proj.lora_A"):
        _build(_with_tensors(llama_dir, tmp_path / "m", add))


def test_bias_the_config_does_not_declare_is_not_silently_dropped(llama_dir, tmp_path):
    import json
    d = _with_tensors(llama_dir, tmp_path / "m", lambda t: None)
    cfg = json.loads(open(f"{d}/config.json").read())
    cfg["mlp_bias"] = False
    open(f"{d}/config.json", "w").write(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="mlp.down_proj.bias"):
        _build(d)


def test_missing_tensor_is_a_load_error_naming_it(llama_dir, tmp_path):
    def drop(t):
        del t["model.layers.1.self_attn.o_proj.bias"]
        del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(UnsupportedModelError, match="lacks .*o_proj.bias, .*up_proj.weight"):
        _build(_with_tensors(llama_dir, tmp_path / "m", drop))


def test_the_exact_checkpoint_loads(llama_dir):
    m = _build(llama_dir)
    assert m.layers[0].o.b is not None and m.layers[0].mlp.down.b is not None


def test_gguf_of_an_unknown_architecture_refuses_in_one_line(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'mamba' is not supported") as e:
        load_weights(tmp_path / "m.gguf", progress=False)
    assert "\n" not in str(e.value)


def test_gguf_sliding_window_is_read(tmp_path):
    w = load_weights(H.save_gguf(H.hf_model("mistral"), tmp_path / "m.gguf"), progress=False)
    assert w.config.sliding_window == H.WINDOW and w.config.kv_window == H.WINDOW
    g = load_weights(H.save_gguf(H.hf_model("gemma2"), tmp_path / "g.gguf"), progress=False)
    assert [g.config.layer_window(i) for i in range(4)] == [H.WINDOW, None, H.WINDOW, None]
    assert g.config.kv_window is None                  # global layers keep every block


@pytest.mark.parametrize("edit,message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"rope_scaling": {"rope_type": "mystery", "factor": 2.0}}, "RoPE scaling type 'mystery' is not supported"),
])
def test_generate_refuses_an_unsupported_checkpoint_in_one_line(tmp_path, edit, message):
    import json
    import subprocess
    import sys
    from chatserve.runtime.tiny import make_tiny_model
    d = make_tiny_model(tmp_path / "m", "llama", tokenizer=True)
    cfg = json.loads(open(f"{d}/config.json").read())
    cfg.update(edit)
    open(f"{d}/config.json", "w").write(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "chatserve.cli", "generate", "--model", d, "--prompt", "hi",
                        "--max-tokens", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
