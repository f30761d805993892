"""ART's checkpoint transport: a model's steps and logs to and from any S3-compatible store.

``backend._experimental_push_to_s3(model)`` and ``_experimental_pull_from_s3(model)`` keep ART's
bucket layout and environment: the bucket is ``s3_bucket=`` or ``BACKUP_BUCKET``, and the store
is whatever boto3 is pointed at (``AWS_ENDPOINT_URL`` for MinIO, moto, R2...; credentials and
region as boto3 reads them). ART shells out to ``aws s3 sync``; this uses boto3 (``artery[s3]``)
and syncs the same way: an object whose size and MD5 already match is not sent again.

Under ``s3://{bucket}/{prefix/}{project}/models/{name}/``:

- ``history.jsonl``, ``trajectories/...``: the model directory ``model.log`` and ``model.train``
  write (the LocalBackend's path, ART's layout);
- ``model.json``: the model's identity (base model, LoRA), checked before a pull restores a step;
- ``checkpoints/{step:04d}/``: the step's adapter in the PEFT layout (``adapter_config.json``,
  ``adapter_model.safetensors``), what ART and vLLM load as a LoRA;
- ``checkpoints/{step:04d}/trainer/``: Artery's trainer state of that step (AdamW moments, RNG,
  ``trainer_state.json``, ``step.json``). Without it a step is an adapter, not a resumable step;
- ``zipped-steps/{step:04d}.zip``: the adapter as ``_experimental_deploy`` hands it on.

A push sends the steps the publisher still keeps (``delete_checkpoints`` and retention decide, as
the local directory decides in ART), read from the trainer's checkpoint directory: that needs a
``LocalBackend``, whose trainer shares this machine. A pull downloads into the model directory,
then makes the newest pulled step the model's current step when it is newer than the one here:
the trainer's files are rebuilt from it, the publisher stores and announces it (replicas serve
``name@step``), the registry's step moves, and the next ``train()`` continues from it, optimizer
state included.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import shutil
import uuid
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from artery.schemas import CheckpointSaved
from artery.shared import bus, subjects
from artery.shared.adapters import AdapterNotFound, adapter_info, pack_adapter, sha256_hex
from artery.shared.registry import models_kv, read_record
from artery.shared.wakeup import woken_by

if TYPE_CHECKING:
    from artery.backend import Backend
    from artery.model import Model

#: What makes a pulled step resumable: the trainer's own files (``services/trainer/policy.py``).
TRAINER_FILES = ("trainer_state.json", "optimizer.safetensors", "optimizer.json", "step.json")
OPTIONAL_TRAINER_FILES = ("rng.safetensors",)
#: The trainer's layout (``services/trainer/checkpoints.py``): ``<root>/<project>/<model>/<step:06d>/``.
STEP_FILE, ADAPTER_TAR, ADAPTER_DIR = "step.json", "adapter.tar", "adapter"
TRAINER_SUBDIR = "trainer"
Excludable = Literal["checkpoints", "logs", "trajectories"]
_STEP_KEY = re.compile(r"^checkpoints/(\d+)/")
_IDS = uuid.UUID("0b6f3c52-5a0e-4d59-9c1e-733370756c6c")
#: How long a pull waits for the publisher to store a restored step, and replicas to serve it.
RESTORE_TIMEOUT_S = 180.0


class S3TransportError(RuntimeError):
    """A push or pull that cannot be done as asked; the message says what is missing."""


class DeploymentUnsupported(NotImplementedError):
    """``_experimental_deploy``: the adapter is in the bucket, but Artery calls no vendor's API."""

    def __init__(self, message: str, *, url: str, s3_uri: str):
        super().__init__(message)
        self.url, self.s3_uri = url, s3_uri


@dataclass(frozen=True)
class Location:
    bucket: str
    prefix: str  # the model's key prefix, ending in "/"

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def location(model: Model, s3_bucket: str | None, prefix: str | None) -> Location:
    bucket = s3_bucket or os.environ.get("BACKUP_BUCKET")
    if not bucket:
        raise S3TransportError("no bucket: pass s3_bucket= or set BACKUP_BUCKET (ART's variable)")
    prefix_part = f"{prefix.strip('/')}/" if prefix and prefix.strip("/") else ""
    return Location(bucket, f"{prefix_part}{model.project}/models/{model.name}/")


