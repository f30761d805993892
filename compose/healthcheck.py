"""Docker healthcheck for the Artery images (standard library only; copied to /opt/artery/).

python /opt/artery/healthcheck.py http URL
    healthy when URL answers 2xx (the inference replica's /health).
python /opt/artery/healthcheck.py nats CLIENT_NAME MONITOR_URL
    healthy when the NATS server's monitoring endpoint lists a client connection named
    CLIENT_NAME (every service connects as ``artery-<service>``) coming from this container.
    The collector, reward, trainer and publisher serve no HTTP, so their link to NATS is
    what is checked: a service connects once its settings are valid and stays connected
    (reconnecting by itself) while it runs.
"""

from __future__ import annotations

import json
import socket
import sys
import urllib.request

TIMEOUT_S = 5.0


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        return 200 <= response.status < 300


def own_addresses() -> set[str]:
    addresses = {"127.0.0.1"}
    hostname = socket.gethostname()
    try:
        addresses.update(info[4][0] for info in socket.getaddrinfo(hostname, None))
    except OSError:
        pass
    return addresses


def nats_client_connected(name: str, monitor_url: str) -> bool:
    url = f"{monitor_url.rstrip('/')}/connz?limit=100000"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        connections = json.load(response).get("connections") or []
    mine = own_addresses()
    return any(c.get("name") == name and c.get("ip") in mine for c in connections)


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 2 and argv[0] == "http":
            healthy = http_ok(argv[1])
        elif len(argv) == 3 and argv[0] == "nats":
            healthy = nats_client_connected(argv[1], argv[2])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (OSError, ValueError) as exc:  # refused, timed out, HTTP error, bad JSON
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    if not healthy:
        print("unhealthy", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
