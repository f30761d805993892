"""Any language can publish trajectories: a Node.js script (npm ``nats``, no Python) publishes
trajectory groups written from the wire contract, and the real collector process stores them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from artery.schemas import DeadLetter
from artery.shared import subjects
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "node-publisher"
JSON_SCHEMA = ROOT / "schemas" / "generated" / "jsonschema" / "trajectory_group.json"
NODE = shutil.which("node")
NPM = shutil.which("npm")
PROJECT, MODEL = "demo", "node-agent"
TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-0[01]$")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        NODE is None or NPM is None, reason="Node.js and npm are needed on PATH for the Node publisher"
    ),
]


def _installed_nats_version() -> str | None:
    try:
        return json.loads((EXAMPLE / "node_modules" / "nats" / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def node_publisher() -> Path:
    """The example with its dependencies installed; ``npm ci`` runs only when they are missing
    or differ from the pinned version, so later runs reuse ``node_modules``."""
    pinned = json.loads((EXAMPLE / "package.json").read_text())["dependencies"]["nats"]
    if _installed_nats_version() != pinned:
        result = subprocess.run(
            [NPM, "ci", "--no-audit", "--no-fund"],
            cwd=EXAMPLE,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            pytest.skip(f"npm ci failed (is the npm registry reachable?): {result.stderr[-2000:]}")
        assert _installed_nats_version() == pinned
    return EXAMPLE / "publish.mjs"


async def run_node(script: Path, env: dict[str, str], timeout: float = 60.0) -> list[dict]:
    proc = await asyncio.create_subprocess_exec(
        NODE,
        script.name,
        cwd=script.parent,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, f"node exited {proc.returncode}: {stderr.decode()}"
    return [json.loads(line) for line in stdout.decode().splitlines() if line.strip()]


async def dead_letters(js) -> list[DeadLetter]:
    info = await js.stream_info(subjects.DLQ.name)
    letters = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        raw = await js.get_msg(subjects.DLQ.name, seq)
        letters.append(msgspec.json.decode(raw.data, type=DeadLetter))
    return letters


def validate_json_schema(payload: dict) -> None:
    """Check the payload against the generated JSON Schema, when that document exists."""
    if not JSON_SCHEMA.exists():
        return
    import jsonschema

    schema = json.loads(JSON_SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(payload)


async def test_node_publisher_groups_are_stored(node_publisher, stack, js, db, nats_server):
    # ``js`` has provisioned the streams, so the publish is acked even before the collector is up.
    stack.start_service("collector")
    printed = await run_node(
        node_publisher,
        {
            "ARTERY_NATS_URL": nats_server.url,
            "ARTERY_PROJECT": PROJECT,
            "ARTERY_MODEL": MODEL,
            "ARTERY_GROUPS": "3",
        },
    )
    assert len(printed) == 3
    assert len({p["id"] for p in printed}) == 3
    assert all(p["stream"] == subjects.TRAJECTORIES.name and isinstance(p["seq"], int) for p in printed)

    # What the script sent, exactly as the stream holds it: headers per the contract.
    sent: dict[str, dict] = {}
    for p in printed:
        raw = await js.get_msg(subjects.TRAJECTORIES.name, p["seq"])
        assert raw.subject == subjects.trajectories(PROJECT, MODEL)
        headers = raw.headers or {}
        assert headers.get("Nats-Msg-Id") == f"{PROJECT}.{MODEL}.{p['id']}"
        assert headers.get("Content-Type") == "application/json"
        assert headers.get("Artery-Schema") == "1"
        assert headers.get("Artery-Event") == "trajectory_group"
        assert TRACEPARENT.match(headers.get("traceparent", "")), headers
        payload = json.loads(raw.data)
        assert payload["event"] == "trajectory_group" and payload["id"] == p["id"]
        validate_json_schema(payload)
        sent[p["id"]] = payload

    ids = list(sent)
    collector_log = stack.logs / "collector.log"

    def why() -> str:
        text = collector_log.read_text()[-3000:] if collector_log.exists() else "(no log)"
        return f"\ncollector log:\n{text}"

    async def stored():
        groups = await db.fetchval("SELECT count(*) FROM trajectory_groups WHERE id = ANY($1)", ids)
        rows = await db.fetchval("SELECT count(*) FROM trajectories WHERE group_id = ANY($1)", ids)
        return groups == 3 and rows == 12

    try:
        await wait_for(stored, timeout=30, why=why)
    except AssertionError:
        letters = await dead_letters(js)
        raise AssertionError(f"dead letters: {[(d.kind, d.reason) for d in letters]}{why()}") from None

    for group_id, payload in sent.items():
        row = await db.fetchrow("SELECT * FROM trajectory_groups WHERE id = $1", group_id)
        assert (row["project"], row["model"], row["split"]) == (PROJECT, MODEL, "train")
        assert row["num_trajectories"] == 4 and row["num_exceptions"] == 0
        assert row["metadata"] == payload["metadata"]
        assert row["metrics"] == payload["metrics"]
        assert row["needs_reward"] is False
        assert row["stream_seq"] == next(p["seq"] for p in printed if p["id"] == group_id)
        rows = await db.fetch(
            "SELECT idx, reward, body FROM trajectories WHERE group_id = $1 ORDER BY idx", group_id
        )
        assert [r["idx"] for r in rows] == [0, 1, 2, 3]
        rewards = [r["reward"] for r in rows]
        assert rewards == [t["reward"] for t in payload["trajectories"]]
        assert len(set(rewards)) == 4
        for r, t in zip(rows, payload["trajectories"], strict=True):
            body = r["body"]
            assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant"]
            assert body["metadata"]["verdict"] == t["metadata"]["verdict"]
            assert body["metadata"] == t["metadata"]
            sample = body["messages"][2]["sample"]
            assert sample["token_ids"] == t["messages"][2]["sample"]["token_ids"]
            assert sample["logprobs"] == t["messages"][2]["sample"]["logprobs"]
            assert sample["finish_reason"] == "stop"

    assert await dead_letters(js) == []
    info = await js.stream_info(subjects.DLQ.name)
    assert info.state.messages == 0
