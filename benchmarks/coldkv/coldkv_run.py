"""The cold-KV benchmark's measurements (`benchmarks.coldkv.coldkv` has what and why)."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

CASES = ("plain-memory", "fp8-memory", "plain-disk", "fp8-disk")


class Sidecars:
    """Four `ctxcache sidecar` processes: plain / fp8, blocks in memory / on disk only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, Any] = {}
        self.urls: dict[str, tuple[str, int, int]] = {}  # case -> host, data, control port

    def __enter__(self) -> Sidecars:
        from benchmarks.lib.process import Process
        from benchmarks.lib.stack import sidecar_service

        try:
            for case in CASES:
                mode, tier = case.split("-")
                args = ["--cold-kv", "fp8" if mode == "fp8" else "off"]
                if tier == "disk":  # every block larger than memory: straight to disk
                    data_dir = self.root / case
                    args += ["--data-dir", str(data_dir), "--memory-bytes", "1"]
                    args += ["--disk-bytes", str(64 << 30)]
                else:
                    args += ["--memory-bytes", str(16 << 30)]
                service, port = sidecar_service(args=args, name=case)
                proc = Process(service.argv, port=service.port, startup_timeout=60)
                self.procs[case] = proc.start()
                self.urls[case] = ("127.0.0.1", port, service.port)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            proc.stop()

    def session_bytes(self, case: str, session: str) -> int:
        import httpx

        _host, _data, control = self.urls[case]
        r = httpx.get(f"http://127.0.0.1:{control}/sessions/{session}", timeout=10)
        r.raise_for_status()
        return int(r.json()["bytes"])


