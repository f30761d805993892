"""Readiness rules, the permissions behind readiness and the console's actions, the collector's
``non_finite`` for JSON's NaN literals, and the console refusing actions on an open NATS.

The real services' readiness (HTTP and NATS, every service) and the actions on a secure stack are
in ``tests/test_operations.py``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from artery.services.collector.validate import decode_group
from artery.shared import subjects
from artery.shared.errors import InvalidMessage
from artery.shared.health import Health, wsgi_health
from artery.shared.permissions import DURABLES, REPUBLISHABLE, permissions
from tests.factories import group


def test_ready_only_between_the_ready_line_and_the_stop():
    health = Health()
    heard: list[str] = []
    health.on_ready(lambda: heard.append("ready"))
    assert health.status() == (503, {"ready": False, "status": "starting"})
    health.mark_ready()
    health.mark_ready()  # the listener is told once
    assert health.ready and health.status() == (200, {"ready": True, "status": "ready"})
    assert heard == ["ready"]
    health.on_ready(lambda: heard.append("late"))  # already ready: told at once
    assert heard == ["ready", "late"]
    health.mark_stopping()
    assert not health.ready and health.status() == (503, {"ready": False, "status": "stopping"})


def test_the_metrics_server_routes_healthz_and_readyz_before_metrics(monkeypatch):
    from artery.shared import health as module

    def metrics_app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"metrics"]

    state = Health()
    monkeypatch.setattr(module, "HEALTH", state)
    app = wsgi_health(metrics_app)

    def get(path: str) -> tuple[str, bytes]:
        seen = {}
        body = b"".join(app({"PATH_INFO": path}, lambda status, headers: seen.setdefault("s", status)))
        return seen["s"], body

    assert get("/metrics") == ("200 OK", b"metrics")
    assert get("/healthz") == ("200 OK", b'{"status": "ok"}')
    status, body = get("/readyz")
    assert status == "503 Service Unavailable" and json.loads(body)["status"] == "starting"
    state.mark_ready()
    assert get("/readyz")[0] == "200 OK"


def test_permissions_for_readiness_and_the_console():
    name = subjects.HEALTH_SERVICE.format(service="collector")
    collector = permissions("collector", "collector")
    assert f"$SRV.*.{name}" in collector.subscribe and collector.allow_responses
    assert not any("artery-reward" in s for s in collector.subscribe)  # its own name only
    console = permissions("console", "console")
    # Reads, publishes nothing an event or a request could be: no events, no control, no DLQ.
    assert not [s for s in console.publish if not s.startswith("$JS.API.")]
    assert not any(
        s.startswith("$JS.API.STREAM.")
        and "MSG.GET" not in s
        and "INFO" not in s
        and not s.endswith(".NAMES")
        for s in console.publish
    )
    admin = permissions("admin", "admin")
    assert subjects.control("resume", "*", "*") in admin.publish
    assert subjects.control("pause", "*", "*") in admin.deny_publish
    assert set(REPUBLISHABLE) == {f for _, _, f in DURABLES.values()} and set(REPUBLISHABLE) <= set(
        admin.publish
    )


@pytest.mark.parametrize(
    ("value", "literal"), [(float("nan"), "NaN"), (float("inf"), "Infinity"), (float("-inf"), "-Infinity")]
)
def test_json_nan_and_infinity_literals_are_non_finite(value, literal):
    body = msgspec.to_builtins(group("demo", "agent", size=2))
    body["trajectories"][1]["reward"] = value
    data = json.dumps(body).encode()  # Python's json writes NaN/Infinity: not JSON
    with pytest.raises(InvalidMessage) as raised:
        decode_group(subjects.trajectories("demo", "agent"), data, {}, max_bytes=1 << 20, max_trajectories=8)
    assert raised.value.kind == "non_finite"
    assert raised.value.reason.startswith(f"{literal} at byte ")
    # JSON.stringify writes null: a validation error that names the field.
    data = json.dumps(body).replace(literal, "null").encode()
    with pytest.raises(InvalidMessage) as raised:
        decode_group(subjects.trajectories("demo", "agent"), data, {}, max_bytes=1 << 20, max_trajectories=8)
    assert raised.value.kind == "validation" and "trajectories[1].reward" in raised.value.reason
    # A syntax error elsewhere stays a decode error.
    with pytest.raises(InvalidMessage) as raised:
        decode_group(
            subjects.trajectories("demo", "agent"), b'{"a": Nope}', {}, max_bytes=1 << 20, max_trajectories=8
        )
    assert raised.value.kind == "decode"


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_console_actions_are_refused_on_an_open_nats(stack):
    """No credentials on the server: nothing to check the admin's against, so read-only."""
    console = stack.start_service("console")
    await asyncio.to_thread(console.wait_ready, 60)
    url = console.ready_info["url"]
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await http.post(f"{url}/actions/dead-letters/1/republish")).status_code == 401
        refused = await http.post(f"{url}/actions/dead-letters/1/republish", auth=("admin", "anything"))
        assert refused.status_code == 403 and refused.json()["detail"].startswith("read-only")
        refused = await http.post(f"{url}/actions/replicas/p/m/r1/resume", auth=("admin", "anything"))
        assert refused.status_code == 403
        # A form posted from another site's page (cached Basic credentials ride along) is refused
        # before any credential is looked at.
        for headers in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            refused = await http.post(
                f"{url}/actions/replicas/p/m/r1/resume", auth=("admin", "anything"), headers=headers
            )
            assert refused.status_code == 403 and "cross-site" in refused.json()["detail"], headers
        same = await http.post(
            f"{url}/actions/replicas/p/m/r1/resume", auth=("admin", "anything"), headers={"Origin": url}
        )
        assert same.json()["detail"].startswith("read-only")  # past the origin check
