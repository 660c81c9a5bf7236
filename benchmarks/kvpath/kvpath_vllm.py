"""`ctxcache bench kvpath --engine vllm`: a cold session turn beside a hot one, on real vLLM.

For each dtype (`--dtypes`; `auto`, the default: the CPU's, `ctxcache/cpu.py`) and data
path (`--paths`: tcp, shm), one stack at a time: Redis, the sidecar (with `--local-dir` in
a fresh /dev/shm directory for shm), vLLM with the ctxcache connector (dev mode, so
`/reset_prefix_cache` exists; `--dtype`; the shared-memory path when shm) and the gateway.
One session holds a document of about `--context-tokens` tokens; each round asks a new
question of it twice, through the gateway, streamed, with
`session_append: false` (the history stays the same length):
- **hot**: the history is still in vLLM's own prefix cache;
- **cold**: after `/reset_prefix_cache`, the connector loads the history from the sidecar.
Which goes first alternates per round. TTFT is the time to the first content token; the
ratio cold ÷ hot is paired per round (median). Warm-up rounds (`--warmup`) run the same way
first and are not counted. Every answer (greedy, `--max-tokens`) is compared with the same
engine's answer to the whole conversation sent without a session and with a fresh
`cache_salt`: computed from scratch, the connector not involved. The same request sent
again right after is the control: its history comes from vLLM's own prefix cache, as a hot
turn's does (in bfloat16 a prefix-cached prefill can round differently from a whole one, and
a greedy answer then part from the recomputed one). Each turn's deltas of the connector's
counters and of vLLM's own request timings (`/metrics`) say where its time went.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.kvpath.kvpath import shm_tempdir
from benchmarks.lib.util import stream_chat

NAME = "kvpath-vllm"
ROUNDS = 8  # the default here; kvpath's own `--rounds` default is for its copies
TARGET = 1.15  # cold TTFT at most this many times hot (the target)
BLOCK = 128  # vLLM's CPU block: what a cold turn may recompute at most
KV_CACHE_GIB = 4  # the session and every reference's salted prefill, float32 included
# the connector's counters (`vllm:ctxcache_<name>_total`) and vLLM's request timings read
# around every turn
COUNTERS = (
    "loaded_tokens",
    "load_tokens_planned",
    "load_bytes_shm",
    "load_bytes_tcp",
    "load_us_shm",
    "load_us_tcp",
    "load_ms",
    "lookup_us",
    "load_failures",
    "load_races",
    "sidecar_errors",
)
TIMINGS = {  # vLLM's histograms (seconds): their sums' deltas, in ms
    "engine_ttft_ms": "vllm:time_to_first_token_seconds_sum",
    "queue_ms": "vllm:request_queue_time_seconds_sum",
    "prefill_ms": "vllm:request_prefill_time_seconds_sum",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--engine vllm` (`--paths`, `--rounds`, `--out`, `--plot`: kvpath's)."""
    g = parser.add_argument_group("--engine vllm")
    a = g.add_argument
    a(
        "--dtypes",
        default="auto",
        help="vllm: comma list of vLLM --dtype values (auto: by the CPU, bfloat16 with AMX or "
        "avx512_bf16, else float32; bfloat16,float32: both)",
    )
    a("--context-tokens", type=int, default=4000, help="vllm: the session's history, tokens")
    a(
        "--model-dir",
        dest="model",
        type=Path,
        default=None,
        help="vllm: the model (the --preset is built there if missing; default "
        ".ctxcache/models/PRESET)",
    )
    a(
        "--preset",
        choices=("tiny", "small", "tiny-sliding", "small-sliding", "tiny-hybrid"),
        default="small",
        help="vllm: the model's preset (tiny-hybrid: recurrent state, --dtypes bfloat16)",
    )
    a("--max-tokens", type=int, default=8, help="vllm: max_tokens of every answer")
    a("--warmup", type=int, default=1, help="vllm: rounds run first and not counted")
    a("--seed", type=int, default=0, help="vllm: the document's and the questions' words")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from benchmarks.capacity.capacity import _model
    from benchmarks.kvpath.kvpath_vllm_report import markdown, plot, row_of, summary_line
    from benchmarks.lib.util import plot_path, run_meta, write_outputs
    from ctxcache.logs import setup_logging
    from ctxcache.vllm_engine import auto_reserved_cpus

    setup_logging("bench", "WARNING")
    from ctxcache.cpu import vllm_dtype

    dtypes = list(dict.fromkeys(vllm_dtype(d).dtype for d in args.dtypes.split(",") if d))
    paths = [p for p in args.paths.split(",") if p]
    if not dtypes or not paths or set(paths) - {"tcp", "shm"}:
        sys.stderr.write("--paths: tcp and/or shm; --dtypes: at least one\n")
        return 2
    rounds = _rounds(args)
    if args.model is None:
        args.model = Path(".ctxcache/models") / args.preset
    model = _model(args)
    texts = Texts.make(model, args.context_tokens, args.warmup + rounds, args.seed)
    meta = run_meta(
        NAME,
        engine="vllm",
        model=str(model),
        preset=args.preset,
        dtypes=dtypes,
        paths=paths,
        rounds=rounds,
        warmup=args.warmup,
        context_tokens=args.context_tokens,
        max_tokens=args.max_tokens,
        target=TARGET,
        reserved_cpus=auto_reserved_cpus(),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tqdm(total=len(dtypes) * len(paths) * (args.warmup + rounds), unit="round") as bar:
        for dtype in dtypes:
            for path in paths:
                bar.set_description(f"kvpath vllm {dtype} {path}")
                with started(model, dtype, path, out / f"servers-{dtype}-{path}.log") as stack:
                    others = CpuOfOthers(stack.groups)
                    context, turns = Session(stack, texts, args.max_tokens).run(args.warmup, bar)
                    busy = others.percent()  # (while the servers' ticks can still be read)
                rows.append(row_of(dtype, path, context, turns, args.warmup))
                rows[-1]["others_cpu_percent"] = busy  # other work skews the timings
                sys.stderr.write(summary_line(rows[-1]) + "\n")
    write_outputs(out, NAME, {"meta": meta, "results": rows}, markdown(rows, meta))
    plot(rows, plot_path(args, NAME))
    return 0


def _rounds(args: argparse.Namespace) -> int:
    """`--rounds` as given, else ROUNDS (kvpath's default is for its plain copies)."""
    from benchmarks.kvpath.kvpath import add_arguments as kvpath_arguments

    parser = argparse.ArgumentParser()
    kvpath_arguments(parser)
    return ROUNDS if args.rounds == parser.get_default("rounds") else int(args.rounds)


# ---- the words ------------------------------------------------------------------------
@dataclass(frozen=True)
class Texts:
    system: str  # the instruction and the document: the session's history
    questions: list[str]  # one per round, warm-up first

    @classmethod
    def make(cls, model: Path, tokens: int, rounds: int, seed: int) -> Texts:
        """A document cut to `tokens` tokens of the model's tokenizer (less what the chat
        template adds around it), and `rounds` different questions."""
        from transformers import AutoTokenizer

        from benchmarks.multiturn.multiturn import WORDS

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        rng = random.Random(seed)
        head = "Read the document below, then answer questions about it.\n\n"
        words = " ".join(rng.choice(WORDS) for _ in range(2 * tokens))
        ids = tokenizer.encode(words, add_special_tokens=False)
        body = tokenizer.decode(ids[: max(1, tokens - 16 - len(tokenizer.encode(head)))])
        questions = [
            f"Question {i + 1}: what does the document say about "
            f"{rng.choice(WORDS)} and {rng.choice(WORDS)}?"
            for i in range(rounds)
        ]
        return cls(head + body, questions)


# ---- the stack ------------------------------------------------------------------------
@dataclass(frozen=True)
class Stack:
    gateway: str
    engine: str
    model: str  # the served name
    stopping: threading.Event  # Ctrl-C (the supervisor owns SIGINT)
    groups: frozenset[int]  # the servers' process groups


class CpuOfOthers:
    """How much CPU everything but this benchmark and its servers took meanwhile, in % of
    one CPU: the machine's busy time (steal included) less ours (None without /proc)."""

    def __init__(self, groups: frozenset[int]) -> None:
        self.groups = groups
        self.start = self._ticks(), time.monotonic()

    def _ticks(self) -> tuple[int, int] | None:
        try:
            cpu = [int(v) for v in Path("/proc/stat").read_text().split()[1:9]]
        except OSError:
            return None
        ours = round(sum(os.times()[:2]) * os.sysconf("SC_CLK_TCK"))
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[2]) in self.groups:
                ours += int(fields[11]) + int(fields[12])  # utime + stime
        return sum(cpu) - cpu[3] - cpu[4], ours  # less idle and iowait

    def percent(self) -> float | None:
        (before, t0), after = self.start, self._ticks()
        if before is None or after is None:
            return None
        others = (after[0] - before[0]) - (after[1] - before[1])
        return round(max(0, others) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0) * 100)


