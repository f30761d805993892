"""What this machine's CPU can do, for the choices that depend on it (the default inference
engine and its dtype, the trainer's autocast): read from ``/proc/cpuinfo``, never by trying an
instruction."""

from __future__ import annotations

from functools import cache
from pathlib import Path

#: CPU flags (``/proc/cpuinfo``) of native bf16 matmuls: x86's AVX-512 BF16 and AMX, Arm's BF16.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
#: CPU flags that fbgemm's fp16-weight matmul needs (x86 only): AVX2 and FMA for its float32
#: arithmetic, F16C to widen the fp16 weights as they are read.
FP16_WEIGHTS_CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively, by its ``/proc/cpuinfo`` flags (x86's ``flags``,
    Arm's ``Features``). Where they cannot be read (not Linux), False: float32 is never the slow
    path, bf16 without the instructions is."""
    flags = _flags(cpuinfo) if cpuinfo is not None else _this_cpu_flags()
    return not BF16_CPU_FLAGS.isdisjoint(flags)


def cpu_has_fp16_weights(cpuinfo: str | None = None) -> bool:
    """Whether fbgemm's fp16-weight matmul runs here (``services.inference.engine.fp16_weights``):
    an x86 CPU with AVX2, FMA and F16C. False where the flags cannot be read."""
    flags = _flags(cpuinfo) if cpuinfo is not None else _this_cpu_flags()
    return FP16_WEIGHTS_CPU_FLAGS <= flags


def _flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's flags (x86's ``flags``, Arm's ``Features``); none if there are none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@cache
def _this_cpu_flags() -> frozenset[str]:
    """This machine's flags, read once: the trainer asks at every step, and the CPU does not
    change under a running process."""
    try:
        return _flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()
