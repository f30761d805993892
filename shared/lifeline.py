"""A stack's processes live no longer than the program that started them.

Two mechanisms, because each misses what the other covers:

- **In the program** (``at_exit``): hooks that stop its stacks when it ends normally, by an
  uncaught exception or KeyboardInterrupt (``atexit``), or by a signal whose default action ends
  it (SIGTERM, SIGHUP, a SIGINT left at its default): the hooks run, then the signal is delivered
  again with its default action, so the program still ends the way that signal ends it. A handler
  the program set itself is left in place: it decides whether the program ends (and when it does,
  ``atexit`` runs the hooks). Nothing in the program runs on SIGKILL, hence:
- **In every child**: a watchdog on the program itself, named by ``ARTERY_LIFELINE_PID`` in the
  child's environment (``child_env``). A Python service runs ``watch_parent`` (a thread): once the
  program is gone it stops itself as on SIGTERM, and exits at once if that takes longer than a
  grace. A server that is not Python (nats-server, PostgreSQL) gets a guard process (``guard``:
  this file run as a script) that stops it the way it is meant to be stopped (PostgreSQL's fast
  shutdown keeps its data whole) and exits when the server does.

The watchdog watches the program's process, not the thread that started the child: Linux's
``PR_SET_PDEATHSIG`` fires when the *thread* that forked exits (``LocalBackend`` starts its stack
from a worker thread that ends with the event loop, while the program goes on), and the write end
of a pipe would be inherited by every ``fork`` of the program and keep the stack alive with them.
Where Linux has pidfds the wait is a poll on one, woken by the exit itself and immune to pid reuse;
elsewhere the pid is checked every ``POLL_S``.

Run as a script (``python -I lifeline.py``, the guard), this file must need only the standard
library.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

#: The pid of the program a child lives no longer than.
PARENT_ENV = "ARTERY_LIFELINE_PID"
#: How often a pid is checked where there are no pidfds.
POLL_S = 0.25
#: How long a Python service may take to stop cleanly once its program is gone.
SERVICE_GRACE_S = 5.0
#: Signals whose default action ends the program: with that default, the hooks run first.
EXIT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, name)
)


def child_env() -> dict[str, str]:
    """The environment that ties a child to this process."""
    return {PARENT_ENV: str(os.getpid())}


def tie_spawned_children() -> None:
    """Tie the children a library spawns from now on (with this process's environment) to this
    process rather than to the program: a service's own helper processes (vLLM's engine core and
    worker) should live no longer than the service, even when the service alone is killed. This
    process's own watch (``watch_parent``) keeps the program it was started by."""
    os.environ[PARENT_ENV] = str(os.getpid())


class Watched:
    """A process to wait for: by pidfd where there is one, else by its pid.

    ``parent``: it is this process's parent, so that without a pidfd its end shows as a change of
    ``getppid()`` (a dead parent's pid may be reused; our parent pid changes once and for all).
    Raises ProcessLookupError when the process is already gone.
    """

    def __init__(self, pid: int, *, fd: int | None = None, parent: bool = False):
        self.pid = pid
        self.parent = parent
        self.fd = fd if fd is not None else _pidfd(pid)

    def gone(self) -> bool:
        if self.fd is not None:
            return bool(select.select([self.fd], [], [], 0)[0])
        if self.parent:
            return os.getppid() != self.pid
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's: it exists
            return False
        return False

    def send(self, sig: int) -> None:
        try:
            if self.fd is not None:
                signal.pidfd_send_signal(self.fd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def _pidfd(pid: int) -> int | None:
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except OSError:  # a kernel without pidfds (ENOSYS), or a sandbox that refuses them
        return None


def first_gone(processes: Sequence[Watched], timeout: float | None = None) -> Watched | None:
    """Block until one of ``processes`` is gone and return it; None once ``timeout`` passed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    by_fd = {p.fd: p for p in processes if p.fd is not None}
    polled = [p for p in processes if p.fd is None]
    while True:
        for process in polled:
            if process.gone():
                return process
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        wait = left if not polled else POLL_S if left is None else min(POLL_S, left)
        if by_fd:
            ready = select.select(list(by_fd), [], [], wait)[0]
            if ready:
                return by_fd[ready[0]]
        elif wait is not None:
            time.sleep(wait)
        if deadline is not None and time.monotonic() >= deadline:
            return None


def program() -> Watched | None:
    """The program this process is tied to (``ARTERY_LIFELINE_PID``); None when it is tied to
    none. Raises ProcessLookupError when that program is already gone."""
    value = os.environ.get(PARENT_ENV)
    if not value:
        return None
    pid = int(value)
    # The pidfd first, then the parent check: a pidfd opened while the program was still our
    # parent names it, whatever the pid becomes later. A child started through an intermediary
    # (a wrapper script that does not exec) still watches the program that started the stack.
    watched = Watched(pid)
    watched.parent = os.getppid() == pid
    return watched


def _say(message: str) -> None:
    print(f"lifeline: {message}", file=sys.stderr, flush=True)


def watch_parent(
    notify: Callable[[str], None] = _say,
    grace_s: float = SERVICE_GRACE_S,
    *,
    stop: Watched | None = None,
) -> threading.Thread | None:
    """In a service: once the program that started it is gone, stop as on SIGTERM (the service's
    own clean stop), and exit at once if that takes longer than ``grace_s``. Nothing when the
    service was not started by a stack (compose, systemd: their supervisor owns its life).

    ``stop``: stop that process instead (a library's process this one runs under, such as vLLM's
    engine core above its worker): SIGTERM, SIGKILL if it is not gone within ``grace_s``; then
    this process exits."""
    try:
        parent = program()
    except ProcessLookupError:
        parent = None
        gone_already = True
    else:
        if parent is None:
            return None
        gone_already = False
    pid = os.environ[PARENT_ENV]

    def watch() -> None:
        if parent is not None and not gone_already:
            first_gone([parent])
        if stop is None:
            notify(f"the program that started this process (pid {pid}) is gone: stopping")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(grace_s)
            notify(f"not stopped within {grace_s}s of its program's end: exiting now")
        else:
            notify(f"the program that started this process (pid {pid}) is gone: stopping pid {stop.pid}")
            stop.send(signal.SIGTERM)
            if first_gone([stop], timeout=grace_s) is None:
                stop.send(signal.SIGKILL)
        os._exit(1)

    thread = threading.Thread(target=watch, name="artery-lifeline", daemon=True)
    thread.start()
    return thread


def guard(
    proc: subprocess.Popen, stops: Sequence[tuple[int, float]], log_file: Path | None = None
) -> subprocess.Popen | None:
    """Start the guard of ``proc``, a server this process just started: once this process is
    gone, it sends each signal of ``stops`` in turn, waiting its seconds for the server to exit.
    It exits as soon as the server does (stopped by us, or crashed). None when the server is
    already gone."""
    try:
        fd = _pidfd(proc.pid)  # our unreaped child: the pid is still its own, even if it exited
    except ProcessLookupError:
        return None
    argv = [sys.executable, "-I", str(Path(__file__).resolve()), str(proc.pid)]
    argv += [",".join(f"{int(sig)}:{wait}" for sig, wait in stops)]
    if fd is not None:
        argv += [str(fd)]
    log: BinaryIO | int = open(log_file, "ab") if log_file is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            argv,
            env={**os.environ, **child_env()},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=(fd,) if fd is not None else (),
            start_new_session=True,  # a Ctrl-C meant for the program is not for it
        )
    finally:
        if fd is not None:
            os.close(fd)
        if not isinstance(log, int):  # DEVNULL is a number, not a file to close
            log.close()


def release(guard_proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """After its server stopped: the guard sees it and exits; reap it (or end it, if it lingers)."""
    if guard_proc is None:
        return
    try:
        guard_proc.wait(timeout)
    except subprocess.TimeoutExpired:
        guard_proc.kill()
        guard_proc.wait()


def _guard_main(argv: list[str]) -> int:
    """The guard process: ``lifeline.py <server pid> <sig>:<wait>,... [<server pidfd>]``."""
    pid = int(argv[0])
    stops = [(int(sig), float(wait)) for sig, wait in (s.split(":") for s in argv[1].split(","))]
    try:
        server = Watched(pid, fd=int(argv[2]) if len(argv) > 2 else None)
    except ProcessLookupError:
        return 0
    try:
        parent = program()
    except ProcessLookupError:
        parent = None  # gone before we looked
    else:
        if parent is None:
            _say(f"a guard needs {PARENT_ENV}: the program whose end stops pid {pid}")
            return 2
        if first_gone([parent, server]) is server:
            return 0  # stopped by the program (or crashed): nothing to do
    _say(f"the program that started pid {pid} ({os.environ.get(PARENT_ENV)}) is gone: stopping it")
    for sig, wait in stops:
        server.send(sig)
        if first_gone([server], timeout=wait) is server:
            return 0
    return 1


# --- in the program: exit hooks ----------------------------------------------------------------

_hooks: dict[int, Callable[[], None]] = {}
_tokens = itertools.count()
_lock = threading.Lock()
#: The process whose hooks these are (a fork of the program inherits them, not its stacks).
_owner: int | None = None
_signals_taken: set[int] = set()


def at_exit(hook: Callable[[], None]) -> int:
    """Run ``hook`` when this program ends (see the module doc); a token for ``cancel``.

    Hooks run last-registered first, each once. Call from the main thread to cover signals too
    (Python sets signal handlers there only); from another, ``atexit`` alone is armed."""
    global _owner
    with _lock:
        if _owner != os.getpid():
            _owner = os.getpid()
            _hooks.clear()
            _signals_taken.clear()
            atexit.register(run_exit_hooks)
        if threading.current_thread() is threading.main_thread():
            for sig in EXIT_SIGNALS:
                if sig not in _signals_taken and signal.getsignal(sig) is signal.SIG_DFL:
                    signal.signal(sig, _end_by_signal)
                    _signals_taken.add(sig)
        token = next(_tokens)
        _hooks[token] = hook
    return token


def wake_loop_on_signals(loop) -> bool:
    """Make every signal wake ``loop`` (an asyncio event loop run by the main thread; call from it).

    Python runs a signal's handler in the main thread, when that thread next runs Python code. The
    kernel may hand a signal sent to the process to any thread that does not block it, an
    executor's idle worker say; the main thread, asleep in the loop's ``select`` with nothing
    scheduled, then never runs the handler: ``asyncio.run``'s SIGINT handler (which cancels the
    program's main task) or ``_end_by_signal`` (which stops the stack) wait for the loop's next
    timer, minutes away or never. A wakeup fd read by the loop ends that sleep for any signal;
    the handlers then run as usual. Kept as it is when something already set one (asyncio's own
    ``add_signal_handler`` does): that one wakes the loop too. False when nothing was set."""
    import socket

    if threading.current_thread() is not threading.main_thread():
        return False
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter after all
        reader.close()
        writer.close()
        return False
    global _wakeup
    ours = _wakeup is not None and previous == _wakeup[1].fileno()
    if previous != -1 and not ours:
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return False
    if _wakeup is not None:  # an earlier loop's (a second asyncio.run): this one reads it now
        old_reader, old_writer, old_loop = _wakeup
        with contextlib.suppress(Exception):  # that loop may be closed already
            old_loop.remove_reader(old_reader.fileno())
        old_reader.close()
        old_writer.close()

    def drain() -> None:
        try:
            while reader.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    loop.add_reader(reader.fileno(), drain)
    _wakeup = (reader, writer, loop)  # open while the fd is set: until a later loop's call
    return True


#: ``wake_loop_on_signals``'s socket pair and the loop that reads it.
_wakeup: tuple | None = None


def cancel(token: int) -> None:
    with _lock:
        _hooks.pop(token, None)


def run_exit_hooks() -> None:
    if _owner != os.getpid():
        return
    while True:
        with _lock:
            if not _hooks:
                return
            hook = _hooks.pop(max(_hooks))
        try:
            hook()
        except Exception as exc:  # one stack failing to stop must not keep the next one running
            _say(f"an exit hook failed: {exc!r}")


def _end_by_signal(signum: int, frame) -> None:
    # A second signal of the same kind ends the program at once (the children's watchdogs then
    # stop what the hooks had not).
    signal.signal(signum, signal.SIG_DFL)
    run_exit_hooks()
    os.kill(os.getpid(), signum)


if __name__ == "__main__":
    sys.exit(_guard_main(sys.argv[1:]))
