"""Ordering the connector's copies against vLLM's compute, and their handles (`Copies`:
the copier's; `EventDone`: copies on a CUDA stream of the caller's).

On CUDA the copies wait for an event recorded on the stream vLLM computes on, read on the
thread that calls `load`/`save` (vLLM's model-runner thread: `compute_done`), never on the
loader thread; an async load carries the event of the step that submitted it. A sync load
waits on the host for its copies before its release (the release is what says the lease
held through them); an async load is reported in `take_loaded` only once its copies'
handle is `done()` (`settle` polls it on the loader thread).

`compute_done` is the ordering seam: tests replace it here, and its callers look it up
through this module (`ordering.compute_done`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

_POLL_S = 0.0002  # how often the loader thread asks whether its copies are done


def compute_done(device: torch.device) -> Any:
    """An event recorded on the stream the calling thread computes on (its current stream:
    on vLLM's model-runner thread, the forward pass's), for the copies to wait on; None on
    CPU, where copies are synchronous. The ordering seam: tests replace it."""
    if device.type != "cuda":
        return None
    return record_event(device)


def record_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class CopyHandle(Protocol):
    """What the copier's `write_many`/`read_many` return (vllm_connector.blockcopy)."""

    event: Any

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class Copies:
    """What the copier's ring returns (`vllm_connector.ring`: `Ring.write` / `Ring.read`):
    `event` is recorded after their last copy (None on CPU, where they are complete on
    return). Holds the host buffers they use until then."""

    def __init__(self, event: Any, keep: Sequence[torch.Tensor] = ()) -> None:
        self.event = event
        self._keep = list(keep)

    def done(self) -> bool:
        """Whether every copy ran (a non-blocking event query)."""
        if self.event is None or self.event.query():
            self._keep.clear()
            return True
        return False

    def wait(self) -> None:
        """Block the host until every copy ran."""
        if self.event is not None:
            self.event.synchronize()
        self._keep.clear()


class EventDone:
    """Copies issued on a CUDA stream: complete when `event` is."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


def order_after(device: torch.device, after: Any) -> None:
    """Make the calling thread's current stream wait for `after` (the loader thread's
    stream is not vLLM's: its own kernels, a TCP load's scatters, must wait too)."""
    if after is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(after)


def settle(handle: CopyHandle, background: bool) -> None:
    """Wait for copies to be done: on the loader thread by polling their event (no host
    synchronize holds it), on vLLM's thread on the host (a sync load is the step's)."""
    if not background:
        handle.wait()
        return
    while not handle.done():
        time.sleep(_POLL_S)
