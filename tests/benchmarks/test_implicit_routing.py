"""`ctxcache bench implicit-routing` end to end on the tiny model: three stacks of two
workers each, every way's routing as the gateway documents it (docs/implicit.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.test_commands import run_bench


@pytest.mark.slow  # three stacks of two workers one after the other, ~1 min (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_implicit_routing_shares_the_prefix_on_its_worker(
    tmp_path: Path, tiny_model: Path
) -> None:
    data = run_bench(
        "implicit-routing",
        tmp_path / "routing",
        *("--quick", "--model", str(tiny_model), "--system-tokens", "400"),
    )
    meta = data["meta"]
    assert meta["prefix_tokens"] >= 400  # (the gateway shares a prefix of 128 tokens or more)
    rows = {r.get("way") or r["check"]: r for r in data["results"]}
    assert set(rows) == {"implicit", "passthrough", "keyed", "keys", "busy", "after"}
    convs, turns, probes = meta["conversations"], meta["turns"], meta["probes"]

    # implicit: the first conversation's system prompt forked by every later one, on its
    # worker; every later turn a hit on its conversation's worker
    implicit = rows["implicit"]
    assert len(implicit["by_worker"]) == 1, implicit  # (one request at a time: no overload)
    assert implicit["new_reused_prefix"] == implicit["new_conversations"] == convs - 1
    assert implicit["later_on_first_worker"] == implicit["later_turns"] == convs * (turns - 1)
    hits = convs * (turns - 1)
    assert implicit["implicit"] == {"miss": 1, "shared": convs - 1, "hit": hits}

    # passthrough: implicit sessions off, least-loaded routing over both workers
    passthrough = rows["passthrough"]
    assert set(passthrough["by_worker"]) == {"w0", "w1"}, passthrough
    assert passthrough["implicit"] == {"passed": passthrough["requests"]}
    assert passthrough["later_cached_share"] < implicit["later_cached_share"]

    # keyed: every request of a key on its one worker; a user's second conversation forks
    keyed, keys = rows["keyed"], rows["keys"]
    assert keyed["new_reused_prefix"] == keyed["new_conversations"] == meta["users"]
    users = meta["users"]
    assert keyed["implicit"] == {"miss": users, "shared": users, "hit": 2 * users * (turns - 1)}
    assert keys["keys_on_one_worker"] == len(keys["keys"]) == meta["users"]

    # the load bound: the prefix's worker busy, new conversations go to the other one and
    # read the prefix's blocks from the sidecar; once it is free, back to it
    busy, after = rows["busy"], rows["after"]
    owner = busy["prefix_worker"]
    assert owner in implicit["by_worker"]
    assert owner not in busy["by_worker"] and sum(busy["by_worker"].values()) == probes
    assert all(i[owner] == meta["imbalance_slack"] + 1 for i in busy["inflight_before"])
    assert busy["sidecar_mean"] > 0
    probed = [r for r in meta["requests"] if r["phase"] != "main"]
    assert [r["result"] for r in probed] == ["shared"] * (probes + 1)
    # the gateway's own count of the stack: the busy streams were new conversations
    assert meta["gateway_implicit_counts"]["on"]["miss"] == 1 + users + meta["imbalance_slack"] + 1
    assert after["by_worker"] == {owner: 1} and after["reused_prefix"] == 1

    table = (tmp_path / "routing" / "implicit-routing.md").read_text()
    assert "| implicit |" in table and "load bound:" in table
