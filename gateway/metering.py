"""What a request may cost before it runs, and what the engine did for it (docs/limits.md).

The rate limiter (`gateway.ratelimit`) reserves a request's tokens before it runs
(`estimate_tokens`) and settles them when its answer ends. The answer does not always show
what the engine did: a turn whose commit failed (the session was deleted meanwhile)
answers an error after the engine generated; a stream cut off by its client has no usage
chunk; a streamed answer to a client that did not ask for usage shows none. So the code
that calls the engine reports each call on the request's `Meter`, which the limiter puts
in a context variable for the request's task (and the tasks it starts). A request nobody
counts has no meter: `call()` then hands out a call that is reported nowhere.

What one call is charged (`EngineCall.charge`):

- the engine's own usage (`done`: a JSON answer's, a stream's usage chunk), whatever the
  client is answered afterwards;
- nothing if the engine refused it or was never reached (`refused`: an error answer of the
  worker, no worker up);
- a stream that ended without usage (its client left, its worker dropped): its prompt
  (known, or the limiter's estimate) plus the tokens relayed so far (`relayed`);
- a passed-through JSON answer: the usage in that answer (`answered`; the limiter reads it);
- anything else (a call cut off before it answered: a timeout, a client that left):
  unknown, so the request keeps its reservation.
"""

from __future__ import annotations

import math
from contextvars import ContextVar, Token
from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from ctxcache.errors import BackendTimeout, CtxError
from gateway.upstream import WorkerDown

_PROMPT_FIELDS = ("prompt", "messages", "input", "instructions")
_MAX_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_HUGE = 10**15  # more than any budget: a larger maximum is reserved as this
_INT = TypeAdapter(int)


@dataclass(frozen=True)
class Estimate:
    """What a body may cost: its prompts' estimate, and in all (prompts + answers)."""

    prompt: int
    total: int


def whole(value: Any) -> int | None:
    """A count as the engine reads the field (pydantic's lax `int`: `4`, `4.0`, `"4"`), at
    most `_HUGE`; None if it reads no count there (it then refuses the body, or the field is
    absent; a boolean counts as none too). A fractional or huge number counts rounded up."""
    if type(value) is float:
        return math.ceil(min(value, _HUGE)) if value >= 0 else None  # (nan: None)
    if value is None or isinstance(value, (bool, dict, list)):
        return None
    try:
        n = _INT.validate_python(value)
    except ValidationError:
        return None
    return min(n, _HUGE) if n >= 0 else None


