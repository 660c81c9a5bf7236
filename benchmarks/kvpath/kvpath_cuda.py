"""(CUDA) What `ctxcache bench kvpath` measures of an shm load or store beyond its wall
time (`CudaProbe`): the copies' GPU time from events, the sidecar's round trips, peak device
memory. `benchmarks.kvpath.kvpath.run_case` attaches one per CUDA shm case; its `summary` becomes
the extra columns of that case's rows (tabled by `benchmarks.kvpath.kvpath_report.cuda_markdown`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vllm_connector.worker import WorkerSide


# the local client's round trips, as the phase of a load or store they are
_PHASES = {"lease": "lease", "alloc": "lease", "release": "release", "commit": "release"}


class CudaProbe:
    """(CUDA) What a load or store costs beyond its wall time: the copies' GPU time from
    events, the wall time of the sidecar's round trips (wrapped methods of the worker's
    local client; the copies are the rest), and peak device memory. Measured against a
    pinned host<->device copy's GPU time, in the same run."""

    def __init__(self, side: WorkerSide, nbytes: int, device: torch.device) -> None:
        import torch

        self.side, self.device = side, device
        self.samples: dict[str, list[dict[str, float]]] = {}
        self.ring_bytes = side.copier.device_bytes if side.copier is not None else 0
        self._round: dict[str, float] = {}
        self._gpu: list[tuple[Any, Any]] = []
        copier = side.copier
        if copier is not None and copier.ring is not None:
            copier.ring.timing = True
            for name in ("write_many", "read_many"):
                setattr(copier, name, self._timed_copies(getattr(copier, name)))
        if side.local is not None:
            for name in _PHASES:
                setattr(side.local, name, self._timed_phase(name, getattr(side.local, name)))
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.copy_gpu = {
            "load": self._gpu_time(lambda: dev.copy_(host, non_blocking=True)),
            "store": self._gpu_time(lambda: host.copy_(dev, non_blocking=True)),
        }

    def _gpu_time(self, fn: Callable[[], object]) -> float:
        """The median GPU time of `fn` over 5 runs, from events on the current stream."""
        import torch

        times = []
        for _ in range(5):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def _timed_copies(self, copy: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def run(*args: Any, **kwargs: Any) -> Any:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            handle = copy(*args, **kwargs)
            if handle is not None and handle.event is not None:
                self._gpu.append((start, handle.event))
            return handle

        return run

    def _timed_phase(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                phase = _PHASES[name]
                self._round[phase] = self._round.get(phase, 0.0) + time.perf_counter() - t0

        return run

    def start(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        self._round, self._gpu = {"t0": time.perf_counter()}, []
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def stop(self, op: str) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._round.pop("t0")
        lease, release = self._round.get("lease", 0.0), self._round.get("release", 0.0)
        self.samples.setdefault(op, []).append(
            {
                "gpu": sum(a.elapsed_time(b) for a, b in self._gpu) / 1e3,
                "lease": lease,
                "release": release,
                "copies": wall - lease - release,
                "peak": torch.cuda.max_memory_allocated(self.device) - self._base,
            }
        )

    def summary(self, op: str) -> dict[str, Any]:
        """Medians over the rounds (peak memory: the largest)."""
        got = self.samples[op]

        def med(key: str) -> float:
            return statistics.median(s[key] for s in got)

        gpu = med("gpu")
        return {
            "gpu_seconds": gpu,
            "gpu_copy_seconds": self.copy_gpu[op],
            "gpu_vs_copy": self.copy_gpu[op] / gpu if gpu > 0 else None,
            "lease_seconds": med("lease"),
            "copies_seconds": med("copies"),
            "release_seconds": med("release"),
            "peak_device_bytes": max(s["peak"] for s in got),
            "ring_bytes": self.ring_bytes,
        }
