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
then makes the newest pulled step the model's current step when it is newer than the one here
(``artery.checkpoint_restore``): the trainer's files are rebuilt from it, the publisher stores and
announces it (replicas serve ``name@step``), the registry's step moves, and the next ``train()``
continues from it, optimizer state included.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import re
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

from artery.checkpoint_layout import (
    ADAPTER_DIR,
    OPTIONAL_TRAINER_FILES,
    STEP_FILE,
    TRAINER_FILES,
    TRAINER_SUBDIR,
    CheckpointBackend,
    S3TransportError,
    checkpoint_root,
)
from artery.checkpoint_restore import restore
from artery.shared.adapters import AdapterNotFound, adapter_info

if TYPE_CHECKING:
    from artery.model import Model

Excludable = Literal["checkpoints", "logs", "trajectories"]
_STEP_KEY = re.compile(r"^checkpoints/(\d+)/")


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


def model_dir(backend: CheckpointBackend, model: Model) -> Path:
    """The model directory, where ``register`` puts it (a LocalBackend's model path: ``.art``, or
    the path it was given)."""
    if model.base_path is None:
        path = getattr(backend, "models_path", None) or getattr(backend, "path", None)
        if isinstance(path, Path):
            model.base_path = str(path)
    return model.directory


def trainer_steps(root: Path) -> dict[int, Path]:
    """Complete steps on the trainer's disk (a step directory is renamed into place whole)."""
    if not root.is_dir():
        return {}
    return {int(p.name): p for p in root.glob("[0-9]" * 6) if (p / STEP_FILE).is_file()}


async def kept_steps(backend: CheckpointBackend, model: Model, steps: Iterable[int]) -> list[int]:
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
    backend: CheckpointBackend,
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
    backend: CheckpointBackend,
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
    excluded: set[str] = set(exclude)  # checked here too: callers may not be type-checked
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


# --------------------------------------------------------------------------- deploy


async def deploy(
    backend: CheckpointBackend,
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
