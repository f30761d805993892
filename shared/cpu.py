"""What this machine's CPU can do, for the choices that depend on it (the default inference
engine, the trainer's autocast): read from ``/proc/cpuinfo``, never by trying an instruction."""

from __future__ import annotations

from functools import cache
from pathlib import Path

#: CPU flags (``/proc/cpuinfo``) of native bf16 matmuls: x86's AVX-512 BF16 and AMX, Arm's BF16.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively, by its ``/proc/cpuinfo`` flags (x86's ``flags``,
    Arm's ``Features``). Where they cannot be read (not Linux), False: float32 is never the slow
    path, bf16 without the instructions is."""
    if cpuinfo is None:
        return _this_cpu_has_bf16()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return not BF16_CPU_FLAGS.isdisjoint(value.split())
    return False


@cache
def _this_cpu_has_bf16() -> bool:
    """This machine's answer, read once: the trainer asks at every step, and the CPU does not
    change under a running process."""
    try:
        return cpu_has_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False
