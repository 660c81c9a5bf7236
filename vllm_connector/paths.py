"""The one small interface both of the connector's KV paths offer its worker half
(`vllm_connector.worker.WorkerSide`, which picks one per job): the shared-memory path
(`vllm_connector.shm_path.ShmPath`, when the sidecar runs on this node) and the `lm://`
path (`vllm_connector.tcp_path.TcpPath`). Each is built with what it uses (the paged
cache, its copier, the counters, the sidecar's clients) and owns its own state: its
threads, its leases, its stores still copying (docs/vllm.md, "KV paths").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from vllm_connector.loads import Job
from vllm_connector.plan import StoreSpec

if TYPE_CHECKING:
    from vllm_connector.stores import Storing


class KVPath(Protocol):
    def load(self, jobs: list[Job]) -> set[int]:
        """Carry out these loads (a step's sync loads, or one async load on the loader
        thread), each counted and traced; the vLLM blocks to recompute. Never raises."""
        ...

    def store(self, spec: StoreSpec, after: Any = None) -> bool | Storing:
        """Store `spec`'s blocks, read once `after` (an event on vLLM's compute stream, or
        None) is done: True when stored, False when dropped, a `Storing` whose copies still
        run (its blocks held until `settle` reports it)."""
        ...

    def settle(self, *, wait: bool = False) -> set[str]:
        """The requests whose stores were still copying and now are over (committed or
        dropped; all of them, with `wait`). Never raises."""
        ...

    def close(self) -> None: ...
