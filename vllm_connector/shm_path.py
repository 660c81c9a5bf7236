"""The shared-memory path (`ShmPath`), when the sidecar runs on this node (`local_dir`):
loads from its region into vLLM's blocks (`vllm_connector.shm_loads.ShmLoader`) and stores
the other way (`vllm_connector.stores.ShmStorer`), one object per direction as vLLM's
`kv_offload` workers have, over one client of the local sidecar and its mapped regions.
What the region cannot serve goes over `lm://` (the `TcpPath` it is given).
"""

from __future__ import annotations

from typing import Any

from sidecar.local_client import LocalClient
from vllm_connector.loads import Job, LoadRunner
from vllm_connector.paged import PagedKV
from vllm_connector.plan import StoreSpec
from vllm_connector.regions import Regions
from vllm_connector.shm_loads import ShmLoader
from vllm_connector.stats import Counters
from vllm_connector.stores import ShmStorer, Storing
from vllm_connector.tcp_path import TcpPath


class ShmPath:
    def __init__(
        self,
        kv: PagedKV,
        local: LocalClient,
        regions: Regions,
        tcp: TcpPath,
        runner: LoadRunner,
        counters: Counters,
    ) -> None:
        self.local = local
        self.loader = ShmLoader(kv, local, regions, tcp, runner, counters)
        self.storer = ShmStorer(kv, local, regions, tcp, counters)

    def load(self, jobs: list[Job]) -> set[int]:
        return self.loader.load(jobs)

    def store(self, spec: StoreSpec, after: Any = None) -> bool | Storing:
        return self.storer.store(spec, after)

    def settle(self, *, wait: bool = False) -> set[str]:
        return self.storer.settle(wait=wait)

    def close(self) -> None:
        """Close the local client (its queued releases sent first); `settle(wait=True)`
        before, for the stores still copying."""
        self.local.close()
