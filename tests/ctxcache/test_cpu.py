"""vLLM's dtype chosen from the CPU (ctxcache/cpu.py): bfloat16 where the CPU has AMX or
AVX-512 BF16, float32 elsewhere, where bfloat16 is emulated and about 3x slower (issue 48);
`--dtype` overrides, and a `--dtype` among vLLM's own arguments wins over both. The CPU is
faked through its flags."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ctxcache import cpu
from ctxcache.cpu import choose_dtype, cpu_class, cpu_flags, given_dtype, vllm_dtype
from tests.utils import serve_hand_off

BASE = ["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "f16c", "fma", "bmi1", "bmi2"]
# an AVX2-only EPYC (Zen 2/3): no AVX-512, no AMX
AVX2_ONLY = frozenset([*BASE, "avx2"])
# AVX-512 without BF16 (Skylake-SP, Cascade Lake)
AVX512 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
# AVX-512 BF16 without AMX (Cooper Lake, Zen 4)
AVX512_BF16 = AVX512 | {"avx512_bf16"}
# Sapphire Rapids and later
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize(
    ("flags", "dtype", "cls"),
    [
        (AVX2_ONLY, "float32", "AVX2"),
        (AVX512, "float32", "AVX-512"),
        (AVX512_BF16, "bfloat16", "AVX-512 BF16"),
        (AMX, "bfloat16", "AMX"),
        (AVX2_ONLY | {"amx_tile"}, "bfloat16", "AMX"),
        (frozenset(), "float32", "other"),  # no flags known (not x86, not Linux)
    ],
    ids=["avx2", "avx512", "avx512_bf16", "amx", "amx_tile", "none"],
)
def test_the_cpu_chooses_the_dtype(flags: frozenset[str], dtype: str, cls: str) -> None:
    choice = choose_dtype(flags)
    assert choice.dtype == dtype and cpu_class(flags) == cls
    if dtype == "bfloat16":  # why: the flags it computes bfloat16 with
        assert "natively" in choice.why
        assert all(f in choice.why for f in sorted(flags & cpu.BF16_FLAGS))
    else:
        assert "neither AMX nor avx512_bf16" in choice.why and "emulated" in choice.why


def test_dtype_asked_for_overrides_the_cpu_and_vllms_own_argument_wins() -> None:
    assert vllm_dtype("auto", [], AMX).dtype == "bfloat16"
    assert vllm_dtype("auto", [], AVX2_ONLY).dtype == "float32"
    for asked in ("bfloat16", "float32", "float16"):
        for flags in (AMX, AVX2_ONLY):
            choice = vllm_dtype(asked, ["--seed", "1"], flags)
            assert (choice.dtype, choice.why) == (asked, f"--dtype {asked}")
    for extra in (
        ["--dtype", "float16"],
        ["--dtype=float16"],
        ["--dtype=bfloat16", "--dtype=float16"],
    ):
        for asked in ("auto", "float32"):
            choice = vllm_dtype(asked, ["--max-num-seqs", "4", *extra], AMX)
            assert choice.dtype == "float16" and "arguments for vLLM" in choice.why
    assert given_dtype(["--dtype"]) is None  # (no value: vLLM's own parser says so)


def test_the_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    cores = [
        f"processor\t: {n}\nvendor_id\t: AuthenticAMD\nflags\t\t: {' '.join(sorted(AVX2_ONLY))}\n"
        for n in range(2)
    ]
    info.write_text("\n".join(cores))
    assert cpu_flags(info) == AVX2_ONLY
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # an ARM CPU: no x86 flags
    assert cpu_flags(info) == frozenset()
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="no /proc/cpuinfo")
def test_this_machine_is_one_of_the_classes() -> None:
    flags = cpu_flags()
    assert cpu_class(flags) in {"AMX", "AVX-512 BF16", "AVX-512", "AVX2", "other"}
    assert vllm_dtype().dtype == choose_dtype(flags).dtype


def launched(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], *line: str) -> list[str]:
    """What `ctxcache vllm <line>` hands vLLM on a CPU with `flags`."""
    import ctxcache.logs
    import ctxcache.vllm_engine as vllm_engine
    from ctxcache.cli import build_parser

    got: list[list[str]] = []
    monkeypatch.setattr(vllm_engine, "available", lambda: True)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(ctxcache.logs, "setup_logging", lambda *a, **k: None)  # (caplog's)
    monkeypatch.setattr(os, "execvpe", lambda _file, argv, _env: got.append(list(argv)))
    base = ["vllm", "--model", "/m/tiny", "--tool-call-parser", "none"]
    vllm_engine.main(build_parser().parse_args([*base, *line]))
    (argv,) = got
    return argv


def dtypes_in(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--dtype"] + [
        a.removeprefix("--dtype=") for a in argv if a.startswith("--dtype=")
    ]


@pytest.mark.parametrize(("flags", "dtype"), [(AVX2_ONLY, "float32"), (AMX, "bfloat16")])
def test_ctxcache_vllm_runs_vllm_in_the_cpus_dtype_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    flags: frozenset[str],
    dtype: str,
) -> None:
    caplog.set_level(logging.INFO, logger="ctxcache.vllm_engine")
    argv = launched(monkeypatch, flags, "--", "--enforce-eager")
    assert dtypes_in(argv) == [dtype]
    (line,) = [r.getMessage() for r in caplog.records if "computes in" in r.getMessage()]
    assert line == f"vLLM computes in {dtype}: {choose_dtype(flags).why}"


def test_ctxcache_vllm_takes_dtype_and_vllms_own_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dtypes_in(launched(monkeypatch, AMX, "--dtype", "float32")) == ["float32"]
    assert dtypes_in(launched(monkeypatch, AVX2_ONLY, "--dtype", "bfloat16")) == ["bfloat16"]
    # after `--`, vLLM's own: passed once, as given
    argv = launched(monkeypatch, AMX, "--dtype", "float32", "--", "--dtype=float16")
    assert dtypes_in(argv) == ["float16"] and argv[-1] == "--dtype=float16"


@pytest.mark.parametrize("asked", [None, "float32", "bfloat16"])
def test_serve_hands_its_dtype_to_ctxcache_vllm(asked: str | None) -> None:
    handed, argv, builtin = serve_hand_off([] if asked is None else ["--dtype", asked])
    assert handed.dtype == (asked or "auto")
    assert argv[-2:] == ["--", "--seed=1"]  # vLLM's own arguments stay last
    assert "--dtype" not in builtin  # (the built-in worker has its own --dtype, float32)


def test_the_launch_carries_its_dtype() -> None:
    from ctxcache.vllm_engine import VllmLaunch

    assert dtypes_in(VllmLaunch("m", "m", 8100, dtype="float32").argv()) == ["float32"]
    assert dtypes_in(VllmLaunch("m", "m", 8100).argv()) == []  # None: vLLM's own choice
    theirs = VllmLaunch("m", "m", 8100, dtype="float32", extra_args=["--dtype", "bfloat16"])
    assert dtypes_in(theirs.argv()) == ["bfloat16"]


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (AVX2_ONLY, "AVX2 CPU (vLLM computes in float32"),
        (AMX, "AMX CPU (vLLM computes in bfloat16"),
    ],
)
def test_the_benchmarks_machine_line_names_the_cpu_class_and_dtype(
    monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], line: str
) -> None:
    from benchmarks.lib.util import describe_machine, machine

    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    m = machine()
    assert (m["cpu_class"], m["vllm_dtype"]) == (cpu_class(flags), choose_dtype(flags).dtype)
    assert line in describe_machine(m)
    del m["cpu_class"], m["vllm_dtype"]  # results from before: the line without them
    assert "computes in" not in describe_machine(m)
