"""Reading the keys of a KV bucket that match a filter, in a way NATS permissions can scope.

nats.py's ``kv.watch`` creates an unnamed ordered consumer: ``$JS.API.CONSUMER.CREATE.<stream>``
with the filter in the request body, which permissions cannot see. Whoever may send that may
read every key of the bucket (and change any consumer of the stream). Here the consumer is named
and its filter is part of the subject, ``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``; the
server refuses a body whose filter differs, so a permission on
``...CREATE.KV_<bucket>.*.$KV.<bucket>.<project>.>`` lets a user read its own project's keys
only (``shared.permissions``, proven in ``tests/test_security.py``).

Services only: the name token of that subject is free, so whoever holds it may create consumers
without end and rewrite one by name. Agents hold no consumer permission at all; the publisher
lists their replicas for them (``registry.project_replicas``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

_KV_OPERATION = "KV-Operation"
_REMOVED = {"DEL", "PURGE"}
#: A read's consumer is removed by the server once nobody listens on its inbox for this long.
#: It is never deleted by the reader: deleting consumers cannot be scoped by name in
#: permissions, and an agent allowed to would delete other tenants' consumers too.
_INACTIVE_S = 5.0


def kv_stream(bucket: str) -> str:
    """The stream that holds a KV bucket."""
    return f"KV_{bucket}"


async def latest_values(
    js: JetStreamContext, bucket: str, keys: str, *, timeout_s: float = 5.0
) -> dict[str, bytes]:
    """The current value of every key of ``bucket`` matching ``keys`` (NATS wildcards allowed);
    deleted and expired keys are left out."""
    nc = js._nc  # the client the context was made from: the inbox must be on its connection
    prefix = f"$KV.{bucket}."
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)  # before the consumer exists: nothing is delivered unseen
    name = f"read_{secrets.token_hex(8)}"
    try:
        info = await js.add_consumer(
            kv_stream(bucket),
            ConsumerConfig(
                name=name,
                filter_subject=prefix + keys,
                deliver_subject=inbox,
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                ack_policy=AckPolicy.NONE,
                inactive_threshold=_INACTIVE_S,
                mem_storage=True,
                num_replicas=1,
            ),
        )
        found: dict[str, bytes] = {}
        # num_pending at creation: one message per matching key, the last of each.
        async with asyncio.timeout(timeout_s):
            for _ in range(info.num_pending or 0):  # the server always sets it on creation
                msg = await sub.next_msg(timeout=timeout_s)
                if (msg.headers or {}).get(_KV_OPERATION) in _REMOVED:
                    continue
                found[msg.subject.removeprefix(prefix)] = msg.data
        return found
    finally:
        with contextlib.suppress(Exception):  # without interest, the server removes the consumer
            await sub.unsubscribe()