def client():
    try:
        import boto3
    except ImportError as exc:  # an optional extra: say how to get it
        raise S3TransportError("S3 transport needs boto3: pip install 'artery[s3]'") from exc
    # boto3 reads AWS_ENDPOINT_URL (any S3-compatible store), credentials and region itself.
    return boto3.client("s3")


def ensure_bucket(s3, bucket: str) -> None:
    """As ART: a missing bucket is created; one owned by someone else is an error."""
    from botocore.exceptions import ClientError

    try:
        s3.head_bucket(Bucket=bucket)
        return
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code"))
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise S3TransportError(f"bucket {bucket!r} cannot be used ({code}): {exc}") from exc
    region = s3.meta.region_name
    extra = (
        {} if region in (None, "us-east-1") else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    )
    s3.create_bucket(Bucket=bucket, **extra)


def remote_objects(s3, where: Location) -> dict[str, tuple[int, str]]:
    """Relative key -> (size, ETag without quotes) of every object under the model's prefix."""
    found: dict[str, tuple[int, str]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=where.prefix):
        for item in page.get("Contents", []):
            found[item["Key"][len(where.prefix) :]] = (int(item["Size"]), item["ETag"].strip('"'))
    return found


def _same(data_or_path: bytes | Path, remote: tuple[int, str] | None) -> bool:
    if remote is None:
        return False
    data = data_or_path if isinstance(data_or_path, bytes) else data_or_path.read_bytes()
    # ETags of single-part uploads (what push makes) are the MD5 of the bytes.
    return len(data) == remote[0] and hashlib.md5(data, usedforsecurity=False).hexdigest() == remote[1]


def _safe_relative(key: str) -> PurePosixPath:
    """A key below the model's prefix as a relative path; one that would leave the directory is refused."""
    path = PurePosixPath(key)
    if not key or path.is_absolute() or ".." in path.parts or "\\" in key:
        raise S3TransportError(f"object key {key!r} is not a plain relative path: refused")
    return path


# --------------------------------------------------------------------------- local sources


def model_dir(backend: Backend, model: Model) -> Path:
    """The model directory, where ``register`` puts it (a LocalBackend's model path: ``.art``, or
    the path it was given)."""
    if model.base_path is None:
        path = getattr(backend, "models_path", None) or getattr(backend, "path", None)
        if isinstance(path, Path):
            model.base_path = str(path)
    return model.directory


def checkpoint_root(backend: Backend, model: Model) -> Path:
    """The trainer's checkpoint directory of ``model`` (needs the trainer on this machine)."""
    stack = getattr(backend, "stack", None)
    if stack is None:
        raise S3TransportError(
            "checkpoints travel from and to the trainer's checkpoint directory, which only a"
            " LocalBackend shares; a Backend joined to an Artery elsewhere cannot reach it"
            " (pass exclude=['checkpoints'] to move the logs only, or use `artery export-model`)"
        )
    root = stack.extra_env.get("ARTERY_TRAINER_CHECKPOINT_DIR") or stack.home / "checkpoints"
    return Path(root) / model.project / model.name


def trainer_steps(root: Path) -> dict[int, Path]:
    """Complete steps on the trainer's disk (a step directory is renamed into place whole)."""
    if not root.is_dir():
        return {}
    return {int(p.name): p for p in root.glob("[0-9]" * 6) if (p / STEP_FILE).is_file()}


async def kept_steps(backend: Backend, model: Model, steps: Iterable[int]) -> list[int]:
    """The steps whose adapter the publisher still keeps (retention deletes the others)."""
    js = await backend._js()
    kept = []
    for step in sorted(steps):
        try:  # the publisher's object name (services/publisher/service.py: object_name)
            await adapter_info(js, f"{model.project}/{model.name}/{step:06d}")
        except AdapterNotFound:
            continue
        kept.append(step)
    return kept


def step_files(step: int, directory: Path) -> dict[str, Path]:
    """A trainer step directory as keys of ``checkpoints/{step:04d}/`` (adapter.tar is rebuilt)."""
    base = f"checkpoints/{step:04d}/"
    files = {base + p.name: p for p in sorted((directory / ADAPTER_DIR).iterdir()) if p.is_file()}
    for name in TRAINER_FILES + OPTIONAL_TRAINER_FILES:
        if (directory / name).is_file():
            files[f"{base}{TRAINER_SUBDIR}/{name}"] = directory / name
    return files


def model_files(directory: Path) -> dict[str, Path]:
    """The model directory's own files (history, trajectories, logs); not pulled checkpoints."""
    if not directory.is_dir():
        return {}
    return {
        p.relative_to(directory).as_posix(): p
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.relative_to(directory).parts[0] not in ("checkpoints", "zipped-steps")
    }


