"""The local sidecar as the connector's worker half sees it
(`vllm_connector.worker.WorkerSide` owns one `LocalSocket` and one `Regions`).

Found at start-up (`LocalSocket.open`) when its socket is in `local_dir`; a sidecar that
starts after vLLM (a pod's containers start side by side) is looked for again every
`LOOK_FOR_SOCKET_S` while the worker is on TCP (`LocalSocket.appeared`), and used once
there.

Each region a `LocalClient` maps is viewed as bytes, per generation (a restarted sidecar
maps a new one). On a GPU each is pinned for DMA on a thread of its own
(`cudaHostRegister` of a large region takes seconds; copies from it run unpinned, slower
but correct, meanwhile). A lease's copies hold its region (`use` … `done_with`); an
earlier generation's region goes, unpinned, once no copy uses it (`let_go`).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from sidecar.local_client import LocalClient, LocalError, Region
from vllm_connector.blockcopy import register_host, unregister_host
from vllm_connector.config import ConnectorConfig

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")

_PIN_JOIN_S = 30.0  # how long `close` waits for a region's pinning to finish
LOOK_FOR_SOCKET_S = 5.0  # on TCP for want of the local sidecar's socket: looked for this often


class LocalSocket:
    """Where this worker finds the local sidecar (`config.local_dir`): at start-up
    (`open`), and while it is on TCP for want of the socket, again every
    `LOOK_FOR_SOCKET_S` (`appeared`)."""

    def __init__(self, config: ConnectorConfig, regions: Regions) -> None:
        self.config = config
        self.regions = regions  # what each client maps goes there
        self.look_at: float | None = None  # (monotonic) when to look for the socket again

    def open(self) -> tuple[LocalClient | None, str]:
        """A client of the local sidecar when its socket is there (else None: TCP), and
        the KV path in words."""
        config = self.config
        where = config.local_dir
        if where is None:
            return None, f"tcp ({config.sidecar_url})"
        if not LocalClient.available(where):  # looked for again while on TCP (`appeared`)
            log.warning(
                "ctxcache connector: no local sidecar socket in %s; using TCP until it appears",
                where,
            )
            self.look_at = time.monotonic() + LOOK_FOR_SOCKET_S
            return None, f"tcp ({config.sidecar_url}; no socket in {where})"
        local = LocalClient(
            where, timeout=config.timeout_s, defer_releases=config.shm_deferred_release
        )
        local.on_map.append(self.regions.mapped)
        try:
            local.connect()
        except LocalError as exc:  # tried again at each load; TCP meanwhile
            log.warning("ctxcache connector: local sidecar not answering yet (%s)", exc)
        except BaseException:
            local.close()
            raise
        return local, f"shm ({where})"

    def appeared(self) -> LocalClient | None:
        """(On the model-runner thread: `load`, `save`.) While on TCP for want of the
        socket, look for it every `LOOK_FOR_SOCKET_S`: a client once it is there (loads
        and stores then take shared memory), else None."""
        if self.look_at is None or time.monotonic() < self.look_at:
            return None
        self.look_at = None
        local, path = self.open()
        if local is not None:
            log.info("ctxcache connector: the local sidecar's socket appeared; KV path %s", path)
        return local


class Regions:
    def __init__(self) -> None:
        # the local sidecars' regions as bytes, per generation: (tensor, pinned for DMA);
        # an earlier generation's goes (unpinned) once no copy uses it (`let_go`)
        self._views: dict[str, tuple[torch.Tensor, bool]] = {}
        self._users: dict[str, int] = {}
        self._generation: str | None = None
        self._lock = threading.Lock()
        # (CUDA) the device each mapped region is pinned for, on a thread of its own
        self.pin: torch.device | None = None
        self._pinning: list[threading.Thread] = []

    def mapped(self, region: Region) -> None:
        """A (new) region is mapped: view it as bytes, and on a GPU pin it for DMA on a
        thread of its own (`cudaHostRegister` of a large region takes seconds: the load
        that noticed the new region, and those after it, copy from it unpinned meanwhile,
        slower but correct). The earlier one is let go once no copy uses it."""
        view = torch.frombuffer(region.map, dtype=torch.uint8)
        with self._lock:
            self._views[region.generation] = (view, False)
            self._generation = region.generation
        self.let_go()
        if self.pin is not None:
            pin = threading.Thread(
                target=self._pin_one,
                args=(region.generation, view, self.pin),
                name="ctxcache-pin",
                daemon=True,
            )
            self._pinning = [t for t in self._pinning if t.is_alive()] + [pin]
            pin.start()

    def _pin_one(self, generation: str, view: torch.Tensor, device: torch.device) -> None:
        """(On its own thread.) Pin a region for this rank's GPU; a failure leaves it
        pageable (a log line). A region let go while it was being pinned is unpinned here.
        The thread's device is set first, as vLLM's copy threads do: a new thread's is
        GPU 0, and a tensor-parallel rank would otherwise make a CUDA context there."""
        t0 = time.perf_counter()
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            pinned = register_host(view)
        except Exception:
            log.exception("pinning the shared region failed; copies from it stay pageable")
            return
        if not pinned:
            log.warning("the shared region (%s) stays pageable: slower copies", generation)
            return
        with self._lock:
            entry = self._views.get(generation)
            kept = entry is not None and entry[0] is view
            if kept:
                self._views[generation] = (view, True)
        if not kept:
            self._unpin(view)
            return
        log.info(
            "pinned the shared region (%s, %d MiB) in %.1f s",
            generation,
            view.numel() >> 20,
            time.perf_counter() - t0,
        )

    @staticmethod
    def _unpin(view: torch.Tensor) -> None:
        try:
            unregister_host(view)
        except Exception:
            log.exception("unpinning a shared region failed")

    def use(self, region: Region | None) -> torch.Tensor:
        """The bytes of the region a lease is in, held until `done_with`."""
        assert region is not None
        with self._lock:
            if region.generation not in self._views:  # (mapped before we listened)
                self._views[region.generation] = (
                    torch.frombuffer(region.map, dtype=torch.uint8),
                    False,
                )
            gen = region.generation
            self._users[gen] = self._users.get(gen, 0) + 1
            return self._views[gen][0]

    def done_with(self, region: Region | None) -> None:
        assert region is not None
        with self._lock:
            self._users[region.generation] -= 1
        self.let_go()

    def let_go(self, everything: bool = False) -> None:
        """Unpin and drop the earlier sidecars' regions no copy uses (all, at close): the
        mapping itself goes with the last reference to it."""
        with self._lock:
            gone = [
                gen
                for gen in self._views
                if everything or (gen != self._generation and not self._users.get(gen))
            ]
            views = [self._views.pop(gen) for gen in gone]
            for gen in gone:
                self._users.pop(gen, None)
        for view, pinned in views:
            if pinned:
                self._unpin(view)

    def close(self) -> None:
        """Wait for the pinning threads (a region let go meanwhile is unpinned by its
        thread), then unpin and drop every region."""
        for pin in self._pinning:
            pin.join(_PIN_JOIN_S)
        self._pinning = []
        self.let_go(everything=True)