@contextmanager
def started(model: Path, dtype: str, path: str, log: Path) -> Iterator[Stack]:
    """Redis, the sidecar, vLLM with the connector (shm: through the sidecar's shared
    region), the gateway; every one stopped when the block ends, Ctrl-C included."""
    from benchmarks.lib.stack import (
        Engine,
        Gateway,
        StackBuilder,
        StackSettings,
        SupervisorRunner,
    )
    from ctxcache.net import free_port
    from ctxcache.supervisor import Supervisor
    from ctxcache.vllm_engine import VllmLaunch, must_run_eager, served_name

    shm = shm_tempdir() if path == "shm" else None
    with (
        tempfile.TemporaryDirectory(prefix="ctxcache-kvpath-vllm-") as data,
        shm or nullcontext(None) as local,
        open(log, "w") as log_file,
        Supervisor(out=log_file) as sup,
    ):
        sidecar = ["--data-dir", str(Path(data) / "sidecar"), "--memory-bytes", str(1 << 30)]
        sidecar += ["--local-dir", local] if local else []
        builder = StackBuilder(
            StackSettings(sidecar=tuple(sidecar)), Path(data), SupervisorRunner(sup)
        )
        stack = builder.start()
        launch = VllmLaunch(
            model=str(model),
            served_name=served_name(str(model)),
            port=free_port(),
            sidecar_lm=stack.sidecar_lm,
            sidecar_local_dir=local,
            kv_cache_gib=KV_CACHE_GIB,
            dev_mode=True,
            enforce_eager=must_run_eager([]),
            extra_args=["--dtype", dtype],
        )
        vllm = Engine(
            "vllm",
            "vllm",
            env=launch.env(),
            startup_timeout=900,
            command=tuple(launch.argv()),
            port=launch.port,
        )
        builder.add_engine(vllm)
        gw_url = builder.gateway(Gateway(log_level=None)).url
        groups = frozenset(c.proc.pid for c in sup.children if c.proc is not None)
        yield Stack(gw_url, launch.url, launch.served_name, sup.stopping, groups)


