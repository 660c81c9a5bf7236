"""The thinking presets' script: a vLLM logits processor that makes random weights think.

A trained thinking model opens `<think>`, reasons, closes `</think>` and answers. Random
weights never write the markup, so the tests would see no reasoning. This processor, which
`ctxcache vllm` loads for a preset whose record names it (`--logits-processors`; a real
thinking model needs nothing of it), writes the markup and leaves the words to the model:

- a request whose prompt ends in an open assistant turn (`<|im_start|>assistant\\n`: the
  generation prompt with thinking on) gets `<think>\\n` as its first output tokens;
- then `think_tokens` tokens of the model's own (the preset's record, e.g. 12; a request
  may ask for another count with `vllm_xargs: {"think_tokens": N}`), with the end of turn
  and the think markup banned, so the thinking always has that length;
- then `\\n</think>\\n\\n`, and from there on the model's own logits, untouched.

A prompt that ends otherwise (thinking off: the template closed an empty block) is left
alone, so is every token of the answer: answers still follow from the prompt's KV, and
greedy answers stay comparable. Every forced token yields to a constraint that forbids it
(a structured-output grammar masks the logits before this runs: with `tool_choice:
required` it allows only `<tool_call>` right after `</think>`); the script then stops.
Where a request is in its script is a function of its output tokens, so preemption and
recomputation replay it exactly. Tested on vLLM's CPU backend (no async scheduling).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from ctxcache.vllm_reasoning import preset_record

log = logging.getLogger(__name__)

XARG = "think_tokens"  # vllm_xargs key: this request's thinking length
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Script:
    """The preset's token ids (worker/presets/think.py, `script_record`)."""

    turn_start: tuple[int, ...]
    open: tuple[int, ...]
    close: tuple[int, ...]
    think_tokens: int
    banned: tuple[int, ...]

    @classmethod
    def from_record(cls, row: dict) -> Script:
        return cls(
            turn_start=tuple(row["turn_start"]),
            open=tuple(row["open"]),
            close=tuple(row["close"]),
            think_tokens=int(row["think_tokens"]),
            banned=tuple(row["banned"]),
        )

    def applies(self, prompt_ids: Sequence[int]) -> bool:
        n = len(self.turn_start)
        return len(prompt_ids) >= n and tuple(prompt_ids[-n:]) == self.turn_start

    def forced(self, output_ids: Sequence[int], think_tokens: int) -> int | bool | None:
        """The token output position `len(output_ids)` must be; None: the model's own with
        `banned` masked (thinking); False: the model's own (the script is over or left)."""
        k, o = len(output_ids), len(self.open)
        if k < o:
            return self.open[k] if tuple(output_ids) == self.open[:k] else False
        if tuple(output_ids[:o]) != self.open:
            return False
        if k < o + think_tokens:
            return None
        done = k - o - think_tokens
        if done >= len(self.close) or tuple(output_ids[o + think_tokens :]) != self.close[:done]:
            return False
        return self.close[done]


class RequestScript:
    """One request's script: called by vLLM with its prompt, its outputs so far, its logits."""

    def __init__(self, script: Script, think_tokens: int) -> None:
        self.script = script
        self.think_tokens = think_tokens
        self.active: bool | None = None  # decided on the first call, from the prompt

    def __call__(
        self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        if self.active is None:
            self.active = self.script.applies(prompt_ids)
        if not self.active:
            return logits
        want = self.script.forced(output_ids, self.think_tokens)
        if want is False:
            self.active = False
            return logits
        if want is None:
            logits[list(self.script.banned)] = NEG_INF
            return logits
        assert isinstance(want, int)
        if bool(torch.isneginf(logits[want])):  # a grammar forbids it: the grammar wins
            self.active = False
            return logits
        logits.fill_(NEG_INF)
        logits[want] = 0.0
        return logits


class ThinkScript(AdapterLogitsProcessor):
    """vLLM's `--logits-processors worker.presets.think_script:ThinkScript`: the script of
    the served preset's record (`think`); a model without one is left alone."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        row = (preset_record(str(vllm_config.model_config.model)) or {}).get("think")
        self.script = Script.from_record(row) if isinstance(row, dict) else None
        if self.script is None:
            log.warning("think script: the model has no `think` record; it does nothing")

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        value = (sampling_params.extra_args or {}).get(XARG)
        if value is not None and (not isinstance(value, int) or value < 0 or value is True):
            raise ValueError(f"vllm_xargs.{XARG} must be a whole number >= 0, not {value!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax wherever it forces a token

    def new_req_logits_processor(self, params: SamplingParams) -> RequestScript | None:
        if self.script is None:
            return None
        count = (params.extra_args or {}).get(XARG)
        return RequestScript(self.script, self.script.think_tokens if count is None else count)
