"""`ctxcache bench kvpath`: how fast a session's KV gets into (and out of) the engine's cache.

Through the vLLM connector's own worker code (`vllm_connector.worker.WorkerSide`, no vLLM
needed: the caches are random tensors in a paged layout and the layout probe runs on a
plain-torch cache write), for each KV shape and each data path:
- **tcp**: lm:// to the sidecar, LMCache's `KV_2LTD` payload, scattered into the blocks;
- **shm**: the sidecar's shared region, leases over its Unix socket, the engine's own
  block layout, block copies.
Each round times, back to back: a plain copy of the same bytes (on CUDA: a pinned
host-to-device copy for loads, device-to-host for stores), the store, the load, and for
tcp the GETs alone (`--dtype bfloat16,fp8`: each KV dtype a case of its own; an fp8 cache
is vLLM's uint8 bytes written by its fp8 cache write, `vllm_connector.kvdtype`, half of
bf16's bytes per token). Ratios are paired per round (the same round's copy), medians over the
rounds. The sidecar runs in its own process, as it does beside an engine. Every load is
checked once against the blocks it was stored from.

On CUDA each shm row also reports (`--block-tokens 16,128` by default: each kernel block
size is a case of its own): the copies' GPU time from CUDA events (the copier's ring
records timing events; from just before the copies are issued to the handle's event) ÷ the
GPU time of a pinned host<->device copy of the same bytes, the wall time split into lease
(or alloc), copies and release (or commit), and the peak device memory a load or store
took beyond what was allocated before it (`torch.cuda.max_memory_allocated`), beside the
ring's size (`device_bytes`): a bounded copier keeps the first within the second.

Here: the shapes, the sidecar process and one case's rounds. The CUDA probe is
`benchmarks.kvpath.kvpath_cuda`; the rows, tables and plot are `benchmarks.kvpath.kvpath_report`.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.kvpath.kvpath_cuda import CudaProbe
from benchmarks.kvpath.kvpath_mla import latent_cache_and_writer
from benchmarks.kvpath.kvpath_report import cuda_markdown as cuda_markdown  # (re-exported)
from benchmarks.kvpath.kvpath_report import markdown, plot, rows_of

if TYPE_CHECKING:
    import torch

    from vllm_connector.worker import WorkerSide


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    latent: bool = False  # an MLA model's cache: one latent of `head_dim` channels, no V

    def bytes_per_token(self, itemsize: int) -> int:
        return (1 if self.latent else 2) * self.layers * self.kv_heads * self.head_dim * itemsize


SHAPES = {
    "small": Shape("small preset", 12, 4, 64, 4096),
    "llama3-8b": Shape("Llama-3-8B", 32, 8, 128, 2048),
    "llama3-70b-tp8": Shape("Llama-3-70B per GPU (TP 8)", 80, 1, 128, 2048),
    # MLA (kv_lora_rank 512 + rope 64) beside full attention of about the same size
    "deepseek-v2-lite": Shape("DeepSeek-V2-Lite (MLA)", 27, 1, 576, 2048, latent=True),
    "qwen2.5-14b": Shape("Qwen2.5-14B (full attention)", 48, 8, 128, 2048),
    "deepseek-v3": Shape("DeepSeek-V3 / Kimi K2 (MLA)", 61, 1, 576, 2048, latent=True),
}
DEFAULT_SHAPES = ("small", "llama3-8b", "llama3-70b-tp8")
PATHS = ("tcp", "shm")
KV_DTYPES = ("bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")
CHUNK = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments

    add_output_arguments(parser, "kvpath")
    a = parser.add_argument
    a(
        "--shapes",
        default=",".join(DEFAULT_SHAPES),
        help=f"comma list of {', '.join(SHAPES)} (MLA: deepseek-*)",
    )
    a("--paths", default=",".join(PATHS), help="comma list of tcp, shm")
    a(
        "--dtype",
        default="bfloat16",
        help=f"KV dtypes, a comma list of {', '.join(KV_DTYPES)} (fp8: vLLM's "
        "--kv-cache-dtype names; its K/V written from bfloat16)",
    )
    a("--device", default="cpu", help="where the KV cache lives: cpu or cuda")
    a("--rounds", type=int, default=5, help="timed rounds (the median is reported)")
    a("--tokens", type=int, default=None, help="tokens per case (default: per shape)")
    a(
        "--block-tokens",
        default=None,
        help="tokens per kernel block, a comma list: each is a case (default: 128 on cpu as "
        "vLLM's CPU backend, 16 for its MLA shapes as vLLM's CPU MLA; 16,128 on cuda)",
    )
    a(
        "--state",
        default=None,
        help="a hybrid model's recurrent-state block instead of KV, a comma list of "
        "tiny-hybrid, qwen3-next-80b, qwen3-next-80b-tp4 (benchmarks/kvpath/kvpath_state.py)",
    )
    a(
        "--engine",
        choices=("none", "vllm"),
        default="none",
        help="vllm: a cold session turn's TTFT beside a hot one's on real vLLM "
        "(benchmarks/kvpath/kvpath_vllm.py)",
    )
    from benchmarks.kvpath.kvpath_vllm import add_arguments as add_vllm_arguments

    add_vllm_arguments(parser)


def main(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from benchmarks.kvpath.kvpath_vllm import run

        return run(args)
    if args.state:
        from benchmarks.kvpath.kvpath_state import run as run_state

        return run_state(args)
    import torch
    from tqdm import tqdm

    from benchmarks.lib.util import plot_path, run_meta, write_outputs
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    shapes = [SHAPES[s] for s in args.shapes.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    dtypes = [d for d in args.dtype.split(",") if d]
    if not dtypes or any(d not in KV_DTYPES for d in dtypes):
        raise SystemExit(f"--dtype {args.dtype!r}: a comma list of {', '.join(KV_DTYPES)}")
    device = torch.device(args.device)
    sizes = block_sizes(args.block_tokens, device)
    meta = run_meta(
        "kvpath",
        shapes=[s.name for s in shapes],
        paths=paths,
        dtype=args.dtype,
        device=args.device,
        device_name=torch.cuda.get_device_name() if device.type == "cuda" else None,
        rounds=args.rounds,
        block_tokens=sizes[0] if len(sizes) == 1 else sizes,
        chunk_tokens=CHUNK,
    )
    rows: list[dict[str, Any]] = []
    widest = max(torch_dtype(d).itemsize for d in dtypes)
    with start_sidecar(max(_case_bytes(s, args.tokens, widest) for s in shapes)) as (url, local):
        cases = []
        for shape in shapes:
            mla_cpu = shape.latent and device.type == "cpu" and args.block_tokens is None
            # (vLLM's CPU MLA runs 16-token blocks only, and only an unquantised latent)
            kinds = [d for d in dtypes if torch_dtype(d).itemsize > 1] if shape.latent else dtypes
            cases += [(shape, n, d) for n in ([16] if mla_cpu else sizes) for d in kinds]
        bar = tqdm(total=len(cases) * len(paths) * args.rounds, desc="kvpath", unit="round")
        for shape, n, kv_dtype in cases:
            tokens = args.tokens or shape.tokens
            for path in paths:
                rows += run_case(
                    shape, tokens, path, kv_dtype, device, n, args.rounds, url, local, bar
                )
        bar.close()
    data = {"meta": meta, "results": rows}
    write_outputs(Path(args.out), "kvpath", data, markdown(rows, meta))
    plot(rows, plot_path(args, "kvpath"), meta)
    return 0


def block_sizes(arg: str | None, device: torch.device) -> list[int]:
    """`--block-tokens` as a list (the default per device: see its help)."""
    if arg is None:
        return [16, 128] if device.type == "cuda" else [128]
    sizes = [int(v) for v in arg.split(",") if v.strip()]
    if not sizes or min(sizes) <= 0:
        raise SystemExit(f"--block-tokens {arg!r}: positive integers, comma-separated")
    return sizes


def torch_dtype(kv_dtype: str) -> torch.dtype:
    """A `--dtype` name as the torch dtype the connector moves (fp8: its float8 view)."""
    import torch

    from vllm_connector.kvdtype import FP8_CACHE_DTYPES

    return FP8_CACHE_DTYPES.get(kv_dtype) or getattr(torch, kv_dtype)


def _case_bytes(shape: Shape, tokens: int | None, itemsize: int) -> int:
    return shape.bytes_per_token(itemsize) * (tokens or shape.tokens)


def shm_tempdir() -> tempfile.TemporaryDirectory[str]:
    """A private directory for a sidecar's `--local-dir`: in /dev/shm (memory, as in
    production) where it is writable, else in the default temporary directory."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return tempfile.TemporaryDirectory(prefix="ctxcache-kvpath-", dir=base)


