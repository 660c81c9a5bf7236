"""`ctxcache bench multiturn`: a multi-turn chat replayed with a session and without.

The workload is synthetic and deterministic, shaped like the public ShareGPT multi-turn
replays: N conversations of up to 8 turns whose prompts average about 54, 206, 371, 532,
690, 826, 964 and 1,114 tokens at turns 1-8 (about 150 new tokens a turn: a user message
plus the previous answer). Each conversation starts with a short system message; the
assistant turns are whatever the model answers (greedy, `--answer-tokens` at most).

Modes, run against the same stack in the same run, interleaved turn by turn:
- `session`: `POST /v1/context` with the system message, then every turn sends only the new
  user message with `session_id` — the history is server-side state;
- `full`: the whole history every turn, with a fresh `cache_salt` per request, so nothing
  is reused: the cost of a stack without any KV reuse;
- `full-apc` (opt-in): the whole history with one `cache_salt` per conversation: what a
  worker's own in-memory prefix cache (vLLM's automatic prefix caching, our worker's L1)
  reuses of the conversation's earlier turns while it still holds them;
- `floor` (with a local model): the same model in this process, keeping each conversation's
  KV in memory and prefilling only the new tokens: what a session turn cannot beat.

Every request streams; TTFT is the time to the first chunk carrying text. Per turn: TTFT
p50/p90, total latency, request bytes, `cached_tokens` / `prompt_tokens`, speedup over
`full`, and whether the greedy answers of all modes were identical. Without `--url` the
command starts its own stack (`ctxcache serve`, the `small` preset by default).
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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxcache.benchutil import (
    add_output_arguments,
    markdown_table,
    percentile,
    plot_path,
    run_meta,
    write_outputs,
)

NAME = "multiturn"
# average prompt tokens at turns 1-8 of the ShareGPT multi-turn replays
TARGET_CONTEXT = (54, 206, 371, 532, 690, 826, 964, 1114)
SYSTEM = "You are a helpful assistant. Answer briefly."
TEMPLATE_TOKENS = 5  # what ChatML adds around a user message (measured when a model is at hand)
_WORD_TEXT = (
    "the a of to and in is it that for on with as was be by this are or from at an "
    "have not but which you they we one all can there their what so if about when more "
    "time will would up out some other into has two than them could like then its only "
    "session server model token cache history turn answer question data system user "
    "request memory block store build run test code file list value result number "
    "python function class return string error write read start stop first last next"
)
WORDS = _WORD_TEXT.split()
MODES = ("session", "full", "full-apc")
DEFAULT_MODEL = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ctxcache"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="an OpenAI-compatible base URL (default: start a stack here)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key")
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL / "models" / "small",
        help="local model dir: the stack's model and the in-process floor "
        "(the small preset is built there if missing)",
    )
    p.add_argument("--model-name", help="the model id in the API (default: the first listed)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8, choices=range(1, len(TARGET_CONTEXT) + 1))
    p.add_argument("--answer-tokens", type=int, default=100, help="max_tokens of each answer")
    p.add_argument(
        "--modes",
        default="session,full",
        help=f"comma-separated, of {', '.join(MODES)}; only `full` needs no ctxcache",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the in-process floor")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds between one answer and the next request (a user reading)",
    )
    p.add_argument("--quick", action="store_true", help="2 conversations, 3 turns, 8-token answers")
    add_output_arguments(p, NAME)


def main(args: argparse.Namespace) -> int:
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    if args.quick:
        args.conversations, args.turns, args.answer_tokens = 2, 3, 8
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        sys.stderr.write(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}\n")
        return 2
    local = args.model if (args.model / "config.json").exists() or not args.url else None
    if local is not None and not (local / "config.json").exists():
        from worker.presets import create_model

        sys.stderr.write(f"building the small preset into {local} ...\n")
        create_model("small", local)
    with _stack(args, local) as (url, stopping):
        replay = Replay(args, url, modes, local)
        rows = replay.run(stopping)
    meta = run_meta(
        NAME,
        url=args.url or "ctxcache serve (started by the benchmark)",
        model=str(local or args.model_name),
        conversations=args.conversations,
        turns=args.turns,
        answer_tokens=args.answer_tokens,
        modes=modes + (["floor"] if replay.floor else []),
        threads=args.threads,
        seed=args.seed,
        think_time_s=args.think_time,
    )
    summary = _summary(rows, modes, replay.floor is not None)
    data = {"meta": meta, "summary": summary, "results": rows, "requests": replay.log}
    paths = write_outputs(Path(args.out), NAME, data, _table(rows, modes, replay.floor is not None))
    png = plot_path(args, NAME)
    _plot(png, rows, modes, replay.floor is not None)
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    for key, value in summary.items():
        sys.stdout.write(f"{key}: {value}\n")
    return 0


# -- the workload ---------------------------------------------------------------------------
def user_token_targets(turns: int, answer_tokens: int) -> list[int]:
    """New user tokens per turn so that prompts follow TARGET_CONTEXT when answers are
    `answer_tokens` long (turn 1 also carries the system message, about 12 tokens)."""
    out = [TARGET_CONTEXT[0] - 12 - 2 * TEMPLATE_TOKENS]
    for k in range(1, turns):
        grow = TARGET_CONTEXT[k] - TARGET_CONTEXT[k - 1]
        out.append(max(8, grow - answer_tokens - 2 * TEMPLATE_TOKENS))
    return out


def user_message(rng: random.Random, tokens: int, tokenizer: Any | None) -> str:
    """A deterministic user message of about `tokens` tokens."""
    if tokenizer is None:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens * 0.75))))
    words: list[str] = []
    while True:
        words.append(rng.choice(WORDS))
        if len(tokenizer.encode(" ".join(words), add_special_tokens=False)) >= tokens:
            return " ".join(words)


# -- the stack ------------------------------------------------------------------------------
@contextmanager
def _stack(args: argparse.Namespace, model: Path | None) -> Iterator[tuple[str, threading.Event]]:
    """`args.url`, or a `ctxcache serve` of our own on a free port, stopped at the end;
    with the event Ctrl-C sets (the supervisor owns SIGINT while the stack runs)."""
    if args.url:
        yield args.url.rstrip("/"), threading.Event()
        return
    from ctxcache.net import free_port
    from ctxcache.supervisor import Child, Supervisor, http_ready

    assert model is not None
    port = free_port()
    with (
        tempfile.TemporaryDirectory(prefix="ctxcache-multiturn-") as data,
        open(Path(data) / "serve.log", "w") as log_file,
        Supervisor(out=log_file) as sup,
    ):
        sup.start(
            Child(
                "serve",
                [
                    *(sys.executable, "-m", "ctxcache.cli", "serve", "--port", str(port)),
                    *("--data-dir", data, "--model", str(model), "--engine", "builtin"),
                ],
                ready=http_ready(f"http://127.0.0.1:{port}/ready"),
                env={"CTX_WORKER_THREADS": str(args.threads)},
                startup_timeout=600,
            )
        )
        yield f"http://127.0.0.1:{port}", sup.stopping


# -- the replay -----------------------------------------------------------------------------
@dataclass
class Conversation:
    index: int
    users: list[str]
    messages: dict[str, list[dict[str, str]]] = field(default_factory=dict)  # per mode
    session_id: str | None = None


class Replay:
    def __init__(
        self, args: argparse.Namespace, url: str, modes: list[str], model: Path | None
    ) -> None:
        import httpx

        self.args, self.modes = args, modes
        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        headers["content-type"] = "application/json"
        self.http = httpx.Client(base_url=url, headers=headers, timeout=600)
        self.model = args.model_name or self._first_model()
        self.floor = Floor(model, args.threads) if model is not None and not args.no_floor else None
        tokenizer = self.floor.tokenizer if self.floor else _tokenizer(model)
        targets = user_token_targets(args.turns, args.answer_tokens)
        self.conversations = []
        for c in range(args.conversations):
            rng = random.Random(args.seed * 1_000_003 + c)
            users = [user_message(rng, n, tokenizer) for n in targets]
            self.conversations.append(Conversation(c, users))
        self.log: list[dict[str, Any]] = []  # one row per request
        self.run_id = uuid.uuid4().hex[:12]

    def _first_model(self) -> str:
        r = self.http.get("/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])

    def run(self, stopping: threading.Event) -> list[dict[str, Any]]:
        from tqdm import tqdm

        args = self.args
        total = args.conversations * args.turns * (len(self.modes) + (self.floor is not None))
        with tqdm(total=total, desc="multiturn replay", unit="turn") as bar:
            for conv in self.conversations:
                for mode in self.modes:
                    conv.messages[mode] = [{"role": "system", "content": SYSTEM}]
                if "session" in self.modes:
                    conv.session_id = self._create(conv)
            for turn in range(args.turns):
                for conv in self.conversations:
                    if stopping.is_set():
                        raise KeyboardInterrupt
                    order = self.modes if (turn + conv.index) % 2 == 0 else self.modes[::-1]
                    answers: dict[str, str] = {}
                    for mode in order:
                        time.sleep(args.think_time)
                        answers[mode] = self._turn(conv, turn, mode)
                        bar.update(1)
                    if self.floor is not None:
                        self._floor_turn(conv, turn, answers)
                        bar.update(1)
            for conv in self.conversations:
                if conv.session_id:
                    self.http.delete(f"/v1/context/{conv.session_id}")
        return self._rows()

    def _create(self, conv: Conversation) -> str:
        body = {
            "model": self.model,
            "messages": [{"role": "system", "content": SYSTEM}],
            "max_tokens": 0,
            "ttl": 3600,
        }
        r = self.http.post("/v1/context", content=_dumps(body))
        if r.status_code == 404 and "session_not_found" not in r.text:
            raise SystemExit(f"{self.http.base_url} has no /v1/context: run with --modes full")
        r.raise_for_status()
        return str(r.json()["session_id"])

    def _turn(self, conv: Conversation, turn: int, mode: str) -> str:
        user = {"role": "user", "content": conv.users[turn]}
        history = conv.messages[mode]
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.args.answer_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if mode == "session":
            body["messages"] = [user]
            body["session_id"] = conv.session_id
        else:
            body["messages"] = [*history, user]
            # salts keep the modes from warming each other's prefix cache: `full` reuses
            # nothing, `full-apc` only what its own earlier turns of this conversation left
            salt = uuid.uuid4().hex if mode == "full" else f"{self.run_id}-{conv.index}"
            body["cache_salt"] = f"multiturn-{salt}"
        data = _dumps(body)
        text, ttft, total, usage = self._stream(data)
        history += [user, {"role": "assistant", "content": text}]
        prompt = int(usage.get("prompt_tokens") or 0)
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.log.append(
            {
                "conversation": conv.index,
                "turn": turn + 1,
                "mode": mode,
                "ttft_ms": ttft * 1e3,
                "total_ms": total * 1e3,
                "request_bytes": len(data),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "completion_tokens": int(usage.get("completion_tokens") or 0),
                "answer": text,
            }
        )
        return text

    def _stream(self, data: bytes) -> tuple[str, float, float, dict[str, Any]]:
        import orjson

        parts: list[str] = []
        usage: dict[str, Any] = {}
        ttft = 0.0
        t0 = time.perf_counter()
        with self.http.stream("POST", "/v1/chat/completions", content=data) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece and not ttft:
                        ttft = time.perf_counter() - t0
                    parts.append(piece)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        total = time.perf_counter() - t0
        return "".join(parts), ttft or total, total, usage

    def _floor_turn(self, conv: Conversation, turn: int, answers: dict[str, str]) -> None:
        assert self.floor is not None
        mode = "session" if "session" in answers else next(iter(answers))
        prompt = conv.messages[mode][:-1]  # the history up to this turn's user message
        ttft, new, prompt_tokens = self.floor.turn(conv.index, prompt, answers[mode])
        self.log.append(
            {
                "conversation": conv.index,
                "turn": turn + 1,
                "mode": "floor",
                "ttft_ms": ttft * 1e3,
                "prompt_tokens": prompt_tokens,
                "cached_tokens": prompt_tokens - new,
            }
        )

    # -- aggregation --------------------------------------------------------------------
    def _rows(self) -> list[dict[str, Any]]:
        modes = [*self.modes, *(["floor"] if self.floor else [])]
        rows = []
        for turn in range(1, self.args.turns + 1):
            row: dict[str, Any] = {"turn": turn}
            for mode in modes:
                rs = [r for r in self.log if r["turn"] == turn and r["mode"] == mode]
                ttfts = [r["ttft_ms"] for r in rs]
                prompt = sum(r["prompt_tokens"] for r in rs)
                row[mode] = {
                    "ttft_p50_ms": percentile(ttfts, 50),
                    "ttft_p90_ms": percentile(ttfts, 90),
                    "prompt_tokens": prompt / len(rs),
                    "cached_ratio": sum(r["cached_tokens"] for r in rs) / prompt if prompt else 0,
                }
                if mode != "floor":
                    row[mode]["total_p50_ms"] = percentile([r["total_ms"] for r in rs], 50)
                    row[mode]["request_bytes"] = sum(r["request_bytes"] for r in rs) / len(rs)
            base = row.get("full", {}).get("ttft_p50_ms")
            for mode in modes:
                if base and mode != "full":
                    row[mode]["speedup_vs_full"] = base / row[mode]["ttft_p50_ms"]
            if "session" in row and "floor" in row:
                floor = row["floor"]["ttft_p50_ms"]
                row["session_vs_floor"] = row["session"]["ttft_p50_ms"] / floor
            answers: dict[int, set[str]] = {}
            for r in self.log:
                if r["turn"] == turn and r["mode"] != "floor":
                    answers.setdefault(r["conversation"], set()).add(r["answer"])
            row["identical_outputs"] = all(len(a) == 1 for a in answers.values())
            rows.append(row)
        return rows


def _summary(rows: list[dict[str, Any]], modes: list[str], floor: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "identical_outputs_every_turn": all(r["identical_outputs"] for r in rows)
    }
    last = rows[-1]
    if "session" in modes:
        sizes = [r["session"]["request_bytes"] for r in rows]
        out["session_bytes_last_over_first"] = sizes[-1] / sizes[0]
    if "full" in modes:
        sizes = [r["full"]["request_bytes"] for r in rows]
        out["full_bytes_last_over_first"] = sizes[-1] / sizes[0]
    if "session" in modes and "full" in modes:
        out["session_speedup_last_turn"] = last["session"]["speedup_vs_full"]
    if floor and "session" in modes:
        out["session_vs_floor_max"] = max(r["session_vs_floor"] for r in rows)
        if "full" in modes:
            out["floor_speedup_last_turn"] = last["floor"]["speedup_vs_full"]
    return out


def _table(rows: list[dict[str, Any]], modes: list[str], floor: bool) -> str:
    headers = ["turn", "prompt tokens"]
    for mode in modes:
        headers += [f"{mode} TTFT p50 / p90 ms", f"{mode} total p50 ms", f"{mode} bytes"]
        headers += [f"{mode} cached"]
    if floor:
        headers += ["floor TTFT p50 ms"]
    if "session" in modes and floor:
        headers += ["session / floor"]
    if "session" in modes and "full" in modes:
        headers += ["speedup (full / session)"]
    headers += ["identical"]
    out = []
    for r in rows:
        first = r[modes[0]]
        line: list[object] = [r["turn"], round(first["prompt_tokens"])]
        for mode in modes:
            m = r[mode]
            line += [f"{m['ttft_p50_ms']:,.0f} / {m['ttft_p90_ms']:,.0f}"]
            line += [round(m["total_p50_ms"]), round(m["request_bytes"])]
            line += [f"{m['cached_ratio']:.0%}"]
        if floor:
            line += [round(r["floor"]["ttft_p50_ms"])]
        if "session" in modes and floor:
            line += [f"{r['session_vs_floor']:.2f}×"]
        if "session" in modes and "full" in modes:
            line += [f"{r['session']['speedup_vs_full']:.2f}×"]
        line += ["yes" if r["identical_outputs"] else "**no**"]
        out.append(line)
    return markdown_table(headers, out)


def _plot(path: Path, rows: list[dict[str, Any]], modes: list[str], floor: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in [*modes, *(["floor"] if floor else [])]:
        left.plot(turns, [r[mode]["ttft_p50_ms"] for r in rows], marker="o", label=mode)
    left.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="time to first token")
    for mode in modes:
        right.plot(turns, [r[mode]["request_bytes"] / 1024 for r in rows], marker="o", label=mode)
    right.set(xlabel="turn", ylabel="KiB per request", title="request bytes sent")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the floor ------------------------------------------------------------------------------
class Floor:
    """The model in this process, each conversation's KV kept in memory: a turn prefills
    only the tokens that are new since the KV was computed."""

    def __init__(self, model: Path, threads: int) -> None:
        from worker.engine.runner import ModelRunner

        self.runner = ModelRunner(str(model), threads=threads)
        self.tokenizer = self.runner.tokenizer
        self.runner.prefill(list(range(1, 65)), None)  # warm up: the first call is slow
        self.kv: dict[int, tuple[list[int], Any]] = {}  # conversation -> (ids, KV of ids)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def turn(
        self, conv: int, messages: list[dict[str, str]], answer: str
    ) -> tuple[float, int, int]:
        """TTFT of this turn (prefill of the new tokens + the first greedy token), the
        number of tokens prefilled, the prompt's length. Then, untimed, the answer's KV is
        added, as decoding it would have."""
        import torch

        from worker.engine.runner import kv_of_row

        ids = self.render(messages)
        known, kv = self.kv.get(conv, ([], None))
        common = 0
        for a, b in zip(known, ids[:-1], strict=False):
            if a != b:
                break
            common += 1
        prefix = kv[:, :, :, :common] if kv is not None and common else None
        # One prefill, as an engine makes one per turn. (Repeating it and keeping the
        # median flatters the floor: the second run of the same prefill finds caches warm,
        # 20-30% faster here.)
        t0 = time.perf_counter()
        logits, cache = self.runner.prefill(ids, prefix)
        int(torch.argmax(logits))
        ttft = time.perf_counter() - t0
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False)
        full = ids + answer_ids
        if answer_ids:
            _, cache = self.runner.prefill(full, kv_of_row(cache, 0, 0))
        self.kv[conv] = (full, kv_of_row(cache, 0, 0))
        return ttft, len(ids) - common, len(ids)


def _tokenizer(model: Path | None) -> Any | None:
    if model is None or not (model / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def _dumps(body: dict[str, Any]) -> bytes:
    import orjson

    return orjson.dumps(body)
