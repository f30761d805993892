"""A LocalBackend's stack lives no longer than its program (``shared.lifeline``), whichever way the
program ends: normally without ``close()``, by an uncaught exception, by SIGINT, by SIGTERM, or
SIGKILLed (then only the children's own watchdogs are left to stop them). And the embedded servers
start from a directory deeper than a Unix socket's path allows.

Each case runs a real program in a subprocess. Its stack is every descendant of the program while
it runs (the servers, PostgreSQL's own processes, the servers' guards, the services, a replica),
and whatever carries a probe variable of the program's environment (none may escape the tree).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import asyncpg
import pytest

from artery.ops.stack import Stack

PROBE = "ARTERY_LIFETIME_PROBE"
#: How long the program may take to start its stack (a replica loads torch and the tiny model).
READY_TIMEOUT_S = 240.0
#: How long the program may take to end once it is asked to.
END_TIMEOUT_S = 60.0
#: How long a stack's processes may outlive their program: the guards' and services' graces.
GONE_WITHIN_S = 20.0

PROGRAM = textwrap.dedent(
    """
    import asyncio, faulthandler, signal, sys

    import artery as art
    from artery.shared.models import TINY


    async def main(how: str, home: str, replica: bool) -> None:
        backend = art.LocalBackend(path=home, services=("collector",), start_inference=replica)
        model = art.TrainableModel(name="lifetime", project="lifetime", base_model=TINY)
        await model.register(backend)  # the stack is ready (and the model's replica, if asked)
        print("ready", flush=True)
        if how == "raise":
            raise RuntimeError("the program fails, and never calls backend.close()")
        if how != "exit":
            await asyncio.Event().wait()  # until a signal ends it


    # A program that does not end when asked shows where it is stuck (see ended()).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C live, as a terminal starts a program: one started in the background by a shell
    # without job control (a CI job, say) inherits SIGINT ignored, and Python leaves it so.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "replica"))
    """
)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``; None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def stack_processes(program: int, tag: str) -> dict[tuple[int, int], str]:
    """(pid, start time) -> command line of every live process of the program's stack: its
    descendants, and whatever carries the probe ``tag`` (PostgreSQL overwrites its processes'
    environment with their titles, so its own children are found as descendants only)."""
    live = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None and stat[0] != "Z":
            live[int(entry.name)] = stat
    needle = f"{PROBE}={tag}".encode()
    found = set()
    for pid in live:
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.add(pid)
    grew = True
    while grew:  # add children until none is left out
        more = {pid for pid, (_, ppid, _) in live.items() if ppid in found | {program}} - found
        grew = bool(more)
        found |= more
    commands = {}
    for pid in found:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            commands[(pid, live[pid][2])] = cmdline.strip()
    return commands


def still_running(processes: dict[tuple[int, int], str]) -> dict[tuple[int, int], str]:
    """Those of ``processes`` that run yet: the same pid with the same start time (not a reuse)."""
    left = {}
    for (pid, started), cmdline in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[2] == started:
            left[(pid, started)] = cmdline
    return left


def wait_ready(proc: subprocess.Popen, stderr: Path) -> None:
    """Until the program says its stack is ready (it prints ``ready`` after ``register``)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = b""
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line.strip() == b"ready":
                return
            if not line:  # it ended before its stack was ready
                break
    raise AssertionError(f"the program never got its stack ready ({line!r}); it said:\n{stderr.read_text()}")


