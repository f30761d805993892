"""The flake hunt: the whole suite, several times, while a second load competes for the CPU.

``python -m loadtests.stress [--runs 3] [--load busy|suite|none] [-- PYTEST ARGS]`` (``make
test-stress``). A race that one quiet run hides shows under load, which is what CI machines have:
- ``busy`` (default): one spinning process per core, at the suite's own priority;
- ``suite``: a second copy of the suite running alongside each run (its results are not counted);
- ``none``: the runs alone, for comparison.

Each counted run writes a JUnit report; at the end every test that failed or errored in any run is
listed with how often, and the exit code is 1 if there was any (or a run exited non-zero for a
reason of its own, such as a process left running after the suite). Nothing is retried.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
#: A spinning process stops by itself after this long, should its parent be killed.
SPIN_LIMIT_S = 4 * 3600


@dataclass
class RunResult:
    number: int
    exit_code: int
    seconds: float
    counts: Counter = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)


def pytest_command(report: Path, pytest_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        *pytest_args,
    ]


def read_report(report: Path) -> tuple[Counter, list[str]]:
    """Outcome counts and the ids of the tests that failed or errored, from a JUnit report."""
    counts: Counter = Counter()
    failed = []
    if not report.exists():
        return counts, failed
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
        counts[outcome] += 1
        if outcome in ("failed", "error"):
            failed.append(f"{test_id} ({outcome})")
    return counts, failed


def start_load(kind: str, workdir: Path, pytest_args: list[str]) -> list[subprocess.Popen]:
    if kind == "busy":
        code = SPIN.format(seconds=SPIN_LIMIT_S)
        return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]
    if kind == "suite":
        command = pytest_command(workdir / "competing.xml", pytest_args)
        with open(workdir / "competing-suite.log", "ab") as log:  # the child keeps its own copy
            return [subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)]
    return []


def stop_load(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_once(number: int, workdir: Path, load: str, pytest_args: list[str]) -> RunResult:
    report = workdir / f"run-{number}.xml"
    log_path = workdir / f"run-{number}.log"
    competing = start_load(load, workdir, pytest_args)
    began = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            exit_code = subprocess.call(
                pytest_command(report, pytest_args), stdout=log, stderr=subprocess.STDOUT
            )
    finally:
        stop_load(competing)
    result = RunResult(number, exit_code, time.monotonic() - began)
    result.counts, result.failed = read_report(report)
    return result


def summary(results: list[RunResult], workdir: Path) -> tuple[str, bool]:
    per_test: Counter = Counter(test for r in results for test in r.failed)
    lines = []
    for r in results:
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(r.counts.items()))
        lines.append(f"run {r.number}: {counts or 'no report'}; exit {r.exit_code}; {r.seconds:.0f} s")
    odd_exits = [r for r in results if r.exit_code != 0 and not r.failed]
    for r in odd_exits:
        lines.append(
            f"run {r.number} exited {r.exit_code} with no failed test: see {workdir}/run-{r.number}.log"
        )
    if per_test:
        lines.append(f"failures per test over {len(results)} runs:")
        lines += [f"  {n}/{len(results)}  {test}" for test, n in per_test.most_common()]
    failures = sum(per_test.values())
    lines.append(f"{failures} failures over {len(results)} runs (logs in {workdir})")
    return "\n".join(lines), bool(per_test or odd_exits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="counted runs of the suite (default 3)")
    parser.add_argument("--load", choices=("busy", "suite", "none"), default="busy")
    parser.add_argument("--workdir", type=Path, help="where reports and logs go (default: a new temp dir)")
    parser.add_argument(
        "pytest_args", nargs="*", help="after --: passed to pytest (default: the whole suite)"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="artery-stress-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"{args.runs} runs of the suite under load={args.load}; reports in {workdir}", flush=True)
    results = []
    for number in range(1, args.runs + 1):
        result = run_once(number, workdir, args.load, args.pytest_args)
        results.append(result)
        status = "clean" if not result.failed and result.exit_code == 0 else f"{len(result.failed)} failed"
        print(f"run {number}/{args.runs}: {status} in {result.seconds:.0f} s", flush=True)
        for test in result.failed:
            print(f"  {test}", flush=True)
    text, failed = summary(results, workdir)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