def identity(model: Model) -> bytes:
    """``model.json``: what a pull checks before it makes a step this model's."""
    return json.dumps(
        {
            "project": model.project,
            "name": model.name,
            "base_model": getattr(model, "base_model", None),
            "lora": getattr(model, "lora_config", None),
        },
        indent=2,
        sort_keys=True,
    ).encode()


# --------------------------------------------------------------------------- push


async def push(
    backend: Backend,
    model: Model,
    *,
    s3_bucket: str | None = None,
    prefix: str | None = None,
    verbose: bool = False,
    delete: bool = False,
) -> list[int]:
    """Upload the model directory and its kept steps; returns the steps now in the bucket."""
    where = location(model, s3_bucket, prefix)
    wanted: dict[str, bytes | Path] = dict(model_files(model_dir(backend, model)))
    steps: list[int] = []
    if model.trainable:
        on_disk = trainer_steps(checkpoint_root(backend, model))
        steps = await kept_steps(backend, model, on_disk)
        for step in steps:
            wanted.update(step_files(step, on_disk[step]))
        wanted["model.json"] = identity(model)
    await asyncio.to_thread(_upload, where, wanted, verbose, delete)
    return steps


def _upload(where: Location, wanted: dict[str, bytes | Path], verbose: bool, delete: bool) -> None:
    s3 = client()
    ensure_bucket(s3, where.bucket)
    remote = remote_objects(s3, where)
    for key, source in wanted.items():
        if _same(source, remote.get(key)):
            continue
        body = source if isinstance(source, bytes) else source.read_bytes()
        s3.put_object(Bucket=where.bucket, Key=where.prefix + key, Body=body)
        if verbose:
            print(f"upload: {key} -> {where.uri}{key}")
    if delete:  # as `aws s3 sync --delete`: what is not here goes from there
        for key in sorted(set(remote) - set(wanted)):
            s3.delete_object(Bucket=where.bucket, Key=where.prefix + key)
            if verbose:
                print(f"delete: {where.uri}{key}")


# --------------------------------------------------------------------------- pull


async def pull(
    backend: Backend,
    model: Model,
    *,
    s3_bucket: str | None = None,
    prefix: str | None = None,
    verbose: bool = False,
    delete: bool = False,
    only_step: int | Literal["latest"] | None = None,
    exclude: Iterable[Excludable] = (),
) -> int | None:
    """Download into the model directory and restore the newest pulled step (see the module's
    docstring); returns the step restored, or None when nothing newer than here was pulled."""
    excluded = set(exclude)
    unknown = excluded - {"checkpoints", "logs", "trajectories"}
    if unknown:
        raise ValueError(f"exclude={sorted(unknown)}: only 'checkpoints', 'logs' and 'trajectories'")
    if only_step is not None and only_step != "latest" and (not isinstance(only_step, int) or only_step < 0):
        raise ValueError(f"only_step={only_step!r}: a step number, 'latest' or None")
    where = location(model, s3_bucket, prefix)
    directory = model_dir(backend, model)
    pulled = await asyncio.to_thread(_download, where, directory, only_step, excluded, verbose, delete)
    if not pulled or not model.trainable:
        return None
    return await restore(
        backend, model, max(pulled), directory / "checkpoints" / f"{max(pulled):04d}", verbose
    )


def _download(
    where: Location, directory: Path, only_step, excluded: set[str], verbose: bool, delete: bool
) -> list[int]:
    """Sync the bucket's copy into ``directory``; returns the checkpoint steps pulled."""
    s3 = client()
    ensure_bucket(s3, where.bucket)  # as ART: a first run pulls from a new, empty bucket
    remote = remote_objects(s3, where)
    by_step: dict[int, list[str]] = {}
    others = []
    for key in remote:
        _safe_relative(key)
        match = _STEP_KEY.match(key)
        if match:
            by_step.setdefault(int(match.group(1)), []).append(key)
        elif not key.startswith("zipped-steps/") and key.split("/")[0] not in excluded:
            others.append(key)
    steps = [] if "checkpoints" in excluded else sorted(by_step)
    if only_step == "latest":
        steps = steps[-1:]
    elif only_step is not None:
        if only_step not in by_step:
            raise LookupError(
                f"step {only_step} is not in {where.uri}checkpoints/ (there: {sorted(by_step)})"
            )
        steps = [only_step]
    keys = others + [k for s in steps for k in by_step[s]]
    for key in keys:
        target = directory / _safe_relative(key)
        if target.is_file() and _same(target, remote[key]):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        body = s3.get_object(Bucket=where.bucket, Key=where.prefix + key)["Body"].read()
        partial = target.with_name(f".{target.name}.pulling")
        partial.write_bytes(body)
        partial.replace(target)
        if verbose:
            print(f"download: {where.uri}{key} -> {target}")
    if delete:  # as `aws s3 sync --delete`, within what was pulled
        pulled = set(keys)
        in_scope = [p for p in model_files(directory) if p.split("/")[0] not in excluded]
        in_scope += [
            p.relative_to(directory).as_posix()
            for s in steps
            for p in (directory / "checkpoints" / f"{s:04d}").rglob("*")
            if p.is_file()
        ]
        for rel in in_scope:
            if rel not in pulled:
                (directory / rel).unlink()
    return steps


