"""``python -m loadtests [NAME ...] [options]``: run every benchmark, or the ones named.

Options after the names go to each benchmark that runs (``python -m loadtests ingest --quick``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from loadtests import (
    control_plane,
    inference,
    ingest,
    loop,
    scale_out,
    serving,
    trainer_memory,
    trainer_precision,
    trainer_shared_prompt,
    trainer_step,
    trainer_throughput,
)

BENCHMARKS: dict[str, Callable[[list[str]], dict]] = {
    "ingest": ingest.main,
    "inference": inference.main,
    # After inference: both write loadtests/results/inference.json, each keeping the other's keys.
    "serving": serving.main,
    "trainer_step": trainer_step.main,
    "trainer_memory": trainer_memory.main,
    # Qwen3-0.6B's shape on a GPU; without one, the tiny shape on the CPU.
    "trainer_throughput": trainer_throughput.main,
    # SmolLM2's demo-sized step in float32 and in bf16 autocast.
    "trainer_precision": trainer_precision.main,
    # The same step with each group's prompt passed once, against every row passed whole.
    "trainer_shared_prompt": trainer_shared_prompt.main,
    "loop": loop.main,
    "scale_out": scale_out.main,
    "control_plane": control_plane.main,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = []
    while argv and argv[0] in BENCHMARKS:
        names.append(argv.pop(0))
    if argv and argv[0] in ("-h", "--help") and not names:
        print(__doc__.strip())
        print("benchmarks:", ", ".join(BENCHMARKS))
    for name in names or list(BENCHMARKS):
        print(f"== {name} ==", flush=True)
        BENCHMARKS[name](argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
