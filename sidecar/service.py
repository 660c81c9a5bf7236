"""One running sidecar: the store, its tiers, the data server, the expiry reaper and the
write-behind of pinned blocks to the disk tier.

`create_app` (sidecar/app.py) starts and stops it in the control API's lifespan, so one
process serves both ports; tests can also run it on its own.
"""

from __future__ import annotations

import logging
import os
import threading

from sidecar import coldkv
from sidecar.arena import Arena
from sidecar.arena_clients import live_clients
from sidecar.disk import DiskTier
from sidecar.local import LocalServer, claim_directory
from sidecar.metrics import SidecarMetrics
from sidecar.server import DataServer
from sidecar.sessions import PinTable
from sidecar.settings import SidecarSettings
from sidecar.store import BlockStore

log = logging.getLogger(__name__)


class Sidecar:
    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.metrics = SidecarMetrics()
        disk, pins_path = None, None
        if settings.data_dir is not None:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            pins_path = settings.data_dir / "sessions.json"
            if settings.disk_enabled:
                disk = DiskTier(settings.data_dir, aes_key=settings.aes_key)
        self.arena: Arena | None = None
        memory_bytes = settings.memory_bytes
        self._dir_lock = -1  # held while we serve `local_dir` (`claim_directory`)
        if settings.local_dir is not None:
            self._dir_lock = claim_directory(settings.local_dir)
            try:
                self.arena = Arena(settings.local_dir, settings.region_bytes)
            except BaseException:
                os.close(self._dir_lock)
                raise
            # the memory tier lives in the region: it cannot hold more than the region can
            room = settings.region_bytes * 8 // 9
            if room < memory_bytes:
                log.warning(
                    "the shared region (%d bytes) holds a memory tier of %d bytes at most "
                    "(an eighth is kept free); the memory budget is cut to that",
                    settings.region_bytes,
                    room,
                )
                memory_bytes = room
        self.store = BlockStore(
            memory_bytes=memory_bytes,
            disk=disk,
            disk_bytes=settings.disk_bytes,
            pin_policy=settings.pin_policy,
            pins=PinTable(pins_path),
            metrics=self.metrics,
            arena=self.arena,
            cold_kv=settings.cold_kv,
            state_blocks=settings.state_blocks_per_session,
        )
        if settings.cold_kv != "off":
            coldkv.require()
            log.info(
                "cold KV: %s (bf16/fp16/fp32 KV packed in memory and on disk)", settings.cold_kv
            )
        self.server: DataServer | None = None
        self.local: LocalServer | None = None
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="sidecar-reaper", daemon=True)
        self._writer: threading.Thread | None = None
        if disk is not None and settings.write_behind_s > 0:
            self._writer = threading.Thread(
                target=self._write_behind_loop, name="sidecar-write-behind", daemon=True
            )

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    def start(self) -> Sidecar:
        self.store.load_disk()
        self.store.reap()
        self.server = DataServer(
            self.store,
            self.settings.host,
            self.settings.port,
            max_block_bytes=self.settings.max_block_bytes,
            metrics=self.metrics,
        )
        self.server.start()
        if self.arena is not None:
            self.local = LocalServer(
                self.store,
                self.arena,
                lease_timeout_s=self.settings.lease_timeout_s,
                max_block_bytes=self.settings.max_block_bytes,
                metrics=self.metrics,
            )
            self.local.start()
        self._reaper.start()
        if self._writer is not None:
            self._writer.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop()
        engines = self.local.stop() if self.local is not None else 0
        if self._reaper.is_alive():
            self._reaper.join(timeout=5)
        if self._writer is not None and self._writer.is_alive():
            self._writer.join(timeout=5)
        if self.settings.flush_on_shutdown:
            n = self.store.flush()
            if n:
                log.info("flushed %d memory blocks to the disk tier", n)
        self.store.reap()  # also saves the pins
        if self.arena is not None:
            # kept while any engine may map it: connected, or alive (its lock file held)
            self.arena.close(keep=engines > 0 or live_clients(self.arena.directory) > 0)
        if self._dir_lock >= 0:
            os.close(self._dir_lock)
            self._dir_lock = -1

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.settings.reap_interval):
            try:
                self.store.reap()
                if self.local is not None:
                    self.local.expire()
            except Exception:
                log.exception("expiry sweep failed")

    def _write_behind_loop(self) -> None:
        while not self._stop.wait(self.settings.write_behind_s):
            try:
                self.store.write_behind()
            except Exception:
                log.exception("write-behind failed")