# --------------------------------------------------------------------------- restore


async def restore(backend: Backend, model: Model, step: int, source: Path, verbose: bool) -> int | None:
    """Make pulled step ``step`` (in ``source``) the model's current step, if it is newer."""
    kv = models_kv(await backend._js())
    found = await read_record(kv, model.project, model.name)
    current = found.record.step if found else 0
    if step <= current:
        if verbose:
            print(f"{model.project}/{model.name} is at step {current} here; pulled step {step} stays a file")
        return None
    check_identity(model, source.parent.parent / "model.json")
    missing = [n for n in TRAINER_FILES if not (source / TRAINER_SUBDIR / n).is_file()]
    if missing:
        raise S3TransportError(
            f"{model.project}/{model.name} step {step}, pulled to {source}, is an adapter without"
            f" Artery's trainer state ({', '.join(missing)} missing from {TRAINER_SUBDIR}/): its"
            f" optimizer cannot be restored, so it cannot become this model's step {step} (the model"
            f" stays at step {current}). To train on from its weights, use it as a warm start:"
            f" TrainableModel(name=<a new name>, base_model={str(source)!r})"
        )
    recorded = json.loads((source / TRAINER_SUBDIR / STEP_FILE).read_text())
    if recorded.get("step") != step:
        raise S3TransportError(f"{source}: its step.json says step {recorded.get('step')}, not {step}")
    tar = await asyncio.to_thread(_rebuild_trainer_step, checkpoint_root(backend, model), step, source)
    if found is None:  # pulled before register(), as ART's examples do: the record must exist
        await backend.register(model)
    await _publish_step(backend, model, step, tar, recorded.get("metrics") or {})
    await _advance_step(kv, model, step)
    # A LocalBackend starts the model's replica here when the pull came before register() (it is
    # started once; register finds it): register then returns with the pulled step served, not
    # with the base model answering the bare name until the replica's first catch-up.
    await backend._inference_url(model)
    await backend._wait_until_served(model, step, RESTORE_TIMEOUT_S)
    if verbose:
        print(f"{model.project}/{model.name} continues from pulled step {step}")
    return step


def check_identity(model: Model, path: Path) -> None:
    if not path.is_file():
        return  # pushed by ART itself: nothing to compare
    pushed = json.loads(path.read_text())
    mine = getattr(model, "base_model", None)
    if pushed.get("base_model") and mine and pushed["base_model"] != mine:
        raise S3TransportError(
            f"{model.project}/{model.name} in the bucket was trained on {pushed['base_model']!r},"
            f" not {mine!r}: its steps cannot continue on another base model"
        )


def _rebuild_trainer_step(root: Path, step: int, source: Path) -> Path:
    """The trainer's step directory from the pulled files, renamed into place whole."""
    final = root / f"{step:06d}"
    partial = root / f".{step:06d}.pulling"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / ADAPTER_DIR).mkdir(parents=True)
    try:
        for path in source.iterdir():
            if path.is_file():
                shutil.copyfile(path, partial / ADAPTER_DIR / path.name)
        for name in TRAINER_FILES + OPTIONAL_TRAINER_FILES:
            if (source / TRAINER_SUBDIR / name).is_file():
                shutil.copyfile(source / TRAINER_SUBDIR / name, partial / name)
        (partial / ADAPTER_TAR).write_bytes(pack_adapter(partial / ADAPTER_DIR))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final / ADAPTER_TAR


