"""The workload and load driver of `ctxcache bench capacity`: multi-round QA at a request rate.

The shape is vLLM production-stack's `benchmarks/multi-round-qa`: `users` conversations run
at once; each arrives with a long context (a system prompt every user shares, then a history
of its own), asks `rounds` questions, and is replaced by a new user when it is done. The
offered load is `qps` requests per second: each user sends its next question `users / qps`
seconds after its previous one, and never before its previous answer is in (so an engine
that cannot keep up sends less: the achieved rate falls below the offered one).

The first users leave at staggered rounds (the first user of slot `i` asks `rounds - i %
rounds` questions), so their successors arrive spread over the rounds: from the second round
on, about one question in `rounds` is a new user's, as in a steady stream of users. (Had
every first user asked every question, the new users would arrive together, a burst of full
prefills every `rounds` rounds, and the run would measure those bursts.)

In the full-history modes every question carries the whole conversation. In the `session`
mode a user's first question is the session's create: a streamed `POST /v1/context` with
the user's context and the question, one engine request as in the full-history modes; each
later question is a session turn, the new message only. (`separate_create`: the shape
before streamed creates, a prefill-only create when the user arrives and then the first
question as a turn; its TTFT counts from the user's arrival, create included, and creates
are also reported on their own.)

The content is deterministic per user number, so every mode sees the same conversations at
the same rate, and greedy answers can be compared across modes. Each rate starts at a user
number of its own (`first_user`): a user arriving at one rate has never been seen by the
engine before, as in production, where a new user's history is new. (Reusing the numbers
let an engine whose prefix cache outlives a rate, the roomy mode's, answer the next rate's
"new" users from its cache.)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from benchmarks.multiturn.multiturn import user_message

SYSTEM_HEAD = "You are a helpful assistant for a team of engineers. "


@dataclass(frozen=True)
class Workload:
    users: int = 12
    rounds: int = 5
    system_tokens: int = 200  # shared by every user
    history_tokens: int = 900  # each user's own, as earlier user/assistant messages
    history_messages: int = 6
    question_tokens: int = 115
    answer_tokens: int = 32


class Texts:
    """The words of every user's conversation, made once per user number."""

    def __init__(self, workload: Workload, tokenizer: Any, seed: int = 0) -> None:
        self.w, self.tokenizer, self.seed = workload, tokenizer, seed
        rng = random.Random(seed)
        body = user_message(rng, max(1, workload.system_tokens - 12), tokenizer)
        self.system = SYSTEM_HEAD + body
        self._users: dict[int, tuple[list[dict[str, str]], list[str]]] = {}

    def user(self, k: int) -> tuple[list[dict[str, str]], list[str]]:
        """User `k`'s context (system + history messages) and its questions."""
        if k not in self._users:
            w = self.w
            rng = random.Random(self.seed * 1_000_003 + 7919 * (k + 1))
            per = max(8, w.history_tokens // max(1, w.history_messages))
            history = [
                {
                    "role": "user" if i % 2 == 0 else "assistant",
                    "content": user_message(rng, per, self.tokenizer),
                }
                for i in range(w.history_messages)
            ]
            questions = [
                user_message(rng, w.question_tokens, self.tokenizer) for _ in range(w.rounds)
            ]
            self._users[k] = ([{"role": "system", "content": self.system}, *history], questions)
        return self._users[k]


@dataclass
class Sent:
    """One request's outcome."""

    user: int
    round: int  # 0: a prefill-only session create; 1..rounds: questions
    index: int  # the order of sends in the run (warm-up first)
    due: float  # when the schedule wanted it sent (seconds since the run's start)
    sent: float
    ttft: float = 0.0
    total: float = 0.0
    itl: float | None = None  # mean time between streamed chunks after the first
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    answer: str = ""
    error: str | None = None
    create: bool = False  # a `POST /v1/context` (a prefill-only one, or one with round 1)


@dataclass
class Point:
    """Everything one rate's run produced."""

    mode: str
    qps: float
    sent: list[Sent] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class Step:
    """What one request of a conversation sends."""

    messages: list[dict[str, Any]]  # the whole conversation, the new messages last
    new: list[dict[str, Any]]  # the new messages alone: a session turn sends only these
    fields: dict[str, Any]  # the body's own fields (max_tokens, tools, ...)


class Conversation(Protocol):
    """One user's requests, for `Driver._user`: what each step sends, and what its answer
    adds (False: the conversation ends here)."""

    def step(self, n: int) -> Step: ...

    def answered(self, step: Step, answer: Any, rec: Sent) -> bool: ...


class Questions:
    """A capacity user: its context, then a question a step, each answer's text appended."""

    def __init__(
        self, context: list[dict[str, str]], questions: list[str], answer_tokens: int
    ) -> None:
        self.messages: list[dict[str, Any]] = list(context)
        self.questions, self.fields = questions, {"max_tokens": answer_tokens}

    def step(self, n: int) -> Step:
        user = {"role": "user", "content": self.questions[n - 1]}
        return Step([*self.messages, user], [user], self.fields)

    def answered(self, step: Step, answer: Any, rec: Sent) -> bool:
        if rec.error is not None:
            return False
        self.messages += [*step.new, {"role": "assistant", "content": answer}]
        return True


class Driver:
    """Drives one mode at one rate (asyncio; one httpx client)."""

    def __init__(
        self,
        mode: str,
        url: str,
        model: str,
        texts: Texts,
        *,
        session: bool,
        headers: dict[str, str] | None = None,
        timeout: float = 600.0,
        separate_create: bool = False,
    ) -> None:
        self.mode, self.url, self.model = mode, url, model
        self.texts, self.session = texts, session
        self.separate_create = separate_create
        self.headers = {"content-type": "application/json", **(headers or {})}
        self.timeout = timeout

    async def run(
        self,
        qps: float,
        measured: int,
        warmup: int,
        progress: Callable[[int], object] | None = None,
        first_user: int = 0,
    ) -> Point:
        """Offer `qps` until `warmup + measured` questions are sent, then wait for them.

        Users are numbered from `first_user` on, in the order they arrive.
        """
        import httpx

        w = self.texts.w
        gap = w.users / qps
        point = Point(self.mode, qps)
        budget = warmup + measured
        firsts = [w.rounds - i % w.rounds for i in range(w.users)]  # (staggered: above)
        # the words of the users this run will meet, made before its clock starts (making
        # them tokenizes every message, which would hold the event loop mid-run)
        later = -(-max(0, budget - sum(firsts)) // w.rounds) + w.users
        for k in range(first_user, first_user + w.users + later):
            self.texts.user(k)
        counters = {"sent": 0, "user": first_user}
        t0 = time.perf_counter()
        limits = httpx.Limits(max_connections=4 * w.users, max_keepalive_connections=4 * w.users)
        async with httpx.AsyncClient(
            base_url=self.url, headers=self.headers, timeout=self.timeout, limits=limits
        ) as http:

            async def slot(i: int) -> None:
                due, rounds = i / qps, firsts[i]
                while counters["sent"] < budget:
                    k = counters["user"]
                    counters["user"] += 1
                    due = await self._user(
                        http, k, rounds, due, gap, t0, counters, budget, point, progress
                    )
                    rounds = w.rounds

            await asyncio.gather(*(slot(i) for i in range(w.users)))
        point.seconds = time.perf_counter() - t0
        return point

    def _conversation(self, k: int) -> Conversation:
        """What user `k` sends at each step, and what an answer adds."""
        context, questions = self.texts.user(k)
        return Questions(context, questions, self.texts.w.answer_tokens)

    async def _user(
        self,
        http: Any,
        k: int,
        rounds: int,
        due: float,
        gap: float,
        t0: float,
        counters: dict[str, int],
        budget: int,
        point: Point,
        progress: Callable[[int], object] | None,
    ) -> float:
        """User `k`'s first `rounds` requests from `due` on (what each sends: its
        `_conversation`); returns when the slot's next user is due."""
        talk = self._conversation(k)
        sid: str | None = None
        for n in range(1, rounds + 1):
            await _sleep_until(t0 + due)
            if counters["sent"] >= budget:
                break
            arrived = time.perf_counter()
            step = talk.step(n)
            if self.session and sid is None and self.separate_create:
                context = step.messages[: len(step.messages) - len(step.new)]
                sid = await self._create(http, k, context, due, t0, point)
                if sid is None:
                    return due + gap
            index = counters["sent"]
            counters["sent"] += 1
            body: dict[str, Any] = {
                "model": self.model,
                **step.fields,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            creating = self.session and sid is None  # the create, with the first request
            if sid is not None:
                body |= {"messages": step.new, "session_id": sid}
            else:
                body["messages"] = step.messages
            if creating:
                body["ttl"] = 900
            rec = Sent(k, n, index, due, arrived - t0, create=creating)
            point.sent.append(rec)
            path = "/v1/context" if creating else "/v1/chat/completions"
            answer, created = await self._stream(http, body, rec, path)
            if creating:
                sid = created
                if sid is None and rec.error is None:
                    rec.error = "the create answered with no x-session-id"
            # from the user's arrival: a session's first question waited for its create too
            # (in the full-history modes the same prefill is in the question's own TTFT)
            waited = time.perf_counter() - arrived - rec.total
            rec.ttft += waited
            rec.total += waited
            if progress is not None:
                progress(1)
            if not talk.answered(step, answer, rec):
                break  # the conversation cannot go on
            due += gap
        if sid is not None:
            with contextlib.suppress(Exception):  # else the TTL ends it
                await http.delete(f"/v1/context/{sid}")
        return max(due, time.perf_counter() - t0)

    async def _create(
        self,
        http: Any,
        k: int,
        context: list[dict[str, str]],
        due: float,
        t0: float,
        point: Point,
    ) -> str | None:
        import orjson

        rec = Sent(k, 0, -1, due, time.perf_counter() - t0, create=True)
        point.sent.append(rec)
        body = {"model": self.model, "messages": context, "max_tokens": 0, "ttl": 900}
        start = time.perf_counter()
        try:
            r = await http.post("/v1/context", content=orjson.dumps(body))
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return None
        rec.total = rec.ttft = time.perf_counter() - start
        if r.status_code != 200:
            rec.error = f"{r.status_code}: {r.text[:200]}"
            return None
        data = r.json()
        usage = data.get("usage") or {}
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        return str(data["session_id"])

    async def _stream(
        self, http: Any, body: dict[str, Any], rec: Sent, path: str = "/v1/chat/completions"
    ) -> tuple[Any, str | None]:
        """Stream one answer into `rec`; the answer (its text) and the session a streamed
        create made, if any."""
        import orjson

        parts: list[str] = []
        stamps: list[float] = []
        start = time.perf_counter()
        created = None
        try:
            async with http.stream("POST", path, content=orjson.dumps(body)) as r:
                if r.status_code != 200:
                    await r.aread()
                    rec.error = f"{r.status_code}: {r.text[:200]}"
                    return "", None
                created = r.headers.get("x-session-id")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece:
                            stamps.append(time.perf_counter())
                            parts.append(piece)
                    usage = chunk.get("usage")
                    if usage:
                        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        details = usage.get("prompt_tokens_details") or {}
                        rec.cached_tokens = int(details.get("cached_tokens") or 0)
                        rec.completion_tokens = int(usage.get("completion_tokens") or 0)
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return "", None
        end = time.perf_counter()
        rec.total = end - start
        rec.ttft = (stamps[0] - start) if stamps else rec.total
        if len(stamps) > 1:
            rec.itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        rec.answer = "".join(parts)
        return rec.answer, created


async def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
