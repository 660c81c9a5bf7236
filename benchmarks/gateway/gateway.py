"""`ctxcache bench gateway`: what the gateway adds over calling the worker directly.

One run starts its own Redis, a fast fake OpenAI backend (instant answers, so the numbers
are the gateway's own cost) and, unless --no-model, a real worker on the tiny model, with
one gateway in front of both; both backends name a real sidecar, which session turns pin.
Each case is measured direct and through the gateway, interleaved in rounds, at each
concurrency. Plain and streaming requests are measured with `wrk` where it is installed
(`wrk.py`), otherwise with our own keep-alive generator (`loadgen.py`),
which also runs the session turns (a conversation per connection) and the streams' TTFT.

Where the processes run: with --pin (the default on two CPUs or more) the cases at
concurrency 1 run with the gateway alone on the last CPU and every other process (load
generator, fake backend, Redis, sidecar; not the tiny model's worker, whose threads keep
every CPU) on the first, as a gateway and its workers sit on different hosts. At
concurrency 1 only one process works at a time, so pinning adds no CPU to either side;
cases at higher concurrency always run unpinned, where a CPU of its own would give the
gateway capacity that direct calls do not get. Pinned or not, one run's ratios move on a
small VM by more than a small change to the gateway does (docs/benchmarks.md, "Fifth
pass"): to compare two gateways, use `ctxcache bench gateway-ab`.

--tracing adds a second gateway with OpenTelemetry on (`OTEL_EXPORTER_OTLP_ENDPOINT` at a
local OTLP receiver, `benchmarks.lib.otlp_sink`, in a process of its own) and measures its plain
requests and session turns in the same rounds: tracing on against off, side by side.

Here: the options, the cases and the rounds. The processes and their CPUs are in
`gateway_stack.py`, a case's measurement in `gateway_measure.py`, the rows, table and plot
in `gateway_report.py` (all in benchmarks/gateway/).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from benchmarks.gateway.gateway_measure import (
    TURNS_PER_SESSION,
    Case,
    measure_ours,
    measure_wrk,
    streamed_chat,
)
from benchmarks.gateway.gateway_report import Sample
from benchmarks.gateway.gateway_stack import Placement, start_bare_relay, start_stack

# (full run, --quick) defaults of the options --quick shortens
QUICK = {"requests": (3000, 200), "model_requests": (200, 20), "rounds": (3, 1), "duration": (5, 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments, add_pin_argument, add_tiny_model_argument

    p.add_argument(
        "--requests",
        type=int,
        help="our generator: requests per case and round (3000; 200 --quick)",
    )
    p.add_argument(
        "--model-requests",
        type=int,
        help="our generator: requests per case and round on the tiny model (200; 20 --quick)",
    )
    p.add_argument("--duration", type=float, help="wrk: seconds per case and round (5; 1 --quick)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument(
        "--stream-concurrency",
        type=int,
        nargs="+",
        default=[8],
        help="concurrency of the streaming cases (their TTFT is measured at 1)",
    )
    p.add_argument(
        "--stream-tokens", type=int, default=16, help="tokens (= chunks) per streamed answer"
    )
    p.add_argument(
        "--generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="plain and streaming cases: wrk, our generator, or wrk when installed (auto)",
    )
    p.add_argument("--rounds", type=int, help="interleaved rounds (3; 1 --quick)")
    p.add_argument("--no-model", action="store_true", help="only the fake backend")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also the streaming TTFT of a bare ASGI relay on the gateway's own server and "
        "worker client (benchmarks.lib.bare_relay): what the app's layers add",
    )
    add_pin_argument(
        p, "concurrency-1 cases: the gateway on the last CPU, every other process on the first"
    )
    p.add_argument(
        "--gateway-tree",
        type=Path,
        help="start the gateway from this checkout instead (another commit's gateway, "
        "measured by this bench)",
    )
    p.add_argument(
        "--tracing",
        action="store_true",
        help="also a gateway with tracing on (spans exported to a local OTLP receiver)",
    )
    add_tiny_model_argument(p, "for the real worker")
    add_output_arguments(p, "gateway")
    p.add_argument("--quick", action="store_true", help="a short run (explicit options win)")


def main(args: argparse.Namespace) -> int:
    for name, (full, quick) in QUICK.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return asyncio.run(_run(args))


def _cases(args: argparse.Namespace, backends: dict[str, int]) -> tuple[list[Case], dict[str, str]]:
    """The cases, in the order each round runs them; and each case's direct case."""
    cases: list[Case] = []
    direct_of: dict[str, str] = {}
    for model in backends:
        n = args.requests if model == "fake" else args.model_requests
        body = {"model": model, "prompt": "Say something about caches.", "max_tokens": 3}
        body["temperature"] = 0
        plain = [
            Case(f"{model}: direct to the worker", model, "/v1/completions", body, [], n, True),
            Case(f"{model}: gateway, no session", model, "/v1/completions", body, [], n),
            Case(f"{model}: gateway, session turn", model, "", body, [], n, session="completion"),
            Case(f"{model}: gateway, chat session turn", model, "", body, [], n, session="chat"),
        ]
        if args.tracing:
            plain += [
                Case(f"{model}: traced gateway, no session", model, "/v1/completions", body, [], n),
                Case(f"{model}: traced gateway, session turn", model, "", body, [], n),
            ]
            plain[-2].traced = True
            plain[-1].traced, plain[-1].session = True, "completion"
        for case in plain:
            case.concurrency = args.concurrency
            direct_of[case.name] = plain[0].name
        cases += plain
        if model != "fake":
            continue
        chat = streamed_chat(model, args.stream_tokens)
        path = "/v1/chat/completions"
        for label, conc, ttft in (
            ("streaming chat", args.stream_concurrency, False),
            ("streaming chat TTFT", [1], True),
        ):
            # the same request passed through as it was before implicit sessions (it opts
            # out of them): the first request of a conversation costs what it adds
            plain_chat = {**chat, "prompt_cache_options": {"mode": "explicit"}}
            pair = [
                Case(f"{model}: {label}, direct", model, path, chat, conc, n, True, ttft=ttft),
                Case(f"{model}: {label}, gateway", model, path, chat, conc, n, ttft=ttft),
                Case(
                    f"{model}: {label}, gateway, passed through",
                    model,
                    path,
                    plain_chat,
                    conc,
                    n,
                    ttft=ttft,
                ),
            ]
            if ttft and args.floor:
                name = f"{model}: {label}, bare ASGI relay"
                pair.append(Case(name, model, path, chat, conc, n, ttft=ttft, bare=True))
            direct_of.update({c.name: pair[0].name for c in pair})
            cases += pair
    return cases, direct_of