async def _publish_step(backend: Backend, model: Model, step: int, tar: Path, metrics: dict) -> None:
    """``checkpoint.saved`` for the rebuilt step (as the trainer announces its own), then wait
    until the publisher has stored it: replicas elsewhere fetch it from there, and a push sees it."""
    data = await asyncio.to_thread(tar.read_bytes)
    sha = sha256_hex(data)
    event = CheckpointSaved(
        # The same bytes at the same step are the same event: a repeated pull is de-duplicated.
        id=bus.derived_id(_IDS, model.project, model.name, f"pulled:{step}:{sha}"),
        project=model.project,
        model=model.name,
        step=step,
        uri=tar.resolve().as_uri(),
        sha256=sha,
        size_bytes=len(data),
        base_model=model.base_model,
        metrics={k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and v == v},
    )
    nc = await backend._connect()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RESTORE_TIMEOUT_S
    async with woken_by(nc, subjects.checkpoint("published", model.project, model.name)) as wake:
        try:
            await bus.publish_event(
                nc.jetstream(), subjects.checkpoint("saved", model.project, model.name), event
            )
        except Exception as exc:  # a secure stack lets only its trainer announce a checkpoint
            raise S3TransportError(
                f"pulled step {step} of {model.project}/{model.name} could not be announced to the"
                f" publisher ({exc!r}); on a secure stack only the trainer may: restore it there"
            ) from exc
        while True:
            wake.clear()
            try:
                await adapter_info(nc.jetstream(), f"{model.project}/{model.name}/{step:06d}")
                return
            except AdapterNotFound:
                pass
            if loop.time() > deadline:
                raise TimeoutError(
                    f"the publisher did not store pulled step {step} of {model.project}/{model.name}"
                    f" within {RESTORE_TIMEOUT_S:.0f}s (see its log and the DLQ)"
                )
            await wake.wait(2.0)


async def _advance_step(kv, model: Model, step: int) -> None:
    """The registry's step, compare-and-set (a concurrent register keeps its fields)."""
    for _ in range(20):
        found = await read_record(kv, model.project, model.name)
        if found is None or found.record.step >= step:
            return
        try:
            await kv.update(
                subjects.model_key(model.project, model.name),
                msgspec.json.encode(msgspec.structs.replace(found.record, step=step)),
                found.revision,
            )
            return
        except Exception:  # written in between: read again
            await asyncio.sleep(0.05)
    raise S3TransportError(f"could not move {model.project}/{model.name} to step {step} in the registry")


# --------------------------------------------------------------------------- deploy


async def deploy(
    backend: Backend,
    deploy_to: Any,
    model: Model,
    *,
    step: int | None = None,
    s3_bucket: str | None = None,
    prefix: str | None = None,
    verbose: bool = False,
    pull_s3: bool = True,
) -> None:
    """What ART's deploy does before it calls the vendor: the step's adapter zipped into
    ``zipped-steps/{step:04d}.zip`` and a presigned URL for it (an hour). The vendor's API call
    is not made (Artery holds no vendor account): ``DeploymentUnsupported`` carries the URL."""
    if pull_s3:
        await pull(backend, model, s3_bucket=s3_bucket, prefix=prefix, verbose=verbose, only_step=step)
    on_disk = trainer_steps(checkpoint_root(backend, model))
    step = step if step is not None else await backend._get_step(model)
    if step not in on_disk:
        raise S3TransportError(
            f"{model.project}/{model.name} has no step {step} here (steps: {sorted(on_disk)})"
        )
    where = location(model, s3_bucket, prefix)
    key = f"{where.prefix}zipped-steps/{step:04d}.zip"
    url = await asyncio.to_thread(_upload_zip, where.bucket, key, on_disk[step] / ADAPTER_DIR)
    provider = getattr(deploy_to, "value", deploy_to)
    raise DeploymentUnsupported(
        f"deploying to {provider!r} calls that vendor's API, which Artery does not do. Step {step}'s"
        f" adapter (PEFT layout) is at s3://{where.bucket}/{key}; this presigned URL (valid an hour)"
        f" is what ART would hand over: {url}. Artery serves the step itself as"
        f" {model.get_inference_name(step)!r}",
        url=url,
        s3_uri=f"s3://{where.bucket}/{key}",
    )


def _upload_zip(bucket: str, key: str, adapter: Path) -> str:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(adapter.iterdir()):
            if path.is_file():
                archive.write(path, path.name)
    s3 = client()
    ensure_bucket(s3, bucket)
    s3.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())
    return s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600)
