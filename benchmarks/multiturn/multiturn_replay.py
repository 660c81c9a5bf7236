"""The replay of `ctxcache bench multiturn`: the conversations, each mode's turns, the log
of every request, and the per-turn rows."""

from __future__ import annotations

import argparse
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from benchmarks.lib.util import percentile, stream_chat
from benchmarks.multiturn.multiturn import user_message, user_token_targets
from benchmarks.multiturn.multiturn_stacks import STATELESS, Mode

SYSTEM = "You are a helpful assistant. Answer briefly."
REFERENCES = ("vllm-full", "full")  # the mode every other mode's answers are compared with


@dataclass
class Conversation:
    index: int
    users: list[str]
    messages: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # per mode
    sessions: dict[str, str] = field(default_factory=dict)  # per session mode


class Replay:
    def __init__(
        self,
        args: argparse.Namespace,
        modes: list[Mode],
        floor: Any,
        tokenizer: Any,
        transport: Any = None,  # an httpx transport (the tests' fake servers)
    ) -> None:
        import httpx

        self.args, self.modes, self.floor, self.tokenizer = args, modes, floor, tokenizer
        self.http = {
            m.name: httpx.Client(
                base_url=m.url, headers=_headers(m, args), timeout=900, transport=transport
            )
            for m in modes
        }
        self.model = args.model_name or self._first_model(modes[0].name)
        names = [m.name for m in modes]
        self.reference = next((r for r in REFERENCES if r in names), names[0])
        targets = user_token_targets(args.turns, args.answer_tokens)
        self.conversations = []
        for c in range(args.conversations):
            rng = random.Random(args.seed * 1_000_003 + c)
            users = [
                user_message(rng, n, tokenizer or getattr(floor, "tokenizer", None))
                for n in targets
            ]
            self.conversations.append(Conversation(c, users))
        self.log: list[dict[str, Any]] = []  # one row per request
        self.last: tuple[str, float] | None = None  # the last request's mode and end
        self.run_id = uuid.uuid4().hex[:12]

    def _first_model(self, mode: str) -> str:
        r = self.http[mode].get("/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    def _order(self) -> list[tuple[int, Conversation]]:
        turns, convs = range(self.args.turns), self.conversations
        if self.args.interleave:
            return [(t, c) for t in turns for c in convs]
        return [(t, c) for c in convs for t in turns]

    def run(self, stopping: threading.Event) -> None:
        from tqdm import tqdm

        args = self.args
        per_turn = len(self.modes) + (self.floor is not None)
        with tqdm(
            total=args.conversations * args.turns * per_turn, desc="multiturn", unit="turn"
        ) as bar:
            for conv in self.conversations:
                for mode in self.modes:
                    conv.messages[mode.name] = [{"role": "system", "content": SYSTEM}]
                conv.sessions = {m.name: self._create(m) for m in self.modes if m.session}
            for turn, conv in self._order():
                if stopping.is_set():
                    raise KeyboardInterrupt
                order = self.modes if (turn + conv.index) % 2 == 0 else self.modes[::-1]
                answers: dict[str, str] = {}
                for mode in order:
                    time.sleep(args.think_time)
                    self._let_last_engine_idle(mode.name)
                    answers[mode.name] = self._turn(conv, turn, mode)
                    bar.update(1)
                if self.floor is not None:
                    self._floor_turn(conv, turn, answers)
                    bar.update(1)
            for conv in self.conversations:
                for name, sid in conv.sessions.items():
                    self.http[name].delete(f"/v1/context/{sid}")

    def _let_last_engine_idle(self, mode: str) -> None:
        """Wait until the engine asked last has idled `--switch-gap` seconds, when this
        request goes to another mode's engine (see `VLLM_SWITCH_GAP_S`)."""
        if self.last is not None and self.last[0] != mode:
            time.sleep(max(0.0, self.last[1] + self.args.switch_gap - time.monotonic()))

    def _create(self, mode: Mode) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": SYSTEM}],
            "max_tokens": 0,
            "ttl": 3600,
        }
        r = self.http[mode.name].post("/v1/context", content=_dumps(body))
        if r.status_code == 404 and "session_not_found" not in r.text:
            raise SystemExit(f"{mode.url} has no /v1/context: choose modes without a session")
        r.raise_for_status()
        return str(r.json()["session_id"])

    def _turn(self, conv: Conversation, turn: int, mode: Mode) -> str:
        user = {"role": "user", "content": conv.users[turn]}
        history = conv.messages[mode.name]
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.args.answer_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if mode.session:
            body["messages"] = [user]
            body["session_id"] = conv.sessions[mode.name]
        else:
            body["messages"] = [*history, user]
        if mode.salt is not None:
            # salts keep modes on one server from warming each other's prefix cache
            salt = uuid.uuid4().hex if mode.salt == "fresh" else f"{self.run_id}-{conv.index}"
            body["cache_salt"] = f"multiturn-{salt}"
        data = _dumps(body)
        text, ttft, total, usage = self._stream(mode.name, data)
        self.last = (mode.name, time.monotonic())
        history += [user, {"role": "assistant", "content": text}]
        self.log.append(
            {
                "conversation": conv.index,
                "turn": turn + 1,
                "mode": mode.name,
                "ttft_ms": ttft * 1e3,
                "total_ms": total * 1e3,
                "request_bytes": len(data),
                "prompt_tokens": int(usage.get("prompt_tokens") or 0),
                "cached_tokens": int(
                    (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                ),
                "completion_tokens": int(usage.get("completion_tokens") or 0),
                "answer": text,
            }
        )
        return text

    def _stream(self, mode: str, data: bytes) -> tuple[str, float, float, dict[str, Any]]:
        return stream_chat(self.http[mode], data, mode)

    def _floor_turn(self, conv: Conversation, turn: int, answers: dict[str, str]) -> None:
        name = "session" if "session" in answers else next(iter(answers))
        prompt = conv.messages[name][:-1]  # the history up to this turn's user message
        ttft, new, prompt_tokens = self.floor.turn(conv.index, prompt, answers[name])
        self.log.append(
            {
                "conversation": conv.index,
                "turn": turn + 1,
                "mode": "floor",
                "ttft_ms": ttft * 1e3,
                "prompt_tokens": prompt_tokens,
                "cached_tokens": prompt_tokens - new,
            }
        )

    # -- comparing answers ----------------------------------------------------------------
    def first_difference(self, a: str, b: str) -> int:
        """The index of the first token where two answers differ (characters without a
        tokenizer)."""
        if self.tokenizer is None:
            x, y = list(a), list(b)
        else:
            x = self.tokenizer.encode(a, add_special_tokens=False)
            y = self.tokenizer.encode(b, add_special_tokens=False)
        for i, (p, q) in enumerate(zip(x, y, strict=False)):
            if p != q:
                return i
        return min(len(x), len(y))

    def differences(self) -> list[dict[str, Any]]:
        """Where a mode's answer first differs from the reference's, per conversation (its
        later turns follow a different history, so only the first counts), and which other
        modes gave that same answer."""
        answers = {
            (r["conversation"], r["turn"], r["mode"]): r["answer"]
            for r in self.log
            if "answer" in r
        }
        out: list[dict[str, Any]] = []
        for mode in [m.name for m in self.modes if m.name != self.reference]:
            for conv in self.conversations:
                for turn in range(1, self.args.turns + 1):
                    ours = answers.get((conv.index, turn, mode))
                    ref = answers.get((conv.index, turn, self.reference))
                    if ours is None or ref is None or ours == ref:
                        continue
                    same = [
                        m.name
                        for m in self.modes
                        if answers.get((conv.index, turn, m.name)) == ours
                    ]
                    out.append(
                        {
                            "mode": mode,
                            "conversation": conv.index,
                            "turn": turn,
                            "first_different_token": self.first_difference(ours, ref),
                            "same_answer_as": same,
                        }
                    )
                    break
        return out

    # -- per-turn rows --------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        names = [m.name for m in self.modes] + (["floor"] if self.floor else [])
        diverged = {(d["mode"], d["conversation"]): d["turn"] for d in self.differences()}
        rows = []
        for turn in range(1, self.args.turns + 1):
            row: dict[str, Any] = {"turn": turn}
            for mode in names:
                rs = [r for r in self.log if r["turn"] == turn and r["mode"] == mode]
                ttfts = [r["ttft_ms"] for r in rs]
                prompt = sum(r["prompt_tokens"] for r in rs)
                cached = sum(r["cached_tokens"] for r in rs)
                row[mode] = {
                    "ttft_p50_ms": percentile(ttfts, 50),
                    "ttft_p90_ms": percentile(ttfts, 90),
                    "prompt_tokens": prompt / len(rs),
                    "cached_tokens": cached / len(rs),
                    "cached_ratio": cached / prompt if prompt else 0,
                }
                if mode != "floor":
                    row[mode]["total_p50_ms"] = percentile([r["total_ms"] for r in rs], 50)
                    row[mode]["request_bytes"] = sum(r["request_bytes"] for r in rs) / len(rs)
                    if mode != self.reference:
                        row[mode]["identical"] = sum(
                            1 for r in rs if diverged.get((mode, r["conversation"]), 99) > turn
                        )
            base = row[self.reference]["ttft_p50_ms"]
            for mode in names:
                if mode != self.reference:
                    row[mode]["speedup_vs_reference"] = base / row[mode]["ttft_p50_ms"]
            for floor in ("roomy", "floor"):
                if "session" in row and floor in row:
                    row[f"session_vs_{floor}"] = (
                        row["session"]["ttft_p50_ms"] / row[floor]["ttft_p50_ms"]
                    )
            if "session" in row and STATELESS in row:  # its TTFT against the session's
                row[f"{STATELESS}_vs_session"] = (
                    row[STATELESS]["ttft_p50_ms"] / row["session"]["ttft_p50_ms"]
                )
            row["identical_outputs"] = all(
                row[m]["identical"] == self.args.conversations
                for m in names
                if m not in (self.reference, "floor")
            )
            rows.append(row)
        return rows


def _headers(mode: Mode, args: argparse.Namespace) -> dict[str, str]:
    """A mode's request headers: its own key (a tenant of its own) or the run's."""
    key = mode.api_key or args.api_key
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return headers | {"content-type": "application/json"}


def _dumps(body: dict[str, Any]) -> bytes:
    import orjson

    return orjson.dumps(body)