# ---- the sidecar, in its own process ----------------------------------------------------
_SIDECAR = """
import sys, threading
from pathlib import Path
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
s = Sidecar(SidecarSettings(port=0, memory_bytes=int(sys.argv[1]), local_dir=Path(sys.argv[2])))
s.start()
print(s.port, flush=True)
sys.stdin.read()
s.stop()
"""


@contextmanager
def start_sidecar(case_bytes: int) -> Iterator[tuple[str, str]]:
    """A sidecar process with room for two paths' copies of the largest case."""
    with shm_tempdir() as local:
        memory = 3 * case_bytes + (64 << 20)
        proc = subprocess.Popen(
            [sys.executable, "-c", _SIDECAR, str(memory), local],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.strip().isdigit():
                raise RuntimeError(f"the sidecar did not start (exit {proc.wait()}); see above")
            port = int(line)
            yield f"lm://127.0.0.1:{port}", local
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- one case -----------------------------------------------------------------------------
def flash_cache(blocks: int, n: int, shape: Shape, dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
    """FlashAttention's cache: storage `[blocks, N, H, 2*D]`, vLLM's view `[blocks, H, N, 2*D]`."""
    import torch

    storage = torch.empty(blocks, n, shape.kv_heads, 2 * shape.head_dim, dtype=dtype, device=device)
    return storage.transpose(1, 2)


def flash_writer(n: int, head_dim: int) -> Callable[..., None]:
    def write(k: Any, v: Any, cache: Any, slots: Any) -> None:
        key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
        blocks, within = slots // n, slots % n
        key_cache[blocks, within] = k
        value_cache[blocks, within] = v

    return write


def cpu_cache_and_writer(
    blocks: int, n: int, shape: Shape, dtype: torch.dtype, kv_dtype: str = "auto"
) -> tuple[Any, Callable[..., None], str]:
    """vLLM's CPU cache and its real cache write where vLLM is installed, else FlashAttention's
    (`kv_dtype` fp8: vLLM's fp8 cache as the connector sees it, which needs vLLM)."""
    import torch

    if kv_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return fp8_cache_and_writer(blocks, n, shape, kv_dtype)
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # type: ignore[attr-defined]
    except Exception:
        return (
            flash_cache(blocks, n, shape, dtype, torch.device("cpu")),
            flash_writer(n, shape.head_dim),
            "flash (vLLM not installed)",
        )
    isa = _get_attn_isa(dtype, n, shape.head_dim)

    def write(k: Any, v: Any, cache: Any, slots: Any) -> None:
        b, h, t, _ = cache.shape
        key_cache, value_cache = cache.view(b, h, t * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    cache = torch.empty(blocks, shape.kv_heads, n, 2 * shape.head_dim, dtype=dtype)
    return cache, write, f"vLLM CPU ({isa})"


def fp8_cache_and_writer(
    blocks: int, n: int, shape: Shape, kv_dtype: str
) -> tuple[Any, Callable[..., None], str]:
    """vLLM's CPU fp8 cache (uint8, seen as float8) and its fp8 cache write (scales 1.0,
    K/V from bfloat16), as the connector registers them."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # type: ignore[attr-defined]

    from vllm_connector.kvdtype import FP8_CACHE_DTYPES, cache_views, probe_writer

    isa = _get_attn_isa(torch.bfloat16, n, shape.head_dim, kv_dtype)

    def write(k: Any, v: Any, cache: Any, slots: Any) -> None:
        b, h, t, _ = cache.shape
        key_cache, value_cache = cache.view(b, h, t * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            k, v, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_dtype
        )

    raw = torch.empty(blocks, shape.kv_heads, n, 2 * shape.head_dim, dtype=torch.uint8)
    cache = cache_views({"c": raw}, FP8_CACHE_DTYPES[kv_dtype])["c"]
    return cache, probe_writer(write, torch.bfloat16), f"vLLM CPU {kv_dtype} ({isa})"


def run_case(
    shape: Shape,
    tokens: int,
    path: str,
    kv_dtype: str,
    device: torch.device,
    n: int,
    rounds: int,
    url: str,
    local: str,
    bar: Any,
) -> list[dict[str, Any]]:
    import torch

    from vllm_connector.config import ConnectorConfig
    from vllm_connector.plan import LoadSpec, Piece, StoreSpec
    from vllm_connector.scheduler import StepPlan
    from vllm_connector.worker import WorkerSide

    dtype = torch_dtype(kv_dtype)
    if dtype.itemsize == 1 and device.type != "cpu":
        raise SystemExit("--dtype fp8: vLLM's CPU fp8 cache write, on --device cpu only")
    per_req = math.ceil(tokens / n)
    blocks = 2 * per_req + 1
    caches, writers = {}, {}
    for layer in range(shape.layers):
        if shape.latent:
            cache, write, layout = latent_cache_and_writer(blocks, n, shape.head_dim, dtype, device)
        elif device.type == "cuda":
            cache, write, layout = (
                flash_cache(blocks, n, shape, dtype, device),
                flash_writer(n, shape.head_dim),
                "flash",
            )
        else:
            cache, write, layout = cpu_cache_and_writer(blocks, n, shape, dtype, kv_dtype)
        cache.copy_(torch.randn(cache.shape, device=device).to(dtype))
        caches[f"layer.{layer}"] = cache
        writers[f"layer.{layer}"] = (write, shape.kv_heads, shape.head_dim)
    config = ConnectorConfig(
        sidecar_url=url, local_dir=local if path == "shm" else None, chunk_size=CHUNK
    )
    side = WorkerSide(config, n, latent=shape.latent)
    side.register(caches, writers)
    assert side.enabled, "the connector did not start"
    perm = torch.randperm(blocks - 1).tolist()  # blocks in random order, as a paged cache has
    src_ids, dst_ids = perm[:per_req], perm[per_req : 2 * per_req]
    nbytes = shape.bytes_per_token(dtype.itemsize) * tokens
    copy_load, copy_store = plain_copies(nbytes, device)
    samples: dict[str, list[float]] = {
        k: [] for k in ("copy_load", "copy_store", "store", "load", "get")
    }
    # (CUDA, shm: the path whose copies go through the copier's ring)
    probe = CudaProbe(side, nbytes, device) if device.type == "cuda" and path == "shm" else None
    try:
        for r in range(rounds):
            pieces = [
                Piece(f"bench@1@0@{path}{r}x{i:x}@{kv_dtype}", i, min(CHUNK, tokens - i))
                for i in range(0, tokens, CHUNK)
            ]
            samples["copy_store"].append(timed(copy_store, device))
            store = StepPlan(stores=[StoreSpec(f"s{r}", "bench", pieces, src_ids)])
            if probe is not None:
                probe.start()
            samples["store"].append(timed(partial(_store, side, store), device))
            if probe is not None:
                probe.stop("store")
            samples["copy_load"].append(timed(copy_load, device))
            for cache, lay in zip(side.caches, side.layouts, strict=True):
                lay.blocks_view(cache)[dst_ids] = 0  # whatever was there must not help
            load = StepPlan(loads=[LoadSpec(f"l{r}", 0, tokens, pieces, dst_ids)])
            if probe is not None:
                probe.start()
            samples["load"].append(timed(partial(side.load, load), device))
            if probe is not None:
                probe.stop("load")
            invalid = side.take_invalid()
            assert not invalid, f"{path}: blocks failed to load: {sorted(invalid)}"
            if r == 0:
                check_equal(side, src_ids, dst_ids, tokens, n)
            if path == "tcp" and side.sidecar is not None:
                keys = [(p.key, p.length) for p in pieces]
                samples["get"].append(timed(partial(side.sidecar.get_many, keys), device))
            bar.update(1)
        counters = side.counters.drain()
    finally:
        side.close()
    rows = rows_of(shape, tokens, path, layout, nbytes, samples, counters)
    for row in rows:
        row["block_tokens"] = n
        row["dtype"] = kv_dtype
        row["bytes_per_token"] = nbytes // tokens
        if probe is not None and row["op"] in probe.samples:
            row.update(probe.summary(row["op"]))
    return rows


def _store(side: WorkerSide, plan: Any) -> None:
    """A store until the sidecar has it: on CUDA `save` leaves a shared-memory store's
    commit to a later step (`WorkerSide.settle`), which the timed store waits for here."""
    side.save(plan)
    side.settle(wait=True)
    side.take_sent()
    if side.sidecar is not None:
        side.sidecar.drain()  # tcp: PUTs have no reply; until the sidecar has them


def plain_copies(
    nbytes: int, device: torch.device
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The copies a load and a store are measured against: the same bytes, host to host on
    CPU; pinned host to device (load) and device to pinned host (store) on CUDA."""
    import torch

    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return (lambda: dev.copy_(host, non_blocking=True)), (
            lambda: host.copy_(dev, non_blocking=True)
        )
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    b = torch.empty_like(a)
    return (lambda: b.copy_(a)), (lambda: a.copy_(b))


def timed(fn: Callable[[], object], device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def check_equal(side: WorkerSide, src: list[int], dst: list[int], tokens: int, n: int) -> None:
    """The loaded blocks hold exactly the stored ones' KV (a partial last block: its tokens)."""
    import torch

    from vllm_connector.layout import gather, token_slots

    a = gather(side.caches, side.layouts, token_slots(src, n, n, 0, tokens))
    b = gather(side.caches, side.layouts, token_slots(dst, n, n, 0, tokens))
    if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):  # (bytes: fp8 too)
        raise AssertionError("the loaded KV differs from the stored KV")
