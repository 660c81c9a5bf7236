"""`ctxcache model create`: loadable, deterministic, and its outputs re-tokenize to themselves."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from worker.engine.runner import ModelRunner
from worker.presets import create_model
from worker.presets.tokenizer import EOS


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_tiny_preset_is_a_gqa_model_with_a_chat_template(tiny_model: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model)
    assert config.model_type == "qwen2" and config.max_position_embeddings == 4096
    assert config.num_key_value_heads < config.num_attention_heads
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a real BPE: common words are single tokens
    assert len(tok.encode(" return", add_special_tokens=False)) == 1


def test_same_preset_same_files(tiny_model: Path, tmp_path: Path) -> None:
    again = create_model("tiny", tmp_path / "again")
    assert _digest(again) == _digest(tiny_model)


def test_every_producible_sequence_re_tokenizes_to_itself(runner: ModelRunner) -> None:
    tok = runner.tokenizer
    assert runner.logit_mask is not None
    allowed = (~runner.logit_mask).nonzero().flatten().tolist()
    assert len(allowed) > 500 and tok.convert_tokens_to_ids(EOS) in allowed
    words = [t for t in allowed if t not in runner.eos_ids]
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=rng))
        seq = [words[int(i)] for i in torch.randint(0, len(words), (n,), generator=rng)]
        assert tok.encode(tok.decode(seq), add_special_tokens=False) == seq
    # and as the assistant turn of a chat, rendered back from text
    reply = words[:12]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": tok.decode(reply)}],
        tokenize=True,
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=True
    )
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    assert ids[len(prompt) : len(prompt) + len(reply)] == reply


def test_zeroed_rows_are_never_sampled(runner: ModelRunner) -> None:
    ids = torch.randint(3, 4000, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = runner.full_logits(ids)
    assert runner.logit_mask is not None
    assert torch.isinf(logits[:, runner.logit_mask]).all()
    assert not runner.logit_mask[logits.argmax(dim=-1)].any()
