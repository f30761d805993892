"""ART's checkpoint transport against a real S3-compatible server (moto's server mode, started
here on a free port): a trained step pushed from one LocalBackend and pulled into a new one is the
same adapter and trainer state, is served there as ``name@step``, and training continues from it."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import subprocess
import sys
import time
import urllib.request
import warnings
import zipfile
from pathlib import Path

import boto3
import pytest

import artery as art
from artery import s3 as transport
from artery.shared.embedded import free_port
from artery.shared.models import TINY
from artery.testing.agents import half_alphabet_rollout
from artery.testing.tasks import half_alphabet_task_prompt

BUCKET = "artery-backups"
SERVICES = ("collector", "trainer", "publisher")


@pytest.fixture
def s3_server(tmp_path, monkeypatch):
    """moto's S3 server on a free port; boto3 is pointed at it through ART's variables."""
    port = free_port()
    log = open(tmp_path / "moto.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # ready when it answers HTTP
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=1):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    f"moto_server did not start: {(tmp_path / 'moto.log').read_text()}"
                ) from None
            time.sleep(0.1)
    for name, value in {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "BACKUP_BUCKET": BUCKET,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield url
    process.terminate()
    process.wait(timeout=10)
    log.close()


@pytest.fixture
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's and transformers' advice about tiny models
        yield


def bucket_keys(prefix: str) -> dict[str, bytes]:
    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {
        o["Key"][len(prefix) :]: s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed
    }


async def train_one_step(model: art.TrainableModel) -> art.TrainResult:
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=8) for _ in range(6)) for _ in range(2)),
        pbar_desc="rollouts",
    )
    return await model.train(groups, config=art.TrainConfig(learning_rate=2e-2))


async def greedy(model: art.TrainableModel, step: int) -> list[int]:
    response = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step),
        messages=half_alphabet_task_prompt(),
        max_tokens=12,
        temperature=0,
    )
    return response.choices[0].model_extra["token_ids"]


def step_dir(backend: art.LocalBackend, model: art.TrainableModel, step: int) -> Path:
    return transport.checkpoint_root(backend, model) / f"{step:06d}"


def download(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


RESUMABLE = ("adapter/adapter_model.safetensors", "adapter/adapter_config.json", "adapter.tar")
TRAINER_STATE = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "step.json")


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_pushed_step_pulled_into_a_new_backend_is_served_and_trained_on(tmp_path, s3_server, _quiet):
    first = art.LocalBackend(path=tmp_path / "first", services=SERVICES)
    model = art.TrainableModel(name="agent-001", project="s3-transport", base_model=TINY)
    try:
        await model.register(first)
        # Pushed before any step, as ART's examples do at the top of their loop: nothing to send
        # but the model's identity, and no error.
        await first._experimental_push_to_s3(model, prefix="runs")
        result = await train_one_step(model)
        assert result.step == 1 and result.metrics["tokens_trained"] > 0
        await first._experimental_push_to_s3(model, prefix="runs")
        pushed = bucket_keys("runs/s3-transport/models/agent-001/")
        for key in (
            "checkpoints/0001/adapter_config.json",
            "checkpoints/0001/adapter_model.safetensors",
            "checkpoints/0001/trainer/optimizer.safetensors",
            "checkpoints/0001/trainer/trainer_state.json",
            "history.jsonl",
            "model.json",
        ):
            assert key in pushed, sorted(pushed)
        trained = step_dir(first, model, 1)
        assert pushed["checkpoints/0001/adapter_model.safetensors"] == (trained / RESUMABLE[0]).read_bytes()
        served_first = await greedy(model, 1)
        expected = {name: digest(trained / name) for name in RESUMABLE + TRAINER_STATE}
        first_state = json.loads((trained / "trainer_state.json").read_text())
        history = (Path(model.directory) / "history.jsonl").read_text()
    finally:
        await first.close()

    second = art.LocalBackend(path=tmp_path / "second", services=SERVICES)
    again = art.TrainableModel(name="agent-001", project="s3-transport", base_model=TINY)
    try:
        # ART's order: pull before register (the model's record is written by the pull).
        await second._experimental_pull_from_s3(again, prefix="runs")
        await again.register(second)
        assert await again.get_step() == 1
        restored = step_dir(second, again, 1)
        assert {name: digest(restored / name) for name in expected} == expected
        pulled = Path(again.directory)
        assert pulled.is_relative_to(tmp_path / "second")
        assert (pulled / "history.jsonl").read_text() == history
        assert (pulled / "checkpoints" / "0001" / "adapter_model.safetensors").is_file()  # ART's layout
        assert await greedy(again, 1) == served_first

        result = await train_one_step(again)
        assert result.step == 2 and result.metrics["tokens_trained"] > 0
        # The trainer started from the pulled adapter, the one the replica sampled with: its
        # probabilities of the sampled tokens are the sampler's (the base model's would not be).
        assert result.metrics["ratio_mean"] == pytest.approx(1.0, abs=2e-3)
        state = json.loads((step_dir(second, again, 2) / "trainer_state.json").read_text())
        assert state["optimizer_steps"] > first_state["optimizer_steps"]  # AdamW went on, not anew

        # A second pull of what is already here changes nothing.
        await second._experimental_pull_from_s3(again, prefix="runs", only_step="latest")
        assert await again.get_step() == 2

        # An adapter without Artery's trainer state (what ART itself pushes) is said to be one.
        boto3.client("s3").put_object(
            Bucket=BUCKET,
            Key="runs/s3-transport/models/from-art/checkpoints/0003/adapter_config.json",
            Body=(restored / "adapter" / "adapter_config.json").read_bytes(),
        )
        other = art.TrainableModel(name="from-art", project="s3-transport", base_model=TINY)
        with pytest.raises(transport.S3TransportError, match=r"without Artery's trainer state.*warm start"):
            await second._experimental_pull_from_s3(other, prefix="runs")
        with pytest.raises(LookupError, match=r"step 7 is not in .*there: \[1\]"):
            await second._experimental_pull_from_s3(again, prefix="runs", only_step=7)

        # Deploy: ART's steps up to the vendor's API (the zipped adapter and a presigned URL to
        # it), then a clear refusal, since Artery calls no vendor.
        with pytest.raises(transport.DeploymentUnsupported, match="'together'") as raised:
            await second._experimental_deploy("together", again, pull_s3=False, prefix="runs")
        assert (
            raised.value.s3_uri == f"s3://{BUCKET}/runs/s3-transport/models/agent-001/zipped-steps/0002.zip"
        )
        archive = await asyncio.to_thread(download, raised.value.url)  # the presigned URL works
        names = zipfile.ZipFile(io.BytesIO(archive)).namelist()
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(names)
    finally:
        await second.close()


async def test_the_bucket_comes_from_the_call_or_backup_bucket(monkeypatch):
    model = art.TrainableModel(name="m", project="p", base_model=TINY)
    monkeypatch.delenv("BACKUP_BUCKET", raising=False)
    with pytest.raises(transport.S3TransportError, match="BACKUP_BUCKET"):
        transport.location(model, None, None)
    monkeypatch.setenv("BACKUP_BUCKET", "from-env")
    assert transport.location(model, None, "/team/x/").uri == "s3://from-env/team/x/p/models/m/"
    assert transport.location(model, "given", None).uri == "s3://given/p/models/m/"


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/abs", "a\\b", ""])
def test_object_keys_that_would_leave_the_model_directory_are_refused(key):
    with pytest.raises(transport.S3TransportError, match="not a plain relative path"):
        transport._safe_relative(key)
