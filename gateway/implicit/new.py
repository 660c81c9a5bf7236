"""New conversations (docs/implicit.md): a miss's first request goes to the engine as it is
(`gateway.implicit.first`), and its new session is written after the answer, in the
background; a next request that continues one of these states waits for its write. A new
conversation's prefixes that others may share (its system prompt, a breakpoint's) are kept
as states of it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id
from cache_manager.protocol import (
    CreateSession,
    ImplicitMark,
    ImplicitPoint,
    MarkPrefixes,
    SharedPrefix,
)
from ctxcache.errors import CtxError
from ctxcache.lmcache_keys import session_key
from ctxcache.logs import bind_session
from ctxcache.tasks import BackgroundTasks
from gateway.implicit.digests import after
from gateway.implicit.fields import CacheFields
from gateway.implicit.finder import shared_prefixes
from gateway.implicit.first import FirstRequest
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.prompts import PromptBuilder
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


def state_ttl(fields: CacheFields, settings: GatewaySettings) -> int:
    """How long a state asked for with `fields` is kept idle, within the TTL bounds."""
    ttl = fields.ttl(settings.implicit_ttl)
    return min(max(ttl, settings.min_ttl), settings.max_ttl)


class NewConversations:
    def __init__(
        self,
        manager: ManagerClient,
        pool: WorkerPool,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        prompts: PromptBuilder,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.prompts = prompts
        self.background = BackgroundTasks(log)
        # the states of new conversations being written (their digest): a next request
        # that continues one waits for its write (`settled`)
        self.pending: dict[str, asyncio.Event] = {}

    async def settled(self, digests: list[str | None]) -> None:
        """Wait for this gateway's writes of a state the request may continue, if any is
        still running: a client that sends its next request as soon as it has the answer
        finds its conversation, not a miss."""
        if not self.pending:
            return
        waits = [self.pending[d] for d in digests if d is not None and d in self.pending]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w.wait()) for w in waits], timeout=1.0)

    async def drain(self) -> None:
        """Wait for the new conversations' writes still running (shutdown, tests)."""
        await self.background.drain()

    def first(
        self,
        tenant: str,
        body: dict[str, Any],
        digests: list[str | None],
        fields: CacheFields,
    ) -> FirstRequest:
        """The miss's request to the engine: its new session written once it is answered
        (in the background: the answer does not wait for the store)."""
        sid = new_session_id()
        ttl = state_ttl(fields, self.settings)

        def done(first: FirstRequest, worker: Worker) -> None:
            new = New(tenant, sid, body, digests, ttl, max(ttl, fields.breakpoint_ttl_s))
            new.breakpoints = fields.breakpoints
            end = digests[-1]
            state = after(end, first.assistant()) if end is not None else None
            written = asyncio.Event()
            if state is not None:
                self.pending[state] = written

            async def keep() -> None:
                try:
                    await self.keep_first(new, first, worker)
                finally:
                    written.set()
                    if state is not None:
                        self.pending.pop(state, None)

            self.background.spawn(
                keep(),
                what="a new implicit session's write (its next request misses)",
                session_id=sid,
            )

        first = FirstRequest(session_key(sid), bool(body.get("return_token_ids")), done)
        first.affinity = self.pool.keyed(body["model"], fields.key) if fields.key else None
        return first

    async def keep_first(self, new: New, first: FirstRequest, worker: Worker) -> None:
        answer = first.assistant()
        messages = [*new.body["messages"], answer]
        end = new.digests[-1]
        digest = after(end, answer) if end is not None else None
        mark = None
        if digest is not None:
            mark = ImplicitMark(digest=digest, messages=len(messages), ttl=new.ttl)
        tools = new.body.get("tools") or None
        try:
            await self.manager.create(
                CreateSession(
                    session_id=new.session_id,
                    tenant=new.tenant,
                    model=new.body["model"],
                    kind="chat",
                    tokens=first.tokens(),
                    messages=messages,
                    tools=tools,
                    ttl=new.ttl,
                    worker=worker.id,
                    sidecar=worker.sidecar,
                    origin="implicit",
                    implicit=mark,
                )
            )
        except CtxError as exc:
            self.metrics.implicit("unkept")
            with bind_session(new.session_id):
                log.warning("implicit session: the answer was not kept (%s)", exc)
            return
        self.metrics.sessions_created.inc()
        if first.prompt_ids:
            shared = shared_prefixes(new.body["messages"], new.breakpoints)
            await self.share_prefixes(new, first.prompt_ids, shared, tools, worker)

    async def share_prefixes(
        self,
        new: New,
        prompt: list[int],
        shared: list[int],
        tools: list[dict[str, Any]] | None,
        worker: Worker,
    ) -> None:
        """A new conversation's prefixes that others may share (its system prompt and
        tools, a breakpoint): each is a state of this conversation, cut where the prefix
        ends, if the template renders it as the start of the prompt and it is long
        enough to be worth a fork (`implicit_min_prefix_tokens`). Best effort."""
        prefixes = []
        for k in shared:
            digest = new.digests[k - 1]
            if digest is None:
                continue
            try:
                ids, _ = await self.prompts.chat(
                    worker,
                    new.body["model"],
                    new.body["messages"][:k],
                    generation_prompt=False,
                    tools=tools,
                )
            except Exception as exc:  # (only a cache entry fewer)
                log.info("a shared prefix was not kept (%s)", exc)
                return
            short = len(ids) < self.settings.implicit_min_prefix_tokens
            if short or prompt[: len(ids)] != ids:  # (a template that rewrites it)
                continue
            point = ImplicitPoint(session_id=new.session_id, version=1, tokens=len(ids), messages=k)
            prefixes.append(SharedPrefix(digest=digest, point=point, ttl=new.prefix_ttl))
        if not prefixes:
            return
        try:
            await self.manager.mark_prefixes(MarkPrefixes(tenant=new.tenant, prefixes=prefixes))
        except CtxError as exc:
            log.info("a shared prefix was not kept (%s)", exc)


@dataclass
class New:
    """A new conversation (a miss), kept once its first answer is in."""

    tenant: str
    session_id: str
    body: dict[str, Any]
    digests: list[str | None]
    ttl: int
    prefix_ttl: int
    breakpoints: tuple[int, ...] = field(default=())