async def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from benchmarks.gateway import gateway_report, wrk
    from benchmarks.lib.util import plot_path, run_meta, write_outputs
    from ctxcache.supervisor import Supervisor

    wrk_path = wrk.find() if args.generator != "python" else None
    if args.generator == "wrk" and wrk_path is None:
        sys.stderr.write("--generator wrk: wrk is not installed (apt-get install wrk)\n")
        return 2
    generator = (
        f"wrk ({wrk_path}) for plain and streaming requests; ours for session turns and TTFT"
        if wrk_path
        else "ours (benchmarks.gateway.loadgen) for every case"
        + ("" if args.generator == "python" else ": wrk is not installed")
    )
    sys.stderr.write(f"load generator: {generator}\n")
    meta = run_meta(
        "gateway",
        generator=generator,
        requests=args.requests,
        model_requests=0 if args.no_model else args.model_requests,
        wrk_seconds=args.duration if wrk_path else None,
        rounds=args.rounds,
        concurrency=args.concurrency,
        stream_concurrency=args.stream_concurrency,
        stream_tokens=args.stream_tokens,
        model=None if args.no_model else str(args.model_dir),
        turns_per_session=TURNS_PER_SESSION,
        tracing="a second gateway with OTLP export to a local receiver" if args.tracing else None,
        pinned="concurrency 1: the gateway on the last CPU, the rest on the first"
        if args.pin
        else None,
        gateway_tree=str(args.gateway_tree.resolve()) if args.gateway_tree else None,
    )
    samples: dict[tuple[str, int], list[Sample]] = {}
    with tempfile.TemporaryDirectory() as tmp, Supervisor(out=open("/dev/null", "w")) as sup:  # noqa: ASYNC230
        sys.stderr.write("starting redis, the backends and the gateway ...\n")
        gw_port, backends, traced_port = start_stack(sup, Path(tmp), args)
        bare_port = start_bare_relay(sup, backends["fake"]) if args.floor else None
        cases, direct_of = _cases(args, backends)
        plan = [
            (conc, case)
            for conc in sorted({c for case in cases for c in case.concurrency})
            for _ in range(args.rounds)
            for case in cases
            if conc in case.concurrency
        ]
        placement = Placement(sup)
        with tqdm(total=len(plan), desc="gateway bench", unit="case") as bar:
            for conc, case in plan:
                placement.set(pinned=args.pin and conc == 1)
                gateway = traced_port if case.traced else gw_port
                port = backends[case.model] if case.direct else gateway
                if case.bare:
                    assert bare_port is not None
                    port = bare_port
                if wrk_path and case.wrk_able:
                    sample = await measure_wrk(wrk_path, port, case, conc, args.duration)
                else:
                    sample = await measure_ours(port, gateway, case, conc)
                samples.setdefault((case.name, conc), []).append(sample)
                bar.update(1)

    data = gateway_report.rows(samples, direct_of)
    table = gateway_report.table(data)
    paths = write_outputs(args.out, "gateway", {"meta": meta, "results": data}, table)
    paths.append(plot_path(args, "gateway"))
    gateway_report.plot(paths[-1], data)
    print(f"load generator: {generator}\n")
    print(table)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
