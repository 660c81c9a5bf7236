"""What a real client sent the gateway and what it answered, step by step, seen on the
client's own HTTP connection (an `httpx` client with event hooks, given to the SDK or
framework as its `http_client`): every chat completion's message count and usage. Before
each one vLLM's own prefix cache is emptied, so that the KV a step reuses can only come
from the sidecar, that is from ctxcache, whatever room vLLM's KV cache has.

The gateway's count of implicit-session hits (issue 55) is read here too, its name in one
place (`IMPLICIT_HITS`)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.resent import canonical
from tests.vllm_connector.conftest import VllmStack

BLOCK = 128  # vLLM's CPU block: a step reuses its history less at most one block
# the gateway's counter of chat requests without session_id served as an implicit session
IMPLICIT_HITS = ("ctxcache_gateway_implicit_total", 'result="hit"')


def implicit_hits(stack: VllmStack) -> float:
    """The gateway's implicit-session hits so far (0 while it has no such counter)."""
    name, label = IMPLICIT_HITS
    total = 0.0
    for line in stack.http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and label in line.split("}")[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class Step:
    """One chat completion: the request's body, its prompt, its reused prompt tokens and
    the tokens it generated."""

    body: dict[str, Any]
    prompt: int
    cached: int
    completion: int

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body["messages"])


class Wire:
    """The steps of the clients given `client()` / `async_client()`, in order."""

    def __init__(self, stack: VllmStack) -> None:
        self.stack = stack
        self.steps: list[Step] = []
        self.hits_before = implicit_hits(stack)
        self._bodies: list[dict[str, Any]] = []
        self._clients: list[httpx.Client] = []

    def client(self) -> httpx.Client:
        """A client for the SDK (closed by `close()` if the SDK does not)."""
        hooks = {"request": [self._on_request], "response": [self._on_response]}
        self._clients.append(httpx.Client(timeout=300, event_hooks=hooks))
        return self._clients[-1]

    def close(self) -> None:
        for client in self._clients:
            client.close()

    def async_client(self) -> httpx.AsyncClient:
        """An async client for the SDK, which its caller closes (in its event loop)."""
        hooks = {"request": [self._on_request_async], "response": [self._on_response_async]}
        return httpx.AsyncClient(timeout=300, event_hooks=hooks)

    def _on_request(self, request: httpx.Request) -> None:
        if is_chat(request):
            self.stack.reset_prefix_cache()
            self._bodies.append(json.loads(request.content))

    async def _on_request_async(self, request: httpx.Request) -> None:
        if is_chat(request):
            async with httpx.AsyncClient(timeout=60) as vllm:
                got = await vllm.post(f"{self.stack.vllm.url}/reset_prefix_cache")
                got.raise_for_status()
            self._bodies.append(json.loads(request.content))

    def _on_response(self, response: httpx.Response) -> None:
        if is_chat(response.request):
            response.read()  # (the SDK reads the same bytes after this, a stream too)
            self._record(response)

    async def _on_response_async(self, response: httpx.Response) -> None:
        if is_chat(response.request):
            await response.aread()
            self._record(response)

    def _record(self, response: httpx.Response) -> None:
        body = self._bodies.pop(0)
        if response.status_code != 200:
            return  # (the client raises it)
        usage = usage_of(response.text)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or 0
        self.steps.append(Step(body, usage["prompt_tokens"], cached, usage["completion_tokens"]))

    def table(self) -> list[tuple[int, int, int, int]]:
        """(messages sent, prompt, cached and completion tokens) of each step: for messages."""
        return [(len(s.messages), s.prompt, s.cached, s.completion) for s in self.steps]

    def resent_whole(self) -> None:
        """The client sent no session and each step's messages began with the previous
        step's (a stateless client, resending the whole conversation)."""
        assert len(self.steps) >= 2, self.table()
        for before, now in itertools.pairwise(self.steps):
            assert "session_id" not in now.body
            assert len(now.messages) > len(before.messages), self.table()
            again = now.messages[: len(before.messages)]
            assert [canonical(m) for m in again] == [canonical(m) for m in before.messages]

    def reused_every_step(self) -> None:
        """Every step after the first reused the previous step's prompt but at most one
        engine block (vLLM's cache emptied before each: only ctxcache can supply it)."""
        assert len(self.steps) >= 2, self.table()
        for before, now in itertools.pairwise(self.steps):
            assert now.cached >= before.prompt - BLOCK, self.table()

    def implicit_every_step(self) -> None:
        """Each step after the first was served as an implicit session: the history of
        a stateless client reused, on the gateway's count too."""
        self.resent_whole()
        self.reused_every_step()
        hits = implicit_hits(self.stack) - self.hits_before
        assert hits == len(self.steps) - 1, (hits, self.table())


def is_chat(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/chat/completions")


def usage_of(text: str) -> dict[str, Any]:
    """A chat completion's usage, from its JSON or from its stream's usage chunk."""
    if not text.lstrip().startswith("data:"):
        return dict(json.loads(text)["usage"])
    for line in reversed(text.splitlines()):
        if line.startswith("data: {"):
            usage = json.loads(line[6:]).get("usage")
            if usage:
                return dict(usage)
    raise AssertionError(f"a stream without usage: {text[-500:]}")
