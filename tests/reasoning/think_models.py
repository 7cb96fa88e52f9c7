"""Tiny reasoning checkpoints whose output is scripted: Qwen3 (transformers' Qwen3Config), a
DeepSeek-R1 distill shape (Qwen2Config) and gpt-oss (GptOssConfig: MoE, attention sinks), with the default
model's tokenizer plus the families' tokens (`<think>`, `</think>`, `<tool_call>`, DeepSeek's turn markers,
harmony's `<|channel|>`…) and their chat templates (templates/).

A random model never writes `<think>`, so the weights script it: attention and MLP outputs are zero, so
the last hidden state is the current token's embedding; each scripted token has its own basis vector,
and lm_head maps it to its successors with weights. The next token is thus a function of the current
one: a chain, with branches that a request picks with logit_bias or a grammar. (So one reply cannot hold
two harmony messages that need different successors of `<|channel|>`: each gpt-oss script is one message,
or one message repeated.) Any other token's
embedding is zero: all logits tie and token 0 (an EOS) ends the reply.
"""
from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
R1_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
R1_ADDED = ["<think>", "</think>"]
HARMONY_SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]
SCALE = 0.5          # logit = SCALE * weight * sqrt(hidden): 40 for weight 10


def _tokenizer(out: Path, added: list[str], special: list[str]):
    from tokenizers import AddedToken, Tokenizer
    from chatserve.runtime.tiny import default_tokenizer_dir
    tok = Tokenizer.from_file(str(default_tokenizer_dir() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(out / "tokenizer.json"))
    return tok


def _ids(tok, pieces: list[str]) -> list[int]:
    ids: list[int] = []
    for p in pieces:
        ids += tok.encode(p, add_special_tokens=False).ids
    return ids


def build(out: Path, family: str, chains: list[tuple[list[str], float]], hidden: int = 64) -> Path:
    """A checkpoint dir at `out`. `chains`: (pieces, weight): along the pieces' tokens each token's
    successor gets `weight` (a heavier chain wins where two leave the same token)."""
    import torch
    import transformers
    out.mkdir(parents=True, exist_ok=True)
    qwen, oss = family == "qwen3", family == "gpt_oss"
    added, special = ((QWEN_ADDED, []) if qwen else ([], HARMONY_SPECIAL) if oss else (R1_ADDED, R1_SPECIAL))
    tok = _tokenizer(out, added, special)
    vocab = tok.get_vocab_size()
    eos = "<|im_end|>" if qwen else "<|return|>" if oss else "<｜end▁of▁sentence｜>"
    bos = "<|im_start|>" if qwen else "<|endoftext|>" if oss else "<｜begin▁of▁sentence｜>"
    cls = transformers.Qwen3Config if qwen else transformers.GptOssConfig if oss else transformers.Qwen2Config
    extra = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32) if oss else {}
    cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=4096,
              tie_word_embeddings=False, bos_token_id=tok.token_to_id(bos), eos_token_id=tok.token_to_id(eos),
              **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    basis: dict[int, int] = {}
    succ: dict[tuple[int, int], float] = {}
    for pieces, weight in chains:
        ids = _ids(tok, pieces)
        for a, b in zip(ids, ids[1:]):
            basis.setdefault(a, len(basis))
            if any(k[0] == a and v == weight and k[1] != b for k, v in succ.items()):
                raise ValueError(f"token {tok.id_to_token(a)!r} has two successors of weight {weight}")
            succ[(a, b)] = max(weight, succ.get((a, b), 0.0))   # chains sharing a step keep the heavier
    assert len(basis) <= hidden, "more scripted tokens than hidden dimensions"
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            if k.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight",
                           "experts.down_proj")) or k.endswith("bias"):
                v.zero_()
            elif "norm" in k:
                v.fill_(1.0)
        for t, k in basis.items():
            sd["model.embed_tokens.weight"][t, k] = 1.0
        for (a, b), w in succ.items():
            sd["lm_head.weight"][b, basis[a]] += SCALE * w
    model.load_state_dict(sd)
    model.save_pretrained(str(out), safe_serialization=True)
    template = (TEMPLATES / ("qwen3.jinja" if qwen else "gpt_oss.jinja" if oss else "deepseek_r1.jinja")).read_text()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "eos_token": eos, "bos_token": bos if not qwen else None,
        "pad_token": "<|endoftext|>", "model_max_length": 4096, "add_bos_token": False}))
    if oss:         # gpt-oss's generation config: <|return|> and <|call|> end a turn, <|end|> does not
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [
            tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]}))
    return out


# ── the scripts ─────────────────────────────────────────────────────────────────────────────────
THOUGHT = ["Okay", ",", " the", " user", " says", " hi", "."]
ANSWER = ["Hello", " there", "!"]
CALL_JSON = '{"name":"now","arguments":{}}'


def qwen3_chains() -> list[tuple[list[str], float]]:
    """After the prompt's "\\n": `<think>`, a thought, `</think>`, then by weight: an answer (10), a
    Hermes tool call (6: logit_bias picks it), JSON (4: a grammar picks it); thinking switched off
    (the prompt ends "\\n\\n") goes straight to the answer."""
    return [(["\n", "<think>", *THOUGHT, "</think>", *ANSWER, "<|im_end|>"], 10.0),
            (["</think>", "<tool_call>", CALL_JSON, "</tool_call>", "<|im_end|>"], 6.0),
            (["</think>", CALL_JSON, "<|im_end|>"], 4.0),
            (["</think>", "{}"], 2.0),
            (["\n\n", *ANSWER], 10.0)]


def deepseek_chains() -> list[tuple[list[str], float]]:
    """The template opens the block (the prompt ends "<think>\\n"): a thought, `</think>`, an answer."""
    return [(["\n", *THOUGHT, "</think>", *ANSWER, "<｜end▁of▁sentence｜>"], 10.0),
            (["</think>", CALL_JSON, "<｜end▁of▁sentence｜>"], 4.0)]


# gpt-oss (harmony): the prompt ends with `<|start|>assistant`; a reply is one message (see the module doc)
HARMONY_THOUGHT = ["Okay", ",", " the", " user", " says", " hi"]
NOW_ARGS = '{"tz":"UTC"}'
FORCED_CALL = '[{"name":"now","arguments":{}}]'    # what a grammar (tool_choice required) picks
BRANCH_BIAS = 20     # logit_bias that picks a weight-7 or weight-6 branch over weight 10, and nothing else


def gpt_oss_chains() -> list[tuple[list[str], float]]:
    """After the prompt's `assistant`: `<|channel|>`, then by weight: the final answer (10); an analysis
    message (7: logit_bias BRANCH_BIAS on "analysis" and "Okay" picks it) that `<|end|>` closes and the next
    message repeats; a tool call in the commentary channel (6: logit_bias on "comment" and the arguments'
    first token picks it); the forced-call array (2: a grammar picks it, masking the heavier successors)."""
    return [(["assistant", "<|channel|>", "final", "<|message|>", *ANSWER, "<|return|>"], 10.0),
            (["<|channel|>", "analysis", "<|message|>", *HARMONY_THOUGHT, "<|end|>", "<|start|>", "assistant"],
             7.0),
            (["<|channel|>", "comment", "ary", " to", "=", "functions", ".", "now", " ", "<|constrain|>", "json",
              "<|message|>", NOW_ARGS, "<|call|>"], 6.0),
            (["istant", FORCED_CALL, "<|call|>"], 2.0)]
