"""`bench gateway --pin`: where the bench's processes run, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from benchmarks.gateway.gateway_stack import Placement


@dataclass
class Named:
    name: str
    proc: subprocess.Popen[bytes]


@dataclass
class Children:
    children: list[Named] = field(default_factory=list)


def affinity(proc: subprocess.Popen[bytes]) -> set[int]:
    return os.sched_getaffinity(proc.pid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pinned_puts_the_gateway_apart_and_unpinned_gives_everyone_every_cpu() -> None:
    cpus = os.sched_getaffinity(0)
    first, last = {min(cpus)}, {max(cpus)}
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    names = ("gateway", "fake", "redis", "worker")
    sup = Children([Named(n, subprocess.Popen(sleep)) for n in names])
    gateway, fake, redis, worker = (c.proc for c in sup.children)
    placement = Placement(sup)
    try:
        placement.set(pinned=True)
        assert affinity(gateway) == last
        assert affinity(fake) == first and affinity(redis) == first
        assert affinity(worker) == cpus  # the tiny model's worker: its threads keep every CPU
        assert os.sched_getaffinity(0) == first  # the generator (and wrk, its child)
        placement.set(pinned=False)
        assert all(affinity(p) == cpus for p in (gateway, fake, redis))
        assert os.sched_getaffinity(0) == cpus
    finally:
        placement.set(pinned=False)
        for child in sup.children:
            child.proc.kill()
            child.proc.wait()