# ---- the rounds -----------------------------------------------------------------------
@dataclass
class Turn:
    round: int  # from 0; the warm-up rounds first
    kind: str  # hot, cold, reference (recomputed) or cached-reference (prefix-cached)
    text: str
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    cached_tokens: int
    engine: dict[str, float]  # the deltas of COUNTERS and TIMINGS over the turn
    matched: bool | None = None  # its answer equals the (recomputed) reference's
    matched_cached: bool | None = None  # ... the prefix-cached reference's


class Session:
    """One session of `texts.system`, asked each question hot and cold."""

    def __init__(self, stack: Stack, texts: Texts, max_tokens: int) -> None:
        self.stack, self.texts, self.max_tokens = stack, texts, max_tokens

    def run(self, warmup: int, bar: Any) -> tuple[int, list[Turn]]:
        """The session's context tokens, and every turn: each question's references (all
        first, so none runs between a hot turn and its cold one), then its hot and cold."""
        import httpx

        with (
            httpx.Client(base_url=self.stack.gateway, timeout=600) as http,
            httpx.Client(base_url=self.stack.engine, timeout=60) as engine,
        ):
            self.http, self.engine = http, engine
            system = {"role": "system", "content": self.texts.system}
            r = http.post("/v1/context", json={"model": self.stack.model, "messages": [system]})
            r.raise_for_status()
            sid = r.json()["session_id"]
            context = int(http.get(f"/v1/context/{sid}").json()["context_tokens"])
            users = [{"role": "user", "content": q} for q in self.texts.questions]
            bar.set_postfix_str("references")
            refs = [self.references(i, [system, u]) for i, u in enumerate(users)]
            bar.set_postfix_str("")
            turns: list[Turn] = []
            for i, (user, (ref, cached)) in enumerate(zip(users, refs, strict=True)):
                session = {"messages": [user], "session_id": sid, "session_append": False}
                for kind in ("hot", "cold") if (i - warmup) % 2 == 0 else ("cold", "hot"):
                    if kind == "cold":
                        self.reset_prefix_cache()
                    turn = self.turn(i, kind, session)
                    turn.matched = turn.text == ref.text
                    turn.matched_cached = turn.text == cached.text
                    turns.append(turn)
                bar.update(1)
            http.delete(f"/v1/context/{sid}")
        return context, turns + [t for pair in refs for t in pair]

    def references(self, i: int, messages: list[dict[str, str]]) -> tuple[Turn, Turn]:
        """The whole conversation without a session: computed from scratch (a fresh
        `cache_salt`), then again from vLLM's own prefix cache (the same salt)."""
        fields = {"messages": messages, "cache_salt": f"kvpath-{uuid.uuid4().hex}"}
        return self.turn(i, "reference", fields), self.turn(i, "cached-reference", fields)

    def turn(self, i: int, kind: str, fields: dict[str, Any]) -> Turn:
        """One streamed chat request; TTFT to its first content token."""
        import orjson

        if self.stack.stopping.is_set():
            raise KeyboardInterrupt
        body = {"model": self.stack.model, "max_tokens": self.max_tokens, "temperature": 0}
        body |= {"stream": True, "stream_options": {"include_usage": True}, **fields}
        before = scrape(self.engine)
        text, ttft, total, usage = stream_chat(self.http, orjson.dumps(body), f"{kind} turn")
        after = scrape(self.engine)
        return Turn(
            i,
            kind,
            text,
            ttft * 1e3,
            total * 1e3,
            int(usage.get("prompt_tokens") or 0),
            int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
        )

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache; it refuses while blocks are held (a store in flight):
        then again, for up to 30 s."""
        deadline = time.monotonic() + 30
        while True:
            r = self.engine.post("/reset_prefix_cache")
            r.raise_for_status()
            if r.json().get("success", True):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("vLLM did not reset its prefix cache in 30 s")
            time.sleep(0.05)


def scrape(engine: Any) -> dict[str, float]:
    """The connector's COUNTERS and vLLM's TIMINGS (ms) from /metrics (`engine`: an httpx
    client of vLLM)."""
    names = {f"vllm:ctxcache_{c}_total": c for c in COUNTERS}
    names |= {metric: key for key, metric in TIMINGS.items()}
    out = dict.fromkeys(names.values(), 0.0)
    for line in engine.get("/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            scale = 1e3 if names[name] in TIMINGS else 1.0
            out[names[name]] += float(line.rsplit(" ", 1)[1]) * scale
    return out
