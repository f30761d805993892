"""structlog as JSON lines (or console for people), each line with the current trace and span ids."""

from __future__ import annotations

import logging
import sys

import structlog

from artery.shared.tracing import current_span_id, current_trace_id


def _add_trace_id(_, __, event_dict):
    """``trace_id`` / ``span_id`` of the current span: a line written while a message is handled
    names the trace that message belongs to."""
    trace_id = current_trace_id()
    if trace_id:
        event_dict.setdefault("trace_id", trace_id)
        event_dict.setdefault("span_id", current_span_id())
    return event_dict


def setup_logging(service: str, level: str = "info", fmt: str = "json") -> None:
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_id,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None):
    return structlog.get_logger(name)
