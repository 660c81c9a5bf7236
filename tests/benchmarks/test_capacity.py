"""`ctxcache bench capacity`: what makes a rate held, the answer check, and a real run of
`--quick` (the tiny model, real vLLM, one engine at a time)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.capacity import capacity
from benchmarks.capacity import capacity_report as report
from benchmarks.capacity.capacity import USERS_PER_RATE
from benchmarks.capacity.capacity_load import Driver, Point, Sent, Texts, Workload
from tests.utils import check_png, require_vllm


def point(
    mode: str, qps: float, ttfts: list[float], *, gap: float, error: str | None = None
) -> Point:
    """Questions sent every `gap` seconds with these TTFTs (the first two are warm-up)."""
    p = Point(mode, qps)
    for i, ttft in enumerate(ttfts):
        p.sent.append(
            Sent(user=i, round=1, index=i, due=i * gap, sent=i * gap, ttft=ttft, total=ttft + 0.1)
        )
    p.sent[-1].error = error
    p.sent[-1].ttft = ttfts[-1]
    return p


def test_a_rate_is_held_only_within_the_slo_at_the_offered_rate_without_errors() -> None:
    fast = report.row(point("session", 1.0, [9.0, 9.0] + [0.3] * 20, gap=1.0), 2, 2.0)
    assert fast["held"] and fast["requests"] == 20  # the slow warm-up does not count
    assert abs(fast["achieved_qps"] - 1.0) < 1e-9 and fast["ttft_p95_ms"] == 300.0
    slow = report.row(point("session", 1.0, [0.3] * 18 + [2.5] * 4, gap=1.0), 2, 2.0)
    assert not slow["held"]  # p95 over 2 s
    behind = report.row(point("session", 1.0, [0.3] * 22, gap=1.25), 2, 2.0)
    assert not behind["held"] and behind["achieved_qps"] == 0.8  # it could not keep up
    failed = report.row(point("session", 1.0, [0.3] * 22, gap=1.0, error="503"), 2, 2.0)
    assert not failed["held"] and failed["errors"] == 1
    rows = [fast, slow | {"qps": 2.0}, report.row(point("roomy", 0.5, [0.1] * 22, gap=2), 2, 2)]
    assert report.capacity(rows, ["session", "roomy", "vllm-full"]) == {
        "session": 1.0,
        "roomy": 0.5,
        "vllm-full": None,
    }


def test_first_and_later_questions_are_reported_apart_and_creates_counted_once() -> None:
    """A user's first question (a streamed create, or a turn after a prefill-only one) and
    its later ones have their own TTFTs; a failed prefill-only create is an error, a failed
    streamed create is one (it is a question)."""
    p = Point("session", 1.0)
    p.sent.append(Sent(0, 1, 0, 0, 0, ttft=1.2, total=2.0, create=True))  # with its question
    p.sent.append(Sent(0, 2, 1, 1, 1, ttft=0.3, total=1.0))
    p.sent.append(Sent(1, 0, -1, 2, 2, ttft=0.9, total=0.9, create=True))  # prefill only
    p.sent.append(Sent(1, 1, 2, 2, 3, ttft=1.4, total=2.1))
    p.sent.append(Sent(1, 2, 3, 3, 4, ttft=0.5, total=1.2))
    p.sent.append(Sent(2, 1, 4, 4, 5, ttft=9.9, total=9.9, create=True, error="503"))
    r = report.row(p, 0, 2.0)
    assert r["creates"] == 3 and r["errors"] == 1 and r["requests"] == 5
    assert (r["first_ttft_p50_ms"], r["first_ttft_p95_ms"]) == (1200.0, 1400.0)
    assert (r["later_ttft_p50_ms"], r["later_ttft_p95_ms"]) == (300.0, 500.0)
    p.sent[2].error = "503"
    assert report.row(p, 0, 2.0)["errors"] == 2


def test_session_answers_are_compared_with_the_same_engines_full_history_answers() -> None:
    ref, ses = Point("vllm-full-connector", 1.0), Point("session", 1.0)
    for user, (a, b) in enumerate([("x y", "x y"), ("p q", "p r")]):
        ref.sent.append(Sent(user, 1, user, 0, 0, answer=a))
        ses.sent.append(Sent(user, 1, user, 0, 0, answer=b))
    ses2 = Point("session", 2.0)  # a rate the reference never ran: its users are its own
    ses2.sent.append(Sent(200_000, 1, 0, 0, 0, answer="x y"))
    ref.sent.append(Sent(1, 2, 2, 0, 0, answer="z"))  # user 1's round 2: after it diverged
    ses.sent.append(Sent(1, 2, 2, 0, 0, answer="w"))
    got = report.compare(report.answers([ref, ses, ses2]))
    assert got["reference"] == "vllm-full-connector"
    assert (got["compared"], got["mismatches"], got["after_divergence"]) == (2, 1, 1)
    assert got["examples"] == [{"qps": 1.0, "user": 1, "round": 1, "first_different_char": 2}]
    # how far the answers went together: all of "x y", the first 2 of "p q"'s 3 characters
    assert got["agreed_share_median"] == 2 / 3
    summary = report.summary([], ["vllm-full-connector", "session"], [ref, ses, ses2], 2.0)
    assert (
        "1 of 2 (1 later rounds of diverged conversations not compared); the median "
        "answer the same for its first 67%" in report.headline(summary)
    )


def test_every_mode_is_compared_with_the_reference_the_controls_beside_the_session() -> None:
    """vllm-full and roomy are counted as the session is: a mismatch they show too is the
    engine's arithmetic, not ctxcache's (docs/benchmarks.md, capacity's answers)."""
    points = {m: Point(m, 1.0) for m in ("vllm-full-connector", "vllm-full", "roomy", "session")}
    answers = {"vllm-full-connector": "a", "vllm-full": "a", "roomy": "b", "session": "a"}
    for mode, text in answers.items():
        points[mode].sent.append(Sent(0, 1, 0, 0, 0, answer=text))
    got = report.compare_all(report.answers(list(points.values())))
    assert set(got) == {"vllm-full", "roomy", "session"}  # not the reference against itself
    assert [got[m]["mismatches"] for m in ("vllm-full", "roomy", "session")] == [0, 1, 0]
    summary = report.summary([], list(points), list(points.values()), 2.0)
    assert summary["answers"] == got["session"]
    text = report.headline(summary)
    assert "roomy answers equal to vllm-full-connector's: 0 of 1" in text
    assert "session answers equal to vllm-full-connector's: 1 of 1" in text
    assert summary["session_answers_vs_roomy"]["mismatches"] == 1
    assert "session answers equal to roomy's (vLLM's own prefix cache): 0 of 1" in text


def test_a_reference_that_held_no_rate_gives_no_ratio_and_valid_json() -> None:
    rows = [
        {"mode": "vllm-full-connector", "qps": 0.5, "achieved_qps": 0.4, "held": False}
        | {"ttft_p95_ms": 2500.0},
        {"mode": "session", "qps": 0.5, "achieved_qps": 0.5, "held": True, "ttft_p95_ms": 900.0},
    ]
    summary = report.summary(rows, ["vllm-full-connector", "session"], [], 2.0)
    assert summary["session_over_vllm-full-connector"] is None
    # the throughput beside it: the most each mode got done, and whether a rate saturated it
    assert summary["most_done_qps"] == {"vllm-full-connector": 0.4, "session": 0.5}
    assert summary["saturated"] == {"vllm-full-connector": True, "session": False}
    assert summary["session_over_vllm-full-connector_most_done"] == 0.5 / 0.4
    json.loads(json.dumps(summary, allow_nan=False))  # strict JSON: no Infinity
    text = report.headline(summary)
    assert "no ratio (vllm-full-connector held no rate)" in text
    assert "- vllm-full-connector: most requests done 0.40 req/s (saturated)" in text
    assert "- session ÷ vllm-full-connector, most done: 1.25×" in text


def arrivals(
    w: Workload, qps: float, measured: int, warmup: int, first_user: int = 0
) -> list[tuple[int, int]]:
    """The users a driver run meets, in arrival order, each with the number of questions it
    will ask (a driver whose users send nothing)."""
    seen: list[tuple[int, int]] = []

    class Arrivals(Driver):
        async def _user(  # type: ignore[override]
            self,
            http: object,
            k: int,
            rounds: int,
            due: float,
            gap: float,
            t0: float,
            counters: dict[str, int],
            *rest: object,
        ) -> float:
            seen.append((k, rounds))
            counters["sent"] += rounds
            await asyncio.sleep(0)  # (the other slots' users arrive meanwhile)
            return due

    driver = Arrivals("x", "http://127.0.0.1:9", "m", Texts(w, None), session=False)
    asyncio.run(driver.run(qps, measured, warmup, first_user=first_user))
    return seen


def test_each_rate_meets_users_no_engine_has_seen() -> None:
    """Rates number their users apart, so a prefix cache that outlives a rate (roomy's)
    cannot answer the next rate's new users from the last one's conversations."""
    w = Workload(users=2, rounds=1, history_tokens=40, question_tokens=8, answer_tokens=2)
    texts = Texts(w, None)
    assert texts.user(0) != texts.user(USERS_PER_RATE)  # another rate's first user
    assert texts.user(0) == Texts(w, None).user(0)  # the same in every mode
    seen = arrivals(w, 1e3, 3, 1, first_user=USERS_PER_RATE)
    assert [k for k, _ in seen] == [USERS_PER_RATE + i for i in range(4)]


def test_the_first_users_leave_at_staggered_rounds_so_new_users_arrive_spread_out() -> None:
    w = Workload(users=7, rounds=3, history_tokens=40, question_tokens=8, answer_tokens=2)
    firsts = dict(arrivals(w, 1e3, 40, 0))
    assert [firsts[k] for k in range(7)] == [3, 2, 1, 3, 2, 1, 3]  # slot i: 3 - i % 3
    assert all(firsts[k] == 3 for k in range(7, len(firsts)))  # later users: every round


class FakeChat:
    """The engine or the gateway: every request kept; each answered with a streamed
    `answer N` (a create: with the session's id in `x-session-id`)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        self.sent.append((request.method, request.url.path, body))
        if request.method == "DELETE":
            return httpx.Response(200, json={"deleted": True})
        usage = {"prompt_tokens": 10 * len(body["messages"]), "completion_tokens": 2}
        if body.get("max_tokens") == 0:  # a prefill-only create
            return httpx.Response(200, json={"session_id": "ctx_1", "usage": usage})
        n = len(self.sent)
        chunks = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in ("answer", f" {n}")]
        chunks.append({"choices": [], "usage": usage})
        data = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
        headers = {"x-session-id": "ctx_1"} if request.url.path == "/v1/context" else {}
        return httpx.Response(200, content=data + b"data: [DONE]\n\n", headers=headers)


ONE = Workload(users=1, rounds=3, history_tokens=40, question_tokens=8, answer_tokens=2)


def drive_user(session: bool, separate_create: bool = False) -> tuple[FakeChat, Point]:
    """User 3's three questions through the driver."""
    texts = Texts(ONE, None)
    driver = Driver(
        "m", "http://e", "tiny", texts, session=session, separate_create=separate_create
    )
    fake, point = FakeChat(), Point("m", 1.0)

    async def go() -> None:
        transport = httpx.MockTransport(fake)
        async with httpx.AsyncClient(base_url="http://e", transport=transport) as http:
            t0 = time.perf_counter()
            await driver._user(http, 3, 3, 0.0, 0.0, t0, {"sent": 0, "user": 0}, 99, point, None)

    asyncio.run(go())
    return fake, point


def test_a_full_history_user_resends_its_context_and_every_answer() -> None:
    fake, point = drive_user(session=False)
    context, questions = Texts(ONE, None).user(3)
    bodies = [b for _, _, b in fake.sent]
    assert [p for _, p, _ in fake.sent] == ["/v1/chat/completions"] * 3  # nothing to delete
    for b in bodies:
        assert b["model"] == "tiny" and b["max_tokens"] == 2 and b["temperature"] == 0
        assert b["stream"] and b["stream_options"] == {"include_usage": True}
        assert "session_id" not in b and "ttl" not in b
    q = [{"role": "user", "content": text} for text in questions]
    assert bodies[0]["messages"] == [*context, q[0]]
    assert bodies[2]["messages"] == [
        *context,
        q[0],
        {"role": "assistant", "content": "answer 1"},
        q[1],
        {"role": "assistant", "content": "answer 2"},
        q[2],
    ]
    assert [(s.round, s.index, s.answer, s.create) for s in point.sent] == [
        (1, 0, "answer 1", False),
        (2, 1, "answer 2", False),
        (3, 2, "answer 3", False),
    ]
    assert all(s.error is None and 0 < s.ttft <= s.total for s in point.sent)


def test_a_session_user_creates_with_its_first_question_then_sends_each_question_alone() -> None:
    fake, point = drive_user(session=True)
    context, questions = Texts(ONE, None).user(3)
    (create, *turns, delete) = fake.sent
    assert create[1] == "/v1/context" and create[2]["ttl"] == 900 and create[2]["stream"]
    assert create[2]["messages"] == [*context, {"role": "user", "content": questions[0]}]
    assert delete[:2] == ("DELETE", "/v1/context/ctx_1")
    for (_, path, body), question in zip(turns, questions[1:], strict=True):
        assert path == "/v1/chat/completions" and body["session_id"] == "ctx_1"
        assert body["messages"] == [{"role": "user", "content": question}]
    assert [s.create for s in point.sent] == [True, False, False]
    assert all(s.error is None for s in point.sent)


def test_a_separate_create_prefills_the_context_then_every_question_is_a_turn() -> None:
    fake, point = drive_user(session=True, separate_create=True)
    context, questions = Texts(ONE, None).user(3)
    (create, *turns, delete) = fake.sent
    assert create[1] == "/v1/context" and create[2]["max_tokens"] == 0
    assert create[2]["messages"] == context
    assert [b["messages"] for _, _, b in turns] == [
        [{"role": "user", "content": q}] for q in questions
    ]
    assert all(b["session_id"] == "ctx_1" for _, _, b in turns) and delete[0] == "DELETE"
    prefill, *asked = point.sent
    assert (prefill.round, prefill.index, prefill.create) == (0, -1, True)
    assert [(s.round, s.create) for s in asked] == [(1, False), (2, False), (3, False)]
    # the first question's TTFT counts from the user's arrival: its create included
    assert asked[0].ttft >= prefill.total


@pytest.mark.slow  # minutes on 2 CPUs: `make test-slow` (CI runs it)
@pytest.mark.timeout(900)
def test_quick_capacity_run_on_vllm_writes_the_documented_outputs(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two modes, each engine alone, two rates: the files, the rows, the answer check."""
    require_vllm()
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ctxcache.cli", "bench", "capacity", "--quick"),
            *("--model", str(tiny_model), "--modes", "vllm-full-connector,session"),
            # float32 on every CPU: the answers below must match exactly, and bf16 (the
            # default where the CPU has AMX or avx512_bf16) rounds reused KV differently
            *("--dtype", "float32", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    logs = "".join(p.read_text()[-2000:] for p in sorted(out.glob("servers-*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    assert {p.name for p in out.glob("servers-*.log")} == {
        "servers-vllm-full-connector.log",
        "servers-session.log",
    }  # one engine at a time, each with its own log
    data = json.loads((out / "capacity.json").read_text())
    meta = data["meta"]
    assert meta["modes"] == ["vllm-full-connector", "session"] and meta["qps"] == [1.0, 2.0]
    assert meta["dtype"] == "float32"
    rows = data["results"]
    assert [(r["mode"], r["qps"]) for r in rows] == [
        ("vllm-full-connector", 1.0),
        ("vllm-full-connector", 2.0),
        ("session", 1.0),
        ("session", 2.0),
    ]
    for r in rows:
        assert r["requests"] == 6 and r["errors"] == 0 and r["ttft_p50_ms"] > 0
        assert r["engine_steps"] > 0 and r["connector_ms"] is not None
    session = [r for r in rows if r["mode"] == "session"]
    assert all(r["creates"] > 0 and r["cached_ratio"] > 0.3 for r in session)
    # a session's first question is its create (streamed), its answer compared as any other
    firsts = [s for s in data["requests"] if s["mode"] == "session" and s["create"]]
    assert firsts and all(s["round"] == 1 and s["answer"] for s in firsts)
    answers = data["summary"]["answers"]
    assert answers["reference"] == "vllm-full-connector" and answers["compared"] >= 12
    assert answers["mismatches"] == 0, answers
    assert "| mode | offered req/s |" in (out / "capacity.md").read_text()
    check_png(out / "capacity.png")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    args = parser.parse_args(list(argv))
    if args.quick:
        capacity._quick(args)
    capacity._workload_defaults(args)
    return args


def test_the_long_workload_is_the_default_and_short_repeats_the_runs_before_it() -> None:
    """Issue 59: the default is a workload where a prefill costs a large part of a turn;
    `--workload short` gives back every size of the runs before it, and an option given
    still wins over the workload's value."""
    long = parse()
    assert (long.workload, long.system_tokens + long.history_tokens) == ("long", 5000)
    assert (long.answer_tokens, long.kv_blocks, long.max_model_len) == (100, 160, 8192)
    assert (long.slo, long.warmup) == (10.0, 2 * long.users)
    end = 5000 + long.rounds * long.question_tokens + long.rounds * long.answer_tokens
    assert end <= long.max_model_len  # the last answer fits the window
    assert long.kv_blocks * 128 < 4 * end  # the cache holds a few conversations, not all
    short = parse("--workload", "short")
    assert (short.users, short.rounds, short.history_tokens, short.answer_tokens) == (
        12,
        5,
        900,
        32,
    )
    assert (short.kv_blocks, short.max_model_len, short.slo, short.warmup) == (48, 4096, 2.0, 60)
    assert parse("--kv-blocks", "96", "--warmup", "3").kv_blocks == 96
    assert parse("--warmup", "3").warmup == 3
    quick = parse("--quick")  # CI's: the short workload on the tiny preset
    assert (quick.workload, quick.preset, quick.users, quick.max_model_len) == (
        "short",
        "tiny",
        3,
        4096,
    )


def test_answers_of_runs_merged_with_with_are_compared_by_user_number() -> None:
    """A user's conversation is a function of its number: a run's rows and answers merged
    with `--with` are compared by user and round, whatever rate each run asked them at."""
    fc, ses = Point("vllm-full-connector", 0.1), Point("session", 0.3)
    fc.sent += [Sent(0, 1, 0, 0, 0, answer="a"), Sent(1, 1, 1, 0, 0, answer="b")]
    ses.sent += [Sent(0, 1, 0, 0, 0, answer="a"), Sent(1, 1, 1, 0, 0, answer="c")]
    data = {"requests": report.sent_rows([fc])}
    (back,) = report.points_of(json.loads(json.dumps(data)))
    assert (back.mode, back.qps) == ("vllm-full-connector", 0.1)
    assert [s.answer for s in back.sent] == ["a", "b"]
    got = report.compare(report.answers([back, ses]))
    assert (got["compared"], got["mismatches"]) == (2, 1)
    assert got["examples"][0] == {"qps": 0.3, "user": 1, "round": 1, "first_different_char": 0}


def test_a_run_to_merge_must_be_the_same_workload_and_other_modes(tmp_path: Path) -> None:
    args = parse()
    w = Workload(
        users=args.users,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        history_tokens=args.history_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
    )
    meta = {
        "workload": vars(w),
        "dtype": "bfloat16",
        "kv_blocks": args.kv_blocks,
        "max_model_len": args.max_model_len,
        "seed": 0,
        "slo_s": args.slo,
        "modes": ["vllm-full-connector"],
    }
    same = {k: v for k, v in meta.items() if k != "modes"}
    path = tmp_path / "capacity.json"
    path.write_text(json.dumps({"meta": meta, "results": [{"mode": "x"}], "requests": []}))
    got = capacity.merged([path], ["session"], [{"mode": "session"}], [], same)
    assert got == (["vllm-full-connector", "session"], [{"mode": "x"}, {"mode": "session"}], [])
    # a mode's sweep going on in a later run: other rates and other users (--rate-offset)
    old = Point("vllm-full-connector", 0.1)
    old.sent.append(Sent(0, 1, 0, 0, 0, answer="a"))
    path.write_text(json.dumps({"meta": meta, "results": [], "requests": report.sent_rows([old])}))
    more = Point("vllm-full-connector", 0.2)
    more.sent.append(Sent(USERS_PER_RATE, 1, 0, 0, 0, answer="b"))
    modes, _, points = capacity.merged([path], ["vllm-full-connector"], [], [more], same)
    assert modes == ["vllm-full-connector"] and [p.qps for p in points] == [0.1, 0.2]
    with pytest.raises(SystemExit, match="at a rate this run ran too"):
        capacity.merged([path], ["vllm-full-connector"], [], [old], same)
    more.sent[0].user = 0
    with pytest.raises(SystemExit, match="the same users"):
        capacity.merged([path], ["vllm-full-connector"], [], [more], same)
    with pytest.raises(SystemExit, match="not this run's dtype"):
        capacity.merged([path], ["session"], [], [], same | {"dtype": "float32"})
    path.write_text(json.dumps({"meta": meta | {"kv_blocks": 48}, "results": []}))
    with pytest.raises(SystemExit, match="kv_blocks"):
        capacity.merged([path], ["session"], [], [], same)


def test_an_earlier_run_is_judged_again_at_a_stricter_slo(tmp_path: Path) -> None:
    """`--from`: a rate's p95 does not depend on the SLO, so a run swept at 10 s has every
    rate a 2 s target needs; its report is written again, and a looser SLO is refused."""
    fc = report.row(point("vllm-full-connector", 0.5, [1.0] * 12, gap=2.0), 2, 10.0)
    slow = report.row(point("session", 1.0, [0.5] * 10 + [3.0] * 2, gap=1.0), 2, 10.0)
    fast = report.row(point("session", 0.5, [0.5] * 12, gap=2.0), 2, 10.0)
    assert fc["held"] and slow["held"] and fast["held"]  # at 10 s
    pts = [point("vllm-full-connector", 0.5, [1.0] * 12, gap=2.0)]
    meta = {"modes": ["vllm-full-connector", "session"], "slo_s": 10.0, "command": "c"}
    meta |= {"date": "d", "machine": {"cpus": 2}}
    source = tmp_path / "run.json"
    data = {"meta": meta, "summary": {"kept": 1}, "results": [fc, fast, slow]}
    source.write_text(json.dumps(data | {"requests": report.sent_rows(pts)}))
    out = tmp_path / "again"
    assert capacity.judge(source, 2.0, out, None, "capacity") == 0
    again = json.loads((out / "capacity.json").read_text())
    assert [r["held"] for r in again["results"]] == [True, True, False]
    assert again["summary"]["capacity_qps"] == {"vllm-full-connector": 0.5, "session": 0.5}
    assert again["summary"]["kept"] == 1 and again["meta"]["slo_s"] == 2.0
    assert again["meta"]["judged_from"] == str(source)
    text = (out / "capacity.md").read_text()
    assert "Judged again at p95 TTFT ≤ 2 s" in text and "p95 TTFT ≤ 2 s:" in text
    check_png(out / "capacity.png")
    with pytest.raises(SystemExit, match="above its own 10 s"):
        capacity.judge(source, 20.0, out, None, "capacity")