def _size(value: Any) -> int:
    """One prompt's estimate: token ids one each, anything else a quarter of its bytes."""
    if isinstance(value, list) and value and all(type(v) is int for v in value):
        return len(value)
    if isinstance(value, str):
        return -(-len(value.encode()) // 4)
    return -(-len(orjson.dumps(value)) // 4)


def estimate_tokens(
    doc: Any, *, default_max_tokens: int, max_fields: tuple[str, ...] = _MAX_FIELDS
) -> int:
    """`estimate(...).total`."""
    return estimate(doc, default_max_tokens=default_max_tokens, max_fields=max_fields).total


def estimate(
    doc: Any, *, default_max_tokens: int, max_fields: tuple[str, ...] = _MAX_FIELDS
) -> Estimate:
    """The tokens a body may use: its prompts' estimate plus, for each prompt, `n` times its
    answer's maximum.

    Before tokenization a prompt is estimated as hosted APIs do, from its size: a quarter
    of the UTF-8 bytes of the JSON of its `prompt`, `messages`, `input` and `instructions`
    (rounded up); token ids count one each. A `prompt` that is a list of prompts (strings,
    or lists of ids) is a batch: each prompt is estimated, and each gets `n` answers. The
    answer's maximum is the largest of `max_fields` the body sets, else
    `default_max_tokens`; `n` counts as the engine reads it (an `n` it refuses: 1).
    """
    if not isinstance(doc, dict):
        return Estimate(0, 0)
    prompt, prompts = 0, 1
    for name in _PROMPT_FIELDS:
        value = doc.get(name)
        if value is None:
            continue
        if name == "prompt" and isinstance(value, list) and value and type(value[0]) is not int:
            prompt += sum(_size(p) for p in value)  # a batch
            prompts = len(value)
        else:
            prompt += _size(value)
    maxima = [m for name in max_fields if (m := whole(doc.get(name))) is not None]
    most = max(maxima) if maxima else default_max_tokens
    n = whole(doc.get("n"))
    n = n if n is not None and n >= 1 else 1
    return Estimate(prompt, prompt + prompts * n * most)


class State(Enum):
    SENT = "sent"  # on its way, or cut off before its answer: outcome unknown
    REFUSED = "refused"  # the engine ran nothing
    ANSWERED = "answered"  # its usage is in the JSON answer the client gets
    STREAMING = "streaming"  # prompt + tokens relayed, until its usage comes
    DONE = "done"  # the engine's usage is known


class EngineCall:
    """One request sent to the engine (failovers to other workers included). Used as a
    context manager around the sending itself (not what follows it): an error that says
    the engine ran nothing — an error it answered, no worker reachable — marks it refused;
    a timeout or a cancellation leaves it unknown."""

    __slots__ = ("generated", "prompt", "state", "total")

    def __init__(self, prompt: int | None = None) -> None:
        self.prompt = prompt  # the prompt's tokens, if known
        self.state = State.SENT
        self.generated = 0
        self.total = 0

    def __enter__(self) -> EngineCall:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        ran_nothing = kind is not None and issubclass(kind, (CtxError, WorkerDown))
        if ran_nothing and not issubclass(kind, BackendTimeout):  # type: ignore[arg-type]
            self.state = State.REFUSED

    def refused(self) -> None:
        self.state = State.REFUSED

    def answered(self) -> None:
        self.state = State.ANSWERED

    def streaming(self) -> None:
        self.state = State.STREAMING

    def relayed(self, tokens: int = 1) -> None:
        self.generated += tokens

    def done(self, usage: dict[str, Any]) -> None:
        """The engine's usage (prompt + completion tokens)."""
        total = whole(usage.get("total_tokens"))
        if total is None:
            parts = (whole(usage.get(name)) for name in ("prompt_tokens", "completion_tokens"))
            total = sum(part or 0 for part in parts)
        self.total, self.state = total, State.DONE

    def charge(self, prompt_estimate: int, answered: int | None) -> int | None:
        """The tokens this call costs; None: unknown (`answered`: the JSON answer's usage)."""
        if self.state is State.DONE:
            return self.total
        if self.state is State.REFUSED:
            return 0
        if self.state is State.STREAMING:
            return (prompt_estimate if self.prompt is None else self.prompt) + self.generated
        if self.state is State.ANSWERED:
            return answered
        return None


class Meter:
    """One request's calls to the engine. `prompt_estimate`: the limiter's estimate of the
    request's prompt(s), for a call whose prompt is not known."""

    def __init__(self, prompt_estimate: int = 0) -> None:
        self.prompt_estimate = prompt_estimate
        self.calls: list[EngineCall] = []

    def charge(self, reserved: int, answered: int | None) -> int | None:
        """What the request costs, by its calls: None if it made none; the reservation at
        least while any call's cost is unknown."""
        if not self.calls:
            return None
        used, unknown = 0, False
        for call in self.calls:
            cost = call.charge(self.prompt_estimate, answered)
            if cost is None:
                unknown = True
            else:
                used += cost
        return max(used, reserved) if unknown else used


_meter: ContextVar[Meter | None] = ContextVar("ctxcache_meter", default=None)


def bind(meter: Meter | None) -> Token[Meter | None]:
    """Make `meter` the current request's (the limiter, around the app)."""
    return _meter.set(meter)


def unbind(token: Token[Meter | None]) -> None:
    _meter.reset(token)


def counted() -> bool:
    """Whether this request's tokens are counted (a caller may then do more to learn them)."""
    return _meter.get() is not None


def call(prompt: int | None = None) -> EngineCall:
    """A new call to the engine, on this request's meter if it has one."""
    made = EngineCall(prompt)
    meter = _meter.get()
    if meter is not None:
        meter.calls.append(made)
    return made
