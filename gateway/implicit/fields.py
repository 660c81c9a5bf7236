"""OpenAI's prompt-caching fields (`prompt_cache_key`, `prompt_cache_retention`,
`prompt_cache_options`, a content part's `prompt_cache_breakpoint`): checked, read into
`CacheFields`, and taken out of what goes to an engine, which has no use for them
(docs/implicit.md, "OpenAI's fields").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from ctxcache.errors import InvalidRequest

FIELDS = ("prompt_cache_key", "prompt_cache_retention", "prompt_cache_options")
BREAKPOINT = "prompt_cache_breakpoint"
MAX_KEY_CHARS = 1024
RETENTION_S = {"in_memory": None, "24h": 86_400}  # None: the deployment's idle TTL
_DURATION = re.compile(r"^([1-9][0-9]{0,4})([mh])$")
MAX_CACHE_TTL_S = 86_400


def _duration(value: object, param: str) -> int:
    """`30m`, `12h`, ... in seconds (a minute to a day)."""
    match = _DURATION.match(value) if isinstance(value, str) else None
    seconds = int(match[1]) * (60 if match[2] == "m" else 3600) if match else 0
    if not 60 <= seconds <= MAX_CACHE_TTL_S:
        raise InvalidRequest(
            f"{param} must be a duration such as '30m' or '12h' (at most 24h)", param=param
        )
    return seconds


@dataclass(frozen=True)
class CacheFields:
    key: str | None = None  # part of the match key; routes to one worker
    retention_s: int | None = None  # `24h`: kept a day idle; None: the deployment's TTL
    min_ttl_s: int = 0  # `prompt_cache_options.ttl`: the state lives at least this long
    implicit: bool = True  # `prompt_cache_options.mode: explicit`: no implicit session
    # the messages with a content part that carries a `prompt_cache_breakpoint` (indexes),
    # and the longest `ttl` one of them asks for (0: the request's)
    breakpoints: tuple[int, ...] = ()
    breakpoint_ttl_s: int = 0

    @classmethod
    def of(cls, body: dict[str, Any]) -> CacheFields:
        """The fields of a request body; a 400 naming the field if one is malformed."""
        key = body.get("prompt_cache_key")
        if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS):
            raise InvalidRequest(
                f"prompt_cache_key must be a string of 1 to {MAX_KEY_CHARS} characters",
                param="prompt_cache_key",
            )
        retention = body.get("prompt_cache_retention")
        if retention is not None and retention not in RETENTION_S:
            raise InvalidRequest(
                "prompt_cache_retention must be 'in_memory' or '24h'",
                param="prompt_cache_retention",
            )
        options = body.get("prompt_cache_options")
        mode, min_ttl = "implicit", 0
        if options is not None:
            if not isinstance(options, dict):
                raise InvalidRequest(
                    "prompt_cache_options must be an object", param="prompt_cache_options"
                )
            mode = options.get("mode") or "implicit"
            if mode not in ("implicit", "explicit"):
                raise InvalidRequest(
                    "prompt_cache_options.mode must be 'implicit' or 'explicit'",
                    param="prompt_cache_options.mode",
                )
            if options.get("ttl") is not None:
                min_ttl = _duration(options["ttl"], "prompt_cache_options.ttl")
        marked, marked_ttl = _check_breakpoints(body.get("messages"))
        return cls(
            key=key,
            retention_s=RETENTION_S[retention] if retention is not None else None,
            min_ttl_s=min_ttl,
            implicit=mode == "implicit",
            breakpoints=marked,
            breakpoint_ttl_s=marked_ttl,
        )

    def ttl(self, default_s: int) -> int:
        """How long a conversation state asked for with these fields is kept idle."""
        base = self.retention_s if self.retention_s is not None else default_s
        return max(base, self.min_ttl_s)


def _check_breakpoints(messages: object) -> tuple[tuple[int, ...], int]:
    """The indexes of the messages with a content part that carries a breakpoint, and the
    longest `ttl` they ask for; a 400 if one is malformed."""
    if not isinstance(messages, list):
        return (), 0
    found: list[int] = []
    longest = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            mark = part.get(BREAKPOINT) if isinstance(part, dict) else None
            if mark is None:
                continue
            param = f"messages[{i}].content[{j}].{BREAKPOINT}"
            if not isinstance(mark, dict) or mark.get("mode", "explicit") != "explicit":
                raise InvalidRequest(f"{param} must be {{'mode': 'explicit'}}", param=param)
            if mark.get("ttl") is not None:
                longest = max(longest, _duration(mark["ttl"], f"{param}.ttl"))
            if not found or found[-1] != i:
                found.append(i)
    return tuple(found), longest


def for_engine(body: dict[str, Any], fields: CacheFields) -> dict[str, Any]:
    """`body` without the prompt-caching fields (and breakpoints); `body` if it has none."""
    if not fields.breakpoints and not any(name in body for name in FIELDS):
        return body
    out = {k: v for k, v in body.items() if k not in FIELDS}
    if fields.breakpoints:
        out["messages"] = [_unmarked(m) for m in body["messages"]]
    return out


def _unmarked(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = [
        {k: v for k, v in p.items() if k != BREAKPOINT} if isinstance(p, dict) else p
        for p in content
    ]
    return {**message, "content": parts}


def engine_bytes(body: dict[str, Any], raw: bytes) -> tuple[dict[str, Any], bytes, CacheFields]:
    """A pass-through request: its fields checked, and the body (and its JSON) without them.
    The bytes are kept as they are when the body has none (the gateway's hot path)."""
    if b"prompt_cache" not in raw:
        return body, raw, NO_FIELDS
    fields = CacheFields.of(body)
    out = for_engine(body, fields)
    return out, (raw if out is body else orjson.dumps(out)), fields


NO_FIELDS = CacheFields()
