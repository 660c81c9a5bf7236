"""What the engine is asked for and what it answers: params, requests, events."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class Event:
    """One step of one choice: the new token (if any), text delta, and maybe the end."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logits: torch.Tensor | None = None  # only when the request asked to capture them


@dataclass
class Request:
    """A prompt (token ids) to complete, with where to send the events."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    tags: tuple[tuple[str, str], ...] = ()
    session: str = "-"
    cache_root: int = 0  # the KV hash chain's root: salt_root(cache_salt), 0 without one
    capture_logits: bool = False
    arrival: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # filled in by the engine when the prompt has been prefilled
    cached_tokens: int = 0
    prefix: object | None = None  # the CachedPrefix it was prefilled after
    first_token_time: float | None = None


@dataclass
class Sequence:
    """One choice of a request being decoded."""

    request: Request
    index: int
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # text emitted so far
    kv_tokens: int = 0  # tokens whose KV is in the cache
    finished: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids
