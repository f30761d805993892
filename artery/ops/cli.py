"""The ``artery`` command: ``up`` runs the whole system in the foreground, ``status`` shows it.

``artery up`` starts the embedded NATS and PostgreSQL (or uses ``ARTERY_NATS_URL`` /
``ARTERY_DATABASE_URL`` when set) and every service as child processes, restarts a service
that dies, and stops everything in order on Ctrl-C.

Long module: the ``artery`` command's subcommands, each ``cmd_*`` beside its arguments, so
that ``artery --help`` and what each command does read together; the work itself lives in the
modules they call (``artery.ops.stack``, ``artery.export``...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

DEFAULT_HOME = ".artery/stack"
#: Seconds a service (not a replica: ``stack_engine.start_timeout_s``) may take to say ready.
SERVICE_START_TIMEOUT_S = 300.0


def _line(name: str, state: str, detail: str = "") -> None:
    print(f"  {name:<12} {state:<9} {detail}", flush=True)


def cmd_up(args: argparse.Namespace) -> int:
    from artery.ops.stack import SERVICES, Stack

    services = tuple(s for s in args.services.split(",") if s) if args.services else SERVICES
    replicas = [_parse_serve(spec) for spec in args.serve or []]
    engine_env = {"ARTERY_INFERENCE_ENGINE": args.engine} if args.engine else {}
    if replicas:
        from artery.ops.stack import EngineUnavailable, inference_python

        try:  # before anything starts: a missing vLLM venv is a message, not a crash loop
            inference_python({**os.environ, **engine_env})
        except EngineUnavailable as exc:
            raise SystemExit(f"artery up: {exc}") from None
    stack = Stack(
        home=Path(args.home),
        nats_url=os.environ.get("ARTERY_NATS_URL") or None,
        database_url=os.environ.get("ARTERY_DATABASE_URL") or None,
        services=services,
        secure=args.secure,
        projects=tuple(args.project or ()) if args.secure else (),
    )
    stopping = False

    def request_stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    if args.project and not args.secure:
        raise SystemExit("--project names an agent user: it goes with --secure")
    print(f"artery up — home {stack.home}", flush=True)
    try:
        stack.start_infrastructure()
        _line("nats", "ready", f"{stack.nats_url}{' (embedded)' if stack.nats else ''}")
        _line("postgres", "ready", f"{stack.database_url}{' (embedded)' if stack.postgres else ''}")
        if args.secure:
            _line("users", "secure", f"one NATS user per service; passwords in {stack.secrets}")
            for project in stack.projects:
                env = " ".join(f"{k}={v}" for k, v in stack.agent_env(project).items())
                _line(f"agent-{project}", "env", env)
        for name in services:
            process = stack.start_service(name)
            _line(name, "started", f"pid {process.popen().pid}, log {process.log_path}")
        ready_within = _ready_timeouts(services, replicas, engine_env.get("ARTERY_INFERENCE_ENGINE"))
        for project, model, base_model in replicas:
            name = _replica_name(project, model)
            stack.start_service(
                name,
                service="inference",
                env={**stack.replica_env(project, model, base_model), **engine_env},
            )
            _line(name, "started", f"serving {project}/{model} on {base_model}")
        for name in stack.processes:
            stack.processes[name].wait_ready(timeout=ready_within[name])
            _line(name, "ready")
        stack.save_endpoints()
        _print_endpoints(stack.endpoints())
        print("Artery is up. Ctrl-C stops it.", flush=True)
        while not stopping:
            time.sleep(0.5)
            for name, process in stack.processes.items():
                if not process.running and not stopping:
                    code = process.popen().returncode
                    _line(name, "exited", f"code {code}; restarting (see {process.log_path})")
                    time.sleep(min(2**process.restarts, 30) * 0.5)
                    process.restarts += 1
                    process.start()
                    _line(name, "started", f"pid {process.popen().pid}")
                    try:
                        process.wait_ready(timeout=ready_within[name])
                        _line(name, "ready")
                    except (RuntimeError, TimeoutError) as exc:
                        _line(name, "failed", str(exc))
    finally:
        print("stopping...", flush=True)
        for name, process in reversed(list(stack.processes.items())):
            _line(name, "stopped", f"code {process.stop()}")
        stack.processes.clear()
        stack.stop()
        _line("servers", "stopped")
    return 0


def _print_endpoints(endpoints: dict) -> None:
    """Where to connect, in one block (``artery up`` once ready, and ``artery status``)."""
    print("where to connect:", flush=True)
    if endpoints.get("console_url"):
        print(f"  console      {endpoints['console_url']}")
    for name, url in (endpoints.get("inference") or {}).items():
        print(f"  inference    {url}  ({name.removeprefix('inference-')}; OPENAI_BASE_URL)")
    print(f"  NATS         {endpoints.get('nats_url')}  (ARTERY_NATS_URL)")
    credentials = endpoints.get("credentials")
    if credentials:
        print("  credentials  " + " ".join(f"{k}={v}" for k, v in credentials.items()))
    else:
        print("  credentials  none: the embedded NATS is open to local clients (--secure adds users)")
    sys.stdout.flush()


def _replica_name(project: str, model: str) -> str:
    return f"inference-{project}-{model}"


def _ready_timeouts(
    services: tuple[str, ...], replicas: list[tuple[str, str, str]], engine: str | None
) -> dict[str, float]:
    """Seconds each process of ``artery up`` may take to say ready, at start and at each restart:
    a vLLM replica compiles its model first (``stack_engine.start_timeout_s``). ``engine``: the
    replicas' engine as named (``--engine``), else the environment's, else the settings' default."""
    from artery.ops.stack_engine import start_timeout_s

    engine = engine or os.environ.get("ARTERY_INFERENCE_ENGINE") or "transformers"
    timeouts = dict.fromkeys(services, SERVICE_START_TIMEOUT_S)
    for project, model, _base_model in replicas:
        timeouts[_replica_name(project, model)] = start_timeout_s(engine)
    return timeouts


def _parse_serve(spec: str) -> tuple[str, str, str]:
    """``project/model=base_model`` (``demo/agent=artery/tiny-random``)."""
    names, _, base_model = spec.partition("=")
    project, _, model = names.partition("/")
    if not (project and model and base_model):
        raise SystemExit(f"--serve expects project/model=base_model, got {spec!r}")
    return project, model, base_model


def _find_stack(home: str) -> tuple[str, str | None, str, dict]:
    """NATS and PostgreSQL URLs, where they came from (said to the user), and ``stack.json``."""
    nats_url = os.environ.get("ARTERY_NATS_URL")
    database_url = os.environ.get("ARTERY_DATABASE_URL")
    state = Path(home) / "stack.json"
    if nats_url:
        return nats_url, database_url, "from ARTERY_NATS_URL", {}
    if state.exists():
        saved = json.loads(state.read_text())
        source = f"from {state}"
        pid = saved.get("pid")
        if pid and not _alive(pid):
            source += f" (its `artery up`, pid {pid}, is not running: the stack may be stopped)"
        return saved["nats_url"], database_url or saved.get("database_url"), source, saved
    return (
        "nats://127.0.0.1:4222",
        database_url,
        f"the default: no {state} (start one with `artery up`, or pass --home / ARTERY_NATS_URL)",
        {},
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _status(home: str) -> int:
    import asyncpg

    from artery.shared import bus, subjects
    from artery.shared.registry import read_record
    from artery.shared.settings import CommonSettings

    nats_url, database_url, source, saved = _find_stack(home)
    print(f"NATS {nats_url} ({source})")
    options: dict = {"max_reconnect_attempts": 0, "allow_reconnect": False}
    admin_secret = Path(home) / "secrets" / "admin"
    if admin_secret.exists() and not os.environ.get("ARTERY_NATS_USER"):
        # A secure stack (artery up --secure): read it as its admin, whose password is beside it.
        options.update(user="admin", password=admin_secret.read_text().strip(), inbox_prefix="_INBOX.admin")
    try:
        # A refused login would otherwise be retried forever: fail with the reason instead.
        nc = await asyncio.wait_for(
            bus.connect(CommonSettings(nats_url=nats_url), name="artery-status", **options), timeout=10
        )
    except Exception as exc:
        print(f"cannot connect to NATS at {nats_url}: {exc!r} (credentials: ARTERY_NATS_USER, ...)")
        return 1
    js = nc.jetstream()
    print(f"  {'stream':<22} {'messages':>9} {'bytes':>11}   consumers (pending / unacked / redelivered)")
    missing = 0
    for spec in subjects.STREAMS:
        try:
            info = await js.stream_info(spec.name)
        except Exception:
            print(f"  {spec.name:<22} {'(missing)':>9}")
            missing += 1
            continue
        consumers = ", ".join(
            f"{c.name} {c.num_pending}/{c.num_ack_pending}/{c.num_redelivered}"
            for c in await js.consumers_info(spec.name)
        )
        print(f"  {spec.name:<22} {info.state.messages:>9} {info.state.bytes:>11}   {consumers or '-'}")
    if missing == len(subjects.STREAMS):
        print(
            f"{nats_url} has none of Artery's streams: it is not an Artery stack (or nothing has "
            "provisioned it yet). Is `artery up` running, and with which --home?"
        )
        await bus.close(nc)
        return 1
    if saved.get("console_url") or saved.get("inference"):
        _print_endpoints(saved)
    replicas = await _replicas(js)
    if replicas:
        print("inference replicas")
        for info in replicas:
            state = "paused" if info.paused else "serving"
            print(f"  {info.replica_id:<30} {state:<8} {info.url}  {', '.join(info.served)}")
    try:
        kv = await js.key_value(subjects.MODELS_BUCKET)
        keys = await kv.keys()
    except Exception:
        keys = []
    if keys:
        print("models")
        for key in keys:
            project, name = subjects.names_of_key(key) or (key, "")
            found = await read_record(kv, project, name)
            if found is None:
                print(f"  {key:<30} (no valid record: see the warning above)")
                continue
            print(f"  {key:<30} step {found.record.step:<6} base {found.record.base_model or '-'}")
    await bus.close(nc)
    if database_url:
        print(f"PostgreSQL {database_url}")
        conn = await asyncpg.connect(database_url)
        for table in ("models", "trajectory_groups", "trajectories", "training_steps", "checkpoints"):
            count = await conn.fetchval(f"SELECT count(*) FROM {table}")  # names are ours, not input
            print(f"  {table:<22} {count:>9} rows")
        await conn.close()
    return 0


async def _replicas(js) -> list:
    from artery.shared.control_client import registered_replicas

    try:
        return await registered_replicas(js)
    except Exception:  # no bucket yet
        return []


def cmd_status(args: argparse.Namespace) -> int:
    return asyncio.run(_status(args.home))


def cmd_export(args: argparse.Namespace) -> int:
    """A model's trajectories with rewards, verdicts and sampled tokens (``artery.export``)."""
    from artery import export

    _, database_url, source, _ = _find_stack(args.home)
    if not database_url:
        raise SystemExit(f"artery export: no PostgreSQL (ARTERY_DATABASE_URL, or `artery up`'s {source})")
    rows = asyncio.run(export.fetch_rows(database_url, args.project, args.model))
    output = Path(args.output or f"{args.project}-{args.model}.{args.format}")
    export.write(rows, output, args.format)
    print(f"{len(rows)} trajectories of {args.project}/{args.model} -> {output}")
    return 0


def _nats_and_database(home: str, command: str) -> tuple[str, str]:
    nats_url, database_url, source, _ = _find_stack(home)
    if not database_url:
        raise SystemExit(f"artery {command}: no PostgreSQL (ARTERY_DATABASE_URL, or `artery up`'s {source})")
    admin_secret = Path(home) / "secrets" / "admin"
    if admin_secret.exists() and not os.environ.get("ARTERY_NATS_USER"):
        # A secure stack (artery up --secure): act as its admin, whose password is beside it, as
        # `artery status` does (shared.auth reads these when the command connects).
        os.environ["ARTERY_NATS_USER"] = "admin"
        os.environ["ARTERY_NATS_PASSWORD_FILE"] = str(admin_secret)
    return nats_url, database_url


def cmd_export_model(args: argparse.Namespace) -> int:
    """A published step as a PEFT adapter or merged weights (``artery.ops.export_model``)."""
    from artery.ops import export_model
    from artery.shared.settings import CommonSettings, load

    nats_url, database_url = _nats_and_database(args.home, "export-model")
    settings = msgspec_replace(load(CommonSettings, "ARTERY_"), nats_url=nats_url)
    try:
        found = asyncio.run(
            export_model.export_model(
                settings,
                database_url,
                args.project,
                args.model,
                Path(args.directory),
                fmt=args.format,
                step=args.step,
                dtype=args.dtype,
            )
        )
    except (LookupError, FileExistsError) as exc:
        raise SystemExit(f"artery export-model: {exc}") from None
    what = f"{args.project}/{args.model} step {found.step}"
    print(f"{what} ({args.format}, base {found.base_identity}) -> {args.directory}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """Train a fresh model on a model's stored groups, step by step (``artery.ops.replay``)."""
    from artery.ops import replay
    from artery.shared.settings import CommonSettings, load

    nats_url, database_url = _nats_and_database(args.home, "replay")
    settings = msgspec_replace(load(CommonSettings, "ARTERY_"), nats_url=nats_url)
    try:
        steps = asyncio.run(
            replay.replay(
                settings,
                database_url,
                args.project,
                args.model,
                args.new_model,
                from_step=args.from_step,
                to_step=args.to_step,
                timeout_s=args.timeout,
                progress=print,
            )
        )
    except replay.ReplayError as exc:
        raise SystemExit(f"artery replay: {exc}") from None
    print(f"replayed {len(steps)} steps of {args.project}/{args.model} as {args.project}/{args.new_model}")
    return 0


def msgspec_replace(settings, **changes):
    import msgspec

    return msgspec.structs.replace(settings, **changes)


def cmd_provision(_: argparse.Namespace) -> int:
    """Create or update every stream, bucket and object store (``ARTERY_*`` settings, e.g.
    ``ARTERY_STREAM_REPLICAS``). Services only create what is missing, and with per-service NATS
    users only ``admin`` may do even that: run this as admin after changing stream settings."""
    from artery.shared import bus
    from artery.shared.settings import CommonSettings, load

    async def provision() -> None:
        settings = load(CommonSettings, "ARTERY_")
        nc = await bus.connect(settings, name="artery-provision", max_reconnect_attempts=0)
        try:
            await bus.provision(nc.jetstream(), settings)
        finally:
            await nc.close()

    asyncio.run(provision())
    print("provisioned")
    return 0


def cmd_config(_: argparse.Namespace) -> int:
    from artery.services.collector import settings as collector
    from artery.services.console import settings as console
    from artery.services.inference import settings as inference
    from artery.services.publisher import settings as publisher
    from artery.services.reward import settings as reward
    from artery.services.trainer import settings as trainer
    from artery.shared import auth, http
    from artery.shared.settings import CommonSettings, describe

    for title, cls, prefix in (
        ("every service and the SDK", CommonSettings, "ARTERY_"),
        ("NATS credentials and TLS (every service and the SDK)", auth.NatsAuthSettings, auth.PREFIX),
        ("HTTP servers (inference, console)", http.HttpLimits, http.PREFIX),
        ("collector", collector.CollectorSettings, collector.PREFIX),
        ("reward", reward.RewardSettings, reward.PREFIX),
        ("inference", inference.InferenceSettings, inference.PREFIX),
        ("trainer", trainer.TrainerSettings, trainer.PREFIX),
        ("publisher", publisher.PublisherSettings, publisher.PREFIX),
        ("console", console.ConsoleSettings, console.PREFIX),
    ):
        print(f"# {title}")
        for variable, default, description in describe(cls, prefix):
            print(f"{variable:<36} {default:<26} {description}")
        print()
    return 0


def cmd_nats_config(args: argparse.Namespace) -> int:
    """Print nats-server users with each role's permissions, generated from ``shared.subjects``."""
    from artery.shared.embedded import write_private
    from artery.shared.permissions import default_users, render_authorization

    secrets_dir = Path(args.secrets_dir) if args.secrets_dir else None
    kept = _existing_passwords(secrets_dir) if secrets_dir else {}
    users = [
        dataclasses.replace(user, password=kept[user.name]) if user.name in kept else user
        for user in default_users(args.project or [])
    ]
    if secrets_dir:
        secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for user in users:  # one file per user, for ARTERY_NATS_PASSWORD_FILE (docker secrets)
            path = _password_file(secrets_dir, user.name)
            write_private(path, user.password + "\n")
            if args.owner:  # written by root for services that run as another user (compose)
                uid, _, gid = args.owner.partition(":")
                os.chown(path, int(uid), int(gid or uid))
    authorization = render_authorization(users)  # hashes only: printing it reveals no password
    if args.output:
        write_private(Path(args.output), authorization)  # owner-only all the same: nobody else needs hashes
    else:
        print(authorization, end="")
    return 0


def _password_file(secrets_dir: Path, user: str) -> Path:
    """``DIR/<user>``, or ``DIR/<user>/password`` where ``DIR/<user>`` is a directory: compose
    mounts one volume per service there, so that each container sees its own password only."""
    path = secrets_dir / user
    return path / "password" if path.is_dir() else path


def _existing_passwords(secrets_dir: Path) -> dict[str, str]:
    """Passwords already written under ``secrets_dir``: running nats-config again (a restarted
    compose deployment) keeps them, or every running service would lose its connection."""
    found = {}
    if secrets_dir.is_dir():
        for entry in secrets_dir.iterdir():
            path = _password_file(secrets_dir, entry.name)
            if path.is_file() and (password := path.read_text().strip()):
                found[entry.name] = password
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="artery", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run NATS, PostgreSQL and every service in the foreground")
    up.add_argument("--home", default=DEFAULT_HOME, help="state directory (default %(default)s)")
    up.add_argument("--services", help="comma-separated subset of services to run")
    up.add_argument(
        "--serve",
        action="append",
        metavar="PROJECT/MODEL=BASE",
        help="start an inference replica for a model (repeatable), e.g. demo/agent=artery/tiny-random",
    )
    up.add_argument(
        "--engine",
        choices=["transformers", "vllm"],
        help="inference engine of the --serve replicas (default: ARTERY_INFERENCE_ENGINE, else "
        "transformers); vllm runs them from .venv-vllm (`make setup-vllm`)",
    )
    up.add_argument(
        "--secure",
        action="store_true",
        help="embedded NATS with one user per service and agent-PROJECT per --project (see Security)",
    )
    up.add_argument(
        "--project", action="append", help="with --secure: add the agent user agent-PROJECT (repeatable)"
    )
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="streams, consumers, lag and row counts")
    status.add_argument("--home", default=DEFAULT_HOME, help="state directory of `artery up`")
    status.set_defaults(func=cmd_status)
    export = sub.add_parser("export", help="a model's trajectories, rewards and sampled tokens to a file")
    export.add_argument("--project", required=True)
    export.add_argument("--model", required=True)
    export.add_argument("--format", choices=["parquet", "jsonl", "hf"], default="parquet")
    export.add_argument("--output", help="file to write, a directory for hf (default PROJECT-MODEL.FORMAT)")
    export.add_argument("--home", default=DEFAULT_HOME, help="state directory of `artery up`")
    export.set_defaults(func=cmd_export)
    export_model = sub.add_parser(
        "export-model", help="a published step as a PEFT adapter or merged transformers weights"
    )
    export_model.add_argument("--project", required=True)
    export_model.add_argument("--model", required=True)
    export_model.add_argument("--step", type=int, help="published step (default: the newest kept)")
    export_model.add_argument("--format", choices=["peft", "merged"], default="peft")
    export_model.add_argument(
        "--dtype", default="auto", help="merged weights' dtype (default: the base model's own)"
    )
    export_model.add_argument("directory", help="directory to write (replaced whole)")
    export_model.add_argument("--home", default=DEFAULT_HOME, help="state directory of `artery up`")
    export_model.set_defaults(func=cmd_export_model)
    replay = sub.add_parser(
        "replay", help="train a fresh model on a model's stored groups, step by step, through the trainer"
    )
    replay.add_argument("--project", required=True)
    replay.add_argument("--model", required=True, help="the model whose steps are replayed")
    replay.add_argument("--new-model", required=True, help="the fresh model trained (must not have trained)")
    replay.add_argument("--from-step", type=int, help="first step replayed (default: 1)")
    replay.add_argument("--to-step", type=int, help="last step replayed (default: the newest)")
    replay.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each step")
    replay.add_argument("--home", default=DEFAULT_HOME, help="state directory of `artery up`")
    replay.set_defaults(func=cmd_replay)
    config = sub.add_parser("config", help="print every setting with its default")
    config.set_defaults(func=cmd_config)
    provision = sub.add_parser("provision", help="create or update every stream and bucket (as admin)")
    provision.set_defaults(func=cmd_provision)
    nats_config = sub.add_parser(
        "nats-config", help="print nats-server users: one per service, agent-<project> per project"
    )
    nats_config.add_argument("--project", action="append", help="add the user agent-PROJECT (repeatable)")
    nats_config.add_argument(
        "--secrets-dir",
        help="also write each password to DIR/<user>, or DIR/<user>/password where that is a "
        "directory (mode 0600); passwords already there are kept",
    )
    nats_config.add_argument("--owner", metavar="UID[:GID]", help="give the password files to this owner")
    nats_config.add_argument(
        "--output", help="write the configuration to this file (mode 0600) instead of stdout"
    )
    nats_config.set_defaults(func=cmd_nats_config)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
