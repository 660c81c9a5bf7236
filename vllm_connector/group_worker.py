"""The connector's worker half for a model of several KV cache groups (`GroupWorker`):
one `WorkerSide` per attention group the connector serves, each over that group's layers
only (its own block layouts, copier, KV paths and payload), and one `StateSide` per
recurrent-state group (`vllm_connector.state_worker`), fed the step's loads and stores of
its group (`LoadSpec.group`, `StoreSpec.group`).

A request is reported once every group is done with it: its stores (`take_sent`: vLLM
frees its blocks) and, loads being asynchronous for such a model, its load
(`take_loaded`). vLLM cannot map a failed block back to a request when block ids repeat
across groups, so a load that failed in any group fails the whole request
(`take_failed`: vLLM's `failed_recving`; it recomputes it) and no block is reported
(`take_invalid`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from vllm_connector.config import ConnectorConfig
from vllm_connector.group_plan import Group
from vllm_connector.scheduler import StepPlan
from vllm_connector.state_worker import StateSide
from vllm_connector.stats import Counters
from vllm_connector.worker import WorkerSide


class GroupWorker:
    def __init__(self, config: ConnectorConfig, groups: Sequence[Group], rank: int = 0) -> None:
        self.counters = Counters()
        self.groups = list(groups)
        self.sides: dict[int, WorkerSide | StateSide] = {
            g.index: (
                StateSide(config, rank, self.counters)
                if g.state is not None
                else WorkerSide(config, g.block_size, rank, self.counters)
            )
            for g in self.groups
        }
        self._loads_left: Counter[str] = Counter()  # request -> groups still loading it
        self._load_failed: set[str] = set()
        self._failed: set[str] = set()  # reported to vLLM by the next `take_failed`
        self._stores_left: Counter[str] = Counter()  # request -> groups still storing it

    @property
    def off(self) -> str | None:
        return next((s.off for s in self.sides.values() if s.off is not None), None)

    def turn_off(self, reason: str) -> None:
        for side in self.sides.values():
            side.turn_off(reason)

    @property
    def state_layers(self) -> list[str]:
        """The layers of the recurrent-state groups (registered by their state tensors)."""
        return [name for g in self.groups if g.state is not None for name in g.layers]

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        writers: dict[str, Any],
        states: dict[str, list[torch.Tensor]] | None = None,
    ) -> None:
        """Each group's side learns the layouts of that group's layers (a state group's,
        its layers' state tensors: `states`)."""
        for g in self.groups:
            side = self.sides[g.index]
            if isinstance(side, StateSide):
                found = {name: (states or {})[name] for name in g.layers if name in (states or {})}
                if len(found) != len(g.layers):
                    self.turn_off(f"KV cache group {g.index} has layers without state tensors")
                    return
                side.register(found)
            else:
                layers = {name: kv_caches[name] for name in g.layers if name in kv_caches}
                if not layers:
                    self.turn_off(f"KV cache group {g.index} has no registered layer")
                    return
                side.register(layers, writers)
            if self.off is not None:
                self.turn_off(self.off)  # one group off: every load would fail
                return
        # (the groups served were named at start-up, `CtxcacheConnector.__init__`)

    # -- loads ----------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        for rid, n in Counter(spec.req_id for spec in plan.loads).items():
            self._loads_left[rid] += n
        for index, side in self.sides.items():
            loads = [spec for spec in plan.loads if spec.group == index]
            if loads:
                side.load(StepPlan(loads=loads))

    def take_loaded(self) -> set[str]:
        """Requests whose load is over in every group; those that failed in any group are
        also in the next `take_failed`."""
        ready: set[str] = set()
        for side in self.sides.values():
            for rid, failed in side.take_loaded_blocks().items():
                if failed:
                    self._load_failed.add(rid)
                self._loads_left[rid] -= 1
                if self._loads_left[rid] <= 0:
                    del self._loads_left[rid]
                    ready.add(rid)
        self._failed |= ready & self._load_failed
        self._load_failed -= ready
        return ready

    def take_failed(self) -> set[str]:
        out, self._failed = self._failed, set()
        return out

    def take_invalid(self) -> set[int]:
        for side in self.sides.values():
            side.take_invalid()  # (none: loads are async; a failed one fails its request)
        return set()

    # -- stores ---------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        for rid, n in Counter(spec.req_id for spec in plan.stores).items():
            self._stores_left[rid] += n
        for index, side in self.sides.items():
            stores = [spec for spec in plan.stores if spec.group == index]
            if stores:
                side.save(StepPlan(stores=stores))

    def take_sent(self) -> set[str]:
        """Requests whose stores are over in every group."""
        done: set[str] = set()
        for side in self.sides.values():
            for rid in side.take_sent():
                self._stores_left[rid] -= 1
                if self._stores_left[rid] <= 0:
                    del self._stores_left[rid]
                    done.add(rid)
        return done

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
