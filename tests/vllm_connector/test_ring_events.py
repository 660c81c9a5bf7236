"""The ring's CUDA ordering, on a machine without CUDA: its two streams and its events are
replaced by fakes that log every wait and record (the bytes still move, on CPU), so the
protocol itself is checked — the caches are touched only after `after`, a slot is refilled
only after the event of its previous use, each scatter waits for its own fill's DMA, every
kernel (a read's gathers too, which wait for no DMA of their own) waits for the upload of
the block indices it reads, the handle carries the last copy's event, the index buffer is
reused only after its upload ran — and the data still equals the host path's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.vllm_connector.test_blockcopy import learned, random_caches
from tests.vllm_connector.test_layout import TOKENS, flash_cache
from vllm_connector import ring as ring_module
from vllm_connector.blockcopy import BlockCopier
from vllm_connector.ring import Ring


class Trace:
    """What the fake streams and events did, in order: `(op, stream, event)`."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, str, str]] = []
        self.current = "current"
        self.events = 0


class FakeEvent:
    def __init__(self, trace: Trace) -> None:
        trace.events += 1
        self.trace, self.name = trace, f"e{trace.events}"

    def record(self, stream: FakeStream) -> None:
        self.trace.ops.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.trace.ops.append(("host waits", "", self.name))


class FakeStream:
    def __init__(self, trace: Trace, name: str) -> None:
        self.trace, self.name = trace, name

    def wait_event(self, event: FakeEvent) -> None:
        self.trace.ops.append(("wait", self.name, event.name))

    def wait_stream(self, other: FakeStream) -> None:
        self.trace.ops.append(("wait stream", self.name, other.name))


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Trace, BlockCopier, BlockCopier]]:
    """A copier whose ring (slots of one block, two of them) runs its CUDA branch on fake
    streams and events, and a host-path twin over equal caches."""
    trace = Trace()

    @contextlib.contextmanager
    def on(stream: FakeStream) -> Iterator[None]:
        before, trace.current = trace.current, stream.name
        try:
            yield
        finally:
            trace.current = before

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: FakeEvent(trace))
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: FakeStream(trace, "current")
    )
    monkeypatch.setattr(ring_module, "_pinned", lambda size: torch.empty(size, dtype=torch.long))
    move = Ring._move

    def logged_move(
        self: Ring, slot: torch.Tensor, index: torch.Tensor, fill: Any, *, gather: bool
    ) -> None:
        trace.ops.append(("gather" if gather else "scatter", trace.current, ""))
        move(self, slot, index, fill, gather=gather)

    monkeypatch.setattr(Ring, "_move", logged_move)
    layouts = learned("flash", torch.float16, flash_cache)
    host = BlockCopier(random_caches(flash_cache, torch.float16, seed=41), layouts)
    ringed = BlockCopier(
        random_caches(flash_cache, torch.float16, seed=41),
        layouts,
        use_ring=True,
        ring_slots=2,
        slot_bytes=host.block_bytes,
    )
    assert ringed.ring is not None
    ringed.ring._dma, ringed.ring._kernel = FakeStream(trace, "dma"), FakeStream(trace, "kernel")
    yield trace, host, ringed


def symbolic(ops: list[tuple[str, str, str]]) -> list[str]:
    """Events renamed in the order they were recorded (e1, e2, ... become E0, E1, ...)."""
    names: dict[str, str] = {}
    for op, _, event in ops:
        if op == "record":
            names[event] = f"E{len(names)}"
    return [" ".join(x for x in (op, stream, names.get(ev, ev)) if x) for op, stream, ev in ops]


def test_a_load_is_ordered_after_its_event_and_slots_after_their_last_use(
    traced: tuple[Trace, BlockCopier, BlockCopier],
) -> None:
    trace, host, ringed = traced
    src = torch.randint(0, 256, (host.nbytes(3 * TOKENS),), dtype=torch.uint8)
    items = [([4, 0, 2], src, 0, 3 * TOKENS)]
    after = FakeEvent(trace)  # the compute stream's event, named e1: not recorded here
    handle = ringed.write_many(items, after=after)
    host.write_many(items)
    assert symbolic(trace.ops) == [
        "wait stream dma kernel",  # the index buffer: the last call's kernels read it
        "record dma E0",  # ... its upload
        "wait kernel E0",  # ... which this call's kernels read
        "wait kernel e1",  # nothing touches the caches before `after`
        "record dma E1",  # fill 0 (slot 0): DMA
        "wait kernel E1",
        "scatter kernel",
        "record kernel E2",  # slot 0 free again
        "record dma E3",  # fill 1 (slot 1)
        "wait kernel E3",
        "scatter kernel",
        "record kernel E4",
        "wait dma E2",  # fill 2 reuses slot 0: only after fill 0's scatter
        "record dma E5",
        "wait kernel E5",
        "scatter kernel",
        "record kernel E6",
    ]
    assert handle.event is not None
    assert handle.event.name == trace.ops[-1][2]  # the handle's event is the last scatter's
    for a, b in zip(host.caches, ringed.caches, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_store_gathers_after_its_event_and_its_handle_follows_the_last_dma(
    traced: tuple[Trace, BlockCopier, BlockCopier],
) -> None:
    trace, host, ringed = traced
    outs = [torch.zeros(host.nbytes(2 * TOKENS), dtype=torch.uint8) for _ in range(2)]
    ringed.write_many([([1], torch.zeros(host.block_bytes, dtype=torch.uint8), 0, TOKENS)])
    trace.ops.clear()
    handle = ringed.read_many([([3, 5], outs[0])], after=None)
    host.read_many([([3, 5], outs[1])])
    # the write before (one fill, slot 0) recorded e1 (its index upload), e2 (its DMA) and
    # e3 (its scatter); this read's fills take slot 1 (never used) and then slot 0
    assert symbolic(trace.ops) == [
        "host waits e1",  # the pinned index buffer is rewritten only after its last upload
        "wait stream dma kernel",
        "record dma E0",
        "wait kernel E0",  # the gathers read the block indices: only once they are up
        "wait stream kernel current",  # after=None: after the calling thread's stream
        "gather kernel",  # slot 1: no earlier use to wait for
        "record kernel E1",
        "wait dma E1",  # the DMA out waits for its gather
        "record dma E2",
        "wait kernel e3",  # slot 0: only after the write's scatter out of it
        "gather kernel",
        "record kernel E3",
        "wait dma E3",
        "record dma E4",
    ]
    assert handle.event is not None and handle.event.name == trace.ops[-1][2]
    assert torch.equal(outs[0], outs[1]) and outs[0].any()
