"""One trace follows a rollout through every service, exported by the real OTLP/HTTP exporter.

Every service process is started with ``ARTERY_OTEL_ENDPOINT`` pointing at a receiver the test
runs, and with a batch delay longer than the test: the spans arrive only because each process
flushes them on its way out. The agent (this process) exports to the same receiver.
"""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor

import artery as art
from artery.shared.models import TINY
from artery.shared.tracing import (
    LINKS_HEADER,
    extract_links,
    link_headers,
    setup_sdk_tracing,
    span_context_of,
    traceparent,
)
from artery.testing.agents import half_alphabet_rollout
from artery.testing.otlp import OtlpReceiver, ReceivedSpan

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CORE = {"inference", "collector", "trainer", "publisher"}


def chain(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[tuple[str, str]]:
    """``(service, name)`` from ``span`` up to its trace's root."""
    out = []
    while span is not None:
        out.append((span.service, span.name))
        span = by_id.get(span.parent_span_id) if span.parent_span_id else None
    return out


def only(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


async def test_one_trace_follows_a_rollout_from_completion_to_adapter_load(tmp_path):
    with OtlpReceiver() as receiver:
        provider = setup_sdk_tracing()
        agent_exporter = BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces"))
        provider.add_span_processor(agent_exporter)
        backend = art.LocalBackend(path=tmp_path / "artery")
        backend.stack.extra_env.update(
            {
                "ARTERY_OTEL_ENDPOINT": receiver.endpoint,
                # Nothing is exported on a timer during the test: only the flush at exit.
                "OTEL_BSP_SCHEDULE_DELAY": "600000",
            }
        )
        model = art.TrainableModel(name="traced", project="traces", base_model=TINY)
        try:
            await model.register(backend)
            with trace.get_tracer("agent").start_as_current_span("agent.episode") as root:
                groups = await art.gather_trajectory_groups(
                    [art.TrajectoryGroup(half_alphabet_rollout(model, max_tokens=4) for _ in range(2))],
                    pbar_desc="rollouts",
                )
                result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
            assert result.step == 1
        finally:
            agent_exporter.force_flush()
            agent_exporter.shutdown()  # the provider outlives this test; its exporter does not
            await backend.close()  # SIGTERM: every service flushes its spans before exiting

        trace_id = format(root.get_span_context().trace_id, "032x")
        assert result.trace_id == trace_id
        assert receiver.wait_for(lambda spans: {s.service for s in spans if s.trace_id == trace_id} >= CORE)
        spans = receiver.trace(trace_id)

    services = {s.service for s in spans}
    assert len(services) >= 5 and services >= CORE, services
    by_id = {s.span_id: s for s in spans}
    # A parent chain: one root (the agent's), every other span's parent recorded in the trace.
    assert [s.name for s in spans if s.parent_span_id is None] == ["agent.episode"]
    orphans = [(s.service, s.name) for s in spans if s.parent_span_id and s.parent_span_id not in by_id]
    assert not orphans, orphans

    agent = only(spans, "agent.episode").service
    # The replica shares the trainer's machine: it loads the adapter as soon as it is saved (a child
    # of the step), while the publisher copies it into the Object Store beside it.
    assert chain(only(spans, "inference.load_adapter"), by_id) == [
        ("inference", "inference.load_adapter"),
        ("trainer", "trainer.step"),
        (agent, "artery.train"),
        (agent, "agent.episode"),
    ]
    assert chain(only(spans, "publisher.publish_checkpoint"), by_id) == [
        ("publisher", "publisher.publish_checkpoint"),
        ("trainer", "trainer.step"),
        (agent, "artery.train"),
        (agent, "agent.episode"),
    ]
    stored = [s for s in spans if s.name == "collector.store_group"]
    assert len(stored) == 1
    assert chain(stored[0], by_id) == [
        ("collector", "collector.store_group"),
        (agent, "artery.submit_group"),
        (agent, "artery.train"),
        (agent, "agent.episode"),
    ]
    completions = [s for s in spans if s.name == "inference.chat_completion"]
    assert len(completions) == 2
    for completion in completions:
        assert chain(completion, by_id) == [
            ("inference", "inference.chat_completion"),
            (agent, "artery.completion"),
            (agent, "artery.rollout"),
            (agent, "artery.group"),
            (agent, "agent.episode"),
        ]
    # The step links to the submission of every group it trained on; each submission to the
    # span its group's rollouts ran in.
    step = only(spans, "trainer.step")
    submissions = [s for s in spans if s.name == "artery.submit_group"]
    assert len(submissions) == 1 and {(trace_id, s.span_id) for s in submissions} <= set(step.links)
    assert submissions[0].links == ((trace_id, only(spans, "artery.group").span_id),)

    # Log lines written while the trace's messages were handled name it.
    lines = [
        json.loads(line)
        for path in sorted((tmp_path / "artery" / "stack" / "logs").glob("*.log"))
        if not path.name.startswith(("nats", "postgres"))
        for line in path.read_text().splitlines()
        if line.startswith("{")
    ]
    traced = {(line.get("service"), line.get("event")) for line in lines if line.get("trace_id") == trace_id}
    assert ("trainer", "trained") in traced, traced
    assert ("publisher", "published") in traced, traced
    assert ("inference", "adapter loaded") in traced, traced


def test_links_travel_in_a_header():
    a = trace.SpanContext(0xA1, 0xB1, is_remote=False, trace_flags=trace.TraceFlags(1))
    b = trace.SpanContext(0xA2, 0xB2, is_remote=False, trace_flags=trace.TraceFlags(1))
    headers = link_headers({}, [a, None, trace.INVALID_SPAN_CONTEXT, b])
    assert headers[LINKS_HEADER] == f"{traceparent(a)},{traceparent(b)}"
    links = extract_links({**headers, LINKS_HEADER: headers[LINKS_HEADER] + ",garbage"})
    assert [(link.context.trace_id, link.context.span_id) for link in links] == [(0xA1, 0xB1), (0xA2, 0xB2)]
    assert span_context_of("not-a-traceparent") is None
    assert extract_links({}) == [] and link_headers({}, []) == {}
