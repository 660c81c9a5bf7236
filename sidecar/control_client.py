"""An async client for the sidecar's control API (used by the cache manager)."""

from __future__ import annotations

from typing import Any

import httpx

from ctxcache import tracing
from ctxcache.errors import error_from_envelope


class SidecarControl:
    """`SidecarControl("http://sidecar:8200", token=...)`; pass `client` to share a pool."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
        *,
        timeout: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout)

    async def pin(self, key: str, expires_at: float) -> dict[str, Any]:
        """Pin or extend a session's KV until `expires_at` (unix seconds)."""
        return await self._call("PUT", f"/sessions/{key}", json={"expires_at": expires_at})

    async def drop(self, key: str) -> dict[str, Any]:
        """Drop the session's blocks from every tier."""
        return await self._call("DELETE", f"/sessions/{key}")

    async def info(self, key: str) -> dict[str, Any]:
        """`{"session", "blocks", "bytes", "pinned", "expires_at"}` (zeros when unknown)."""
        return await self._call("GET", f"/sessions/{key}")

    async def stats(self) -> dict[str, Any]:
        return await self._call("GET", "/stats")

    async def aclose(self) -> None:
        if self._own:
            await self._client.aclose()

    async def __aenter__(self) -> SidecarControl:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        # (tracing on, inside a traced request: a client span, its traceparent sent along)
        with tracing.span(f"sidecar {method} {tracing.route_name(path)}", client=True):
            headers = tracing.inject(self._headers)
            r = await self._client.request(method, self.base_url + path, headers=headers, **kw)
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.is_error or not isinstance(body, dict):
            raise error_from_envelope(r.status_code, body)
        return body
