"""Worker test fixtures: the tiny model (built once per run), engines, a real sidecar."""

from __future__ import annotations

import queue
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.utils import SidecarProcess
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams
from worker.engine.runner import ModelRunner
from worker.kv.hashing import KeyMaker
from worker.kv.l1 import L1Cache
from worker.kv.manager import CachedPrefix, KVManager
from worker.kv.sidecar import SidecarKV, kv_client_factory

CHUNK = 32  # small chunks keep the tests fast; the logic is the same at 256
TOL = 1e-4


@pytest.fixture(scope="session")
def runner(tiny_model: Path) -> ModelRunner:
    torch.set_num_threads(2)
    return ModelRunner(str(tiny_model), "float32")


Sidecar = SidecarProcess


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    proc = Sidecar(tmp_path / "sidecar")
    (tmp_path / "sidecar").mkdir()
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(runner: ModelRunner) -> Iterator[EngineFactory]:
    engines: list[Engine] = []

    def make(
        sidecar: Sidecar | None = None,
        *,
        chunk: int = CHUNK,
        tail_blocks: bool = True,
        l1_bytes: int = 1 << 30,
        max_batch: int = 8,
        max_queue: int = 64,
    ) -> Engine:
        side = None
        if sidecar is not None:
            side = SidecarKV(kv_client_factory(sidecar.lm_url, 1.0), runner.kv_shape)
        kv = KVManager(
            L1Cache(l1_bytes), side, KeyMaker("tiny", "float", 0), chunk, tail_blocks=tail_blocks
        )
        engine = Engine(runner, kv, max_batch=max_batch, max_queue=max_queue)
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


@dataclass
class Result:
    prompt: list[int]
    tokens: list[int]
    logits: list[torch.Tensor]
    prefix: CachedPrefix
    finish_reason: str | None


class Pending:
    """A request submitted to an engine; `result()` waits for its events."""

    def __init__(
        self,
        engine: Engine,
        ids: list[int],
        params: SamplingParams,
        tags: tuple[tuple[str, str], ...],
    ) -> None:
        self.events: queue.Queue = queue.Queue()
        self.request = Request(
            uuid.uuid4().hex,
            list(ids),
            params,
            self.events.put,
            tags=tags,
            session=dict(tags).get("s", "-"),
            capture_logits=True,
        )
        engine.submit(self.request)

    def result(self, timeout: float = 60.0) -> Result:
        tokens: list[int] = []
        logits: list[torch.Tensor] = []
        while True:
            ev = self.events.get(timeout=timeout)
            assert ev.finish_reason != "error"
            tokens += ev.token_ids
            if ev.logits is not None:
                logits.append(ev.logits)
            if ev.finish_reason:
                prefix = self.request.prefix
                assert isinstance(prefix, CachedPrefix)
                return Result(self.request.prompt_ids, tokens, logits, prefix, ev.finish_reason)


def greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(
    engine: Engine, ids: list[int], max_tokens: int = 6, tags: tuple[tuple[str, str], ...] = ()
) -> Result:
    """Run one greedy request to the end and wait until its KV is stored."""
    result = Pending(engine, ids, greedy(max_tokens), tags).result()
    engine.wait_idle()
    return result


def assert_matches_recompute(runner: ModelRunner, result: Result) -> None:
    """Every step's logits equal a full recompute's within TOL, and greedy tokens agree."""
    ref = runner.full_logits(result.prompt + result.tokens)
    live = torch.isfinite(ref[0])
    n = len(result.prompt)
    assert len(result.logits) == len(result.tokens)
    for i, got in enumerate(result.logits):
        want = ref[n - 1 + i]
        err = (want[live] - got[live]).abs().max().item()
        assert err < TOL, f"step {i}: logits differ by {err} (cached {result.prefix.tokens})"
        assert int(want.argmax()) == result.tokens[i], f"step {i}: greedy token differs"


def random_ids(rng: torch.Generator, n: int, vocab: int = 4096) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=rng).tolist()