def ended(proc: subprocess.Popen, stderr: Path) -> int:
    """The program's exit code once it ends; if it does not within ``END_TIMEOUT_S``, the
    failure shows every thread's stack as it was (faulthandler, on SIGUSR1), not a bare timeout."""
    try:
        return proc.wait(END_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while "most recent call first" not in stderr.read_text(errors="replace"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)  # faulthandler writes from its signal handler: nothing to wait on
        raise AssertionError(
            f"the program did not end within {END_TIMEOUT_S:g} s; its threads:\n{stderr.read_text()}"
        ) from None


def wait_gone(processes: dict[tuple[int, int], str], within: float) -> dict[tuple[int, int], str]:
    """What still runs of ``processes`` once ``within`` seconds passed; nothing as soon as all
    are gone."""
    deadline = time.monotonic() + within
    left = still_running(processes)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = still_running(processes)
    return left


@pytest.mark.parametrize(
    ("how", "replica", "exit_code"),
    [
        ("exit", True, 0),
        ("raise", False, 1),
        ("SIGINT", False, -signal.SIGINT),
        ("SIGTERM", False, -signal.SIGTERM),
        ("SIGKILL", True, -signal.SIGKILL),
    ],
)
def test_no_process_of_the_stack_outlives_its_program(tmp_path, how, replica, exit_code):
    tag = uuid.uuid4().hex
    stderr = tmp_path / "program.err"
    with open(stderr, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, how, str(tmp_path / "artery"), "replica" if replica else "-"],
            env={**os.environ, PROBE: tag},
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=tmp_path,
        )
    stack: dict[tuple[int, int], str] = {}
    try:
        wait_ready(proc, stderr)
        stack = stack_processes(proc.pid, tag)
        commands = " | ".join(stack.values())
        # What a stack is: the servers, each with its guard, PostgreSQL's own processes, the
        # services (and the replica).
        for part in ("nats-server", "postgres", "checkpointer", "lifeline.py", "artery.services.collector"):
            assert part in commands, f"no {part} in the stack: {commands}"
        assert ("artery.services.inference" in commands) == replica
        if how.startswith("SIG"):
            proc.send_signal(getattr(signal, how))
        assert ended(proc, stderr) == exit_code, stderr.read_text()
        left = wait_gone(stack, GONE_WITHIN_S)
        assert not left, f"{len(left)} of the stack's {len(stack)} processes outlived its program: {left}"
        assert not stack_processes(proc.pid, tag)  # nothing escaped the tree either
        # Who stopped them: the program's exit hook, or (SIGKILL) each one's own watchdog.
        logs = tmp_path / "artery" / "stack" / "logs"
        told = {
            log.name for log in logs.glob("*.log") if "is gone: stopping" in log.read_text(errors="replace")
        }
        if how == "SIGKILL":
            watched = {"nats-server.log", "postgres.log", "collector.log", "inference-lifetime-lifetime.log"}
            assert told == watched
        else:
            assert not told, "the program's exit hook should have stopped its stack"
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        proc.stdout.close()
        for pid, _ in still_running(stack):  # only a failed case leaves any: none may leak
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_the_embedded_servers_start_under_a_directory_too_deep_for_a_unix_socket(tmp_path):
    home = tmp_path / ("deep-" * 12) / ("er-" * 10) / "stack"
    # A Unix socket's path holds 107 bytes: PostgreSQL's ``.s.PGSQL.<port>`` here would not fit.
    assert len(str(home / "postgres" / ".s.PGSQL.65535")) > 120
    stack = Stack(home=home, services=())
    stack.start()
    try:
        conn = await asyncpg.connect(stack.database_url)
        assert await conn.fetchval("SELECT current_database()") == "artery"
        await conn.close()
        assert stack.nats_url and stack.nats.proc.poll() is None
    finally:
        stack.stop()
    assert not any(home.joinpath("postgres").glob(".s.PGSQL.*"))


HOOKED_PROGRAM = textwrap.dedent(
    """
    import signal, sys, time

    from artery.shared import lifeline

    caught = []
    signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))  # the program's own
    lifeline.at_exit(lambda: print("hook ran", flush=True))
    print("armed", flush=True)
    while not caught:
        time.sleep(0.01)
    print("handled by the program, still running", flush=True)
    """
)


def test_a_signal_handler_the_program_set_is_kept_and_the_hooks_run_when_it_ends():
    proc = subprocess.Popen(
        [sys.executable, "-c", HOOKED_PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"armed\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=END_TIMEOUT_S)
    assert proc.returncode == 0, err.decode()
    assert out.decode().splitlines() == ["handled by the program, still running", "hook ran"]


def test_services_never_reach_for_a_model_hub(tmp_path, monkeypatch):
    """A base model missing from the local cache fails at once in a service, not after a minute of
    hub retries; an operator's own HF_HUB_OFFLINE is kept."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert Stack(home=tmp_path / "a").service_env()["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert Stack(home=tmp_path / "b").service_env()["HF_HUB_OFFLINE"] == "0"


SIGNAL_TO_A_WORKER = textwrap.dedent(
    """
    import asyncio, signal, sys, threading

    from artery.shared import lifeline


    async def main(wake: bool) -> None:
        loop = asyncio.get_running_loop()
        if wake:
            lifeline.wake_loop_on_signals(loop)
        idle = threading.Event()

        def worker() -> None:  # an executor's idle thread, as the stack's start leaves one
            idle.wait()
            # Where the kernel may deliver a signal sent to the process: here, not the main thread.
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)

        threading.Thread(target=worker, daemon=True).start()
        loop.call_soon(idle.set)  # once the main task waits below, with nothing scheduled
        await asyncio.Event().wait()


    signal.signal(signal.SIGINT, signal.default_int_handler)  # live, whoever started us
    asyncio.run(main(sys.argv[1] == "wake"))
    """
)


def test_a_signal_delivered_to_another_thread_still_ends_an_idle_program(tmp_path):
    """The cause of a rare hang of the SIGINT case above: Ctrl-C landed on an idle worker thread
    and the main thread, asleep in the event loop's select with nothing scheduled, never ran
    asyncio.run's handler. With ``wake_loop_on_signals`` (LocalBackend sets it) the signal wakes
    the loop, the handler cancels the main task, and the program ends as Ctrl-C ends it."""
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_TO_A_WORKER, "wake"],
        capture_output=True,
        text=True,
        timeout=END_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == -signal.SIGINT, proc.stderr
    assert "KeyboardInterrupt" in proc.stderr
