"""The think script (a vLLM logits processor): after a prompt that opens an assistant turn it
forces `<think>\\n`, lets the model write N tokens of its own (no end of turn, no markup),
forces `\\n</think>\\n\\n` and then leaves the model alone; any other prompt, and any forced
token a grammar forbids, leave the logits as they are."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from worker.model_kind import KIND_FILE

with warnings.catch_warnings():  # vLLM's imports warn about torch APIs of theirs
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from worker.presets.think_script import RequestScript, Script, ThinkScript

VOCAB = 4098


@pytest.fixture(scope="module")
def script(think_model: Path) -> Script:
    return Script.from_record(json.loads((think_model / KIND_FILE).read_text())["think"])


def generate(
    script: Script,
    prompt: list[int],
    steps: int,
    think_tokens: int | None = None,
    mask: dict[int, list[int]] | None = None,
) -> list[int]:
    """Greedy decoding of a fake model whose favourite token is the end of turn (2), then
    ids 100, 101, ...; `mask[k]`: ids a grammar forbids at output position k."""
    req = RequestScript(script, script.think_tokens if think_tokens is None else think_tokens)
    out: list[int] = []
    for k in range(steps):
        logits = torch.zeros(VOCAB)
        logits[2] = 5.0
        logits[100 + k] = 4.0
        for banned in (mask or {}).get(k, []):
            logits[banned] = float("-inf")
        out.append(int(req(prompt, out, logits).argmax()))
    return out


def test_an_open_assistant_turn_thinks_then_answers(script: Script) -> None:
    prompt = [7, 8, *script.turn_start]
    n = script.think_tokens
    out = generate(script, prompt, len(script.open) + n + len(script.close) + 2)
    assert tuple(out[: len(script.open)]) == script.open
    thinking = out[len(script.open) : len(script.open) + n]
    # the model's own choice, its end of turn and the markup banned
    assert thinking == [100 + len(script.open) + i for i in range(n)]
    assert tuple(out[len(script.open) + n : -2]) == script.close
    assert out[-2:] == [2, 2]  # from there on the model's own logits: its favourite


def test_a_request_may_ask_for_another_length(script: Script) -> None:
    prompt = list(script.turn_start)
    out = generate(script, prompt, len(script.open) + 3 + len(script.close), think_tokens=3)
    assert tuple(out[len(script.open) + 3 :]) == script.close
    none = generate(script, prompt, len(script.open) + len(script.close), think_tokens=0)
    assert tuple(none) == script.open + script.close


def test_other_prompts_are_left_alone(script: Script) -> None:
    thinking_off = [*script.turn_start, *script.open, *script.close[1:]]
    for prompt in ([1, 2, 3], thinking_off, list(script.turn_start[:-1])):
        assert generate(script, prompt, 3) == [2, 2, 2]


def test_a_grammar_that_forbids_a_forced_token_wins(script: Script) -> None:
    """`tool_choice: required`: right after `</think>` the grammar allows only its tags."""
    n = script.think_tokens
    after_end = len(script.open) + n + len(script.close) - 1  # the `\n\n` after `</think>`
    out = generate(
        script, list(script.turn_start), after_end + 2, mask={after_end: [script.close[-1], 2]}
    )
    assert tuple(out[after_end - len(script.close) + 1 : after_end]) == script.close[:-1]
    assert out[after_end] == 100 + after_end  # the grammar's choice, not the script's
    assert out[after_end + 1] == 2  # and the script is over


def test_the_vllm_processor_reads_the_preset_and_checks_the_request(think_model: Path) -> None:
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(think_model)))
    proc = ThinkScript(config, torch.device("cpu"), False)  # type: ignore[arg-type]
    assert not proc.is_argmax_invariant()
    assert isinstance(proc.new_req_logits_processor(SamplingParams()), RequestScript)
    asked = proc.new_req_logits_processor(SamplingParams(extra_args={"think_tokens": 3}))
    assert isinstance(asked, RequestScript) and asked.think_tokens == 3
    ThinkScript.validate_params(SamplingParams(extra_args={"think_tokens": 0}))
    for bad in (-1, "3", 2.5, True):
        with pytest.raises(ValueError, match="think_tokens"):
            ThinkScript.validate_params(SamplingParams(extra_args={"think_tokens": bad}))
    plain = SimpleNamespace(model_config=SimpleNamespace(model=str(think_model.parent)))
    assert (
        ThinkScript(plain, torch.device("cpu"), False).new_req_logits_processor(  # type: ignore[arg-type]
            SamplingParams()
        )
        is None
    )