def _chunks(kv: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [kv[:, :, :, a : a + size] for a in range(0, kv.shape[3], size)]


def _logprobs(runner: Any, prefix: torch.Tensor, ids: list[int], n: int, force: list[int] | None):
    """Greedy (or `force`d) tokens after `ids` from KV `prefix` of `ids[:P]`, with the
    log-softmax at each of the `n` steps (`[n, vocab]`)."""
    logits, cache = runner.prefill(ids, prefix)
    tokens, rows = [], []
    pos = len(ids)
    for step in range(n):
        lp = torch.log_softmax(logits.float(), dim=-1)
        rows.append(lp)
        token = force[step] if force is not None else int(torch.argmax(lp))
        tokens.append(token)
        if step + 1 < n:
            logits = runner.decode(cache, [token], [pos], None)[0]
            pos += 1
    return tokens, torch.stack(rows)


def _compare(base: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Per-step log-softmax rows of the same tokens: |Δ| over the vocabulary, KL, top-1."""
    finite = torch.isfinite(base) & torch.isfinite(other)
    diff = (base - other).abs().where(finite, torch.zeros_like(base))
    p = base.exp()
    kl = (p * (base - other)).where(finite, torch.zeros_like(base)).sum(dim=-1)
    return {
        "max_abs_dlogprob": float(diff.max()),
        "mean_abs_dlogprob": float(diff.sum() / finite.sum()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agree": float((base.argmax(-1) == other.argmax(-1)).float().mean()),
    }


def _token_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Mean over tokens of |got - want| / |want| (L2 over layers, K/V, heads, head dims)."""
    diff = (got.float() - want.float()).transpose(0, 3).reshape(want.shape[3], -1)
    ref = want.float().transpose(0, 3).reshape(want.shape[3], -1)
    return float((diff.norm(dim=1) / ref.norm(dim=1)).mean())


def _greedy(base: torch.Tensor, forced: torch.Tensor) -> dict[str, float]:
    """Greedy answers compared without running the other one: fed the plain answer's
    tokens, a run picks the same greedy tokens exactly up to the first step whose argmax
    differs (its inputs are the same until then), so that step is where they part."""
    agree = (base.argmax(-1) == forced.argmax(-1)).tolist()
    same = agree.index(False) if False in agree else len(agree)
    return {"greedy_prefix": float(same), "greedy_exact": float(same == len(agree))}


def _repacked(kv: torch.Tensor, shape: Any, chunk: int, granularity: str) -> torch.Tensor:
    """The KV as a sidecar with per-`granularity` scales would hand it back (packed here)."""
    from sidecar import coldkv
    from sidecar.blocks import BlockMeta
    from sidecar.protocol import FMT_KV_2LTD

    parts = []
    for piece in _chunks(kv, chunk):
        tokens = piece.shape[3]
        wire = shape.to_wire(piece)
        meta = BlockMeta("k", len(wire), FMT_KV_2LTD, shape.dtype_code, shape.wire_shape(tokens))
        packed = coldkv.pack(meta, wire, granularity)  # type: ignore[arg-type]
        assert packed is not None
        back = shape.from_wire(
            bytearray(coldkv.unpack(meta, packed)), FMT_KV_2LTD, meta.dtype, meta.shape, tokens
        )
        parts.append(back)
    return torch.cat(parts, dim=3)


def run_dtype(args: argparse.Namespace, dtype: str, sidecars: Sidecars) -> dict[str, Any]:
    from tqdm import tqdm

    from sidecar.client import KVClient
    from worker.engine.runner import ModelRunner, kv_of_row
    from worker.kv.layout import FMT_KV_2LTD, TORCH_TO_KEY_NAME

    runner = ModelRunner(str(args.model), dtype)
    shape = runner.kv_shape
    name = TORCH_TO_KEY_NAME[shape.dtype]
    clients = {c: KVClient(h, p, timeout=60) for c, (h, p, _ctl) in sidecars.urls.items()}
    gen = torch.Generator().manual_seed(57)
    allowed = torch.arange(runner.vocab_size)[3:]
    if runner.logit_mask is not None:
        allowed = allowed[~runner.logit_mask[3:]]

    def ids(n: int) -> list[int]:
        return allowed[torch.randint(0, len(allowed), (n,), generator=gen)].tolist()

    extra = ["fp8-chunk", *(["bf16-rounded"] if shape.dtype == torch.float32 else [])]
    per_case: dict[str, dict[str, list[float]]] = {c: {} for c in (*CASES, *extra)}
    margins: list[float] = []
    sanity_exact = True
    bar = tqdm(total=args.conversations, desc=f"cold-kv {dtype}", unit="conversation")
    try:
        for conv in range(args.conversations):
            history, turn = ids(args.context), ids(args.turn)
            session = f"coldkv-{name}-{conv}"
            with torch.inference_mode():
                _, cache = runner.prefill([*history, 0], None)
                kv = kv_of_row(cache, 0, 0, args.context).contiguous()
            keys = [
                f"coldkv@1@0@{conv * 4096 + i:x}@{name}@s%{session}"
                for i in range(len(_chunks(kv, args.chunk_size)))
            ]
            for client in clients.values():
                for key, piece in zip(keys, _chunks(kv, args.chunk_size), strict=True):
                    wire = shape.to_wire(piece)
                    client.put(
                        key,
                        wire,
                        fmt=FMT_KV_2LTD,
                        dtype=shape.dtype_code,
                        shape=shape.wire_shape(piece.shape[3]),
                    )
                assert client.exists(keys[-1])  # a barrier: every PUT before it is handled
            loaded: dict[str, torch.Tensor] = {}
            for case, client in clients.items():
                times = []
                for _ in range(args.reps):
                    start = time.perf_counter()
                    blocks = client.get_many(keys)
                    parts = []
                    for key, block in zip(keys, blocks, strict=True):
                        assert block is not None, f"{case}: {key} missed"
                        tokens = block.shape[2]
                        part = shape.from_wire(
                            block.data, block.fmt, block.dtype, block.shape, tokens
                        )
                        assert part is not None, f"{case}: {key} is not the worker's KV"
                        parts.append(part)
                    loaded[case] = torch.cat(parts, dim=3)
                    times.append(time.perf_counter() - start)
                stats = per_case[case]
                stats.setdefault("load_s", []).append(statistics.median(times))
                stats.setdefault("bytes", []).append(sidecars.session_bytes(case, session))
            copy_times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                kv.clone()
                copy_times.append(time.perf_counter() - start)
            per_case["plain-memory"].setdefault("copy_s", []).append(statistics.median(copy_times))
            loaded["fp8-chunk"] = _repacked(kv, shape, args.chunk_size, "chunk")
            # a reference for how much this model's answers move under any rounding of its
            # KV: fp32 KV rounded to bf16 (relative error <= 2^-9, 16x finer than fp8's)
            loaded["bf16-rounded"] = kv.to(torch.bfloat16).to(kv.dtype)
            sanity_exact &= bool(torch.equal(loaded["plain-memory"], kv))
            prompt = [*history, *turn]
            with torch.inference_mode():
                base_tokens, base_lp = _logprobs(runner, kv, prompt, args.answer, None)
                done: list[tuple[torch.Tensor, dict[str, float]]] = []
                top2 = base_lp.topk(2, dim=-1).values
                margins += (top2[:, 0] - top2[:, 1]).tolist()
                for case in (*CASES, *extra):
                    got = loaded[case]
                    # the same KV as a case already run (the disk tiers' are the memory
                    # tiers' bytes): the same answer, the model is not run again
                    found = next((r for kv_seen, r in done if torch.equal(kv_seen, got)), None)
                    if found is None:
                        _, forced = _logprobs(runner, got, prompt, args.answer, base_tokens)
                        found = _compare(base_lp, forced)
                        found |= _greedy(base_lp, forced)
                        found["kv_rel_err"] = _token_rel_err(got, kv)
                        done.append((got, found))
                    for k, v in found.items():
                        per_case[case].setdefault(k, []).append(v)
            bar.update()
    finally:
        bar.close()
        for client in clients.values():
            client.close()
    return {
        "dtype": dtype,
        "kv_bytes_per_token": shape.bytes_per_token(),
        "plain_equals_recompute": sanity_exact,
        # how sure the model is of its greedy tokens: logprob of the top-1 less the top-2's
        "top1_margin_median": statistics.median(margins),
        "top1_margin_below_0_5": sum(m < 0.5 for m in margins) / len(margins),
        "cases": {case: _summary(stats) for case, stats in per_case.items()},
    }


def _summary(stats: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, values in stats.items():
        if k in ("max_abs_dlogprob", "kl_max"):
            out[k] = max(values)
        else:
            out[k] = statistics.mean(values)
        out[f"{k}_all"] = values
    return out
