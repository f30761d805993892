"""``wrap_rollout``, ``init_chat_model`` and ``LoggingLLM``, as ART has them, on Artery's capture.

ART's ``wrap_rollout`` logs every LLM call of a LangGraph rollout to a file and rebuilds a
``Trajectory`` from the log. Here the calls are recorded where every other Artery capture records
them, over HTTP (``artery.auto_trajectory``): each chat completion the rollout makes (through
``init_chat_model()``, or any OpenAI-compatible client of its own) with the request's messages and
tools and the response's choice, the sampled ``token_ids`` and logprobs included. So a LangGraph
trajectory trains on exactly the tokens the engine sampled, as a hand-written agent's does.

When the rollout returns, the longest conversation becomes the trajectory's
``messages_and_choices`` (and its ``tools``), every other one (a sub-agent, a summariser, a
structured-output call that did not continue the conversation) one of its
``additional_histories``, and the served ``<model>@<step>`` its policy versions.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from artery.auto_trajectory import capture_auto_trajectory
from artery.trajectories import Trajectory

__all__ = ["CURRENT_CONFIG", "LoggingLLM", "RolloutConfig", "init_chat_model", "wrap_rollout"]

#: ART's 10-minute bound on one ``ainvoke``.
INVOKE_TIMEOUT_S = 10 * 60

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """What ``init_chat_model()`` reads inside a wrapped rollout (ART keeps the same in a dict)."""

    thread_id: str
    base_url: str | None
    api_key: str | None
    model: str
    #: The registered model's HTTP client (replica routing, trace context, chat-template kwargs).
    http_async_client: Any = None


CURRENT_CONFIG: contextvars.ContextVar[RolloutConfig] = contextvars.ContextVar("CURRENT_CONFIG")


def wrap_rollout(
    model: Any, fn: Callable[..., Awaitable[Trajectory | None]]
) -> Callable[..., Awaitable[Trajectory]]:
    """``fn`` (a LangGraph rollout returning a ``Trajectory``, e.g. with its reward set) wrapped so
    that its chat completions become the trajectory's messages (see the module's docstring).

    A rollout that made no chat completion returns its trajectory unchanged; one that returns
    ``None`` gets the captured trajectory."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Trajectory:
        token = CURRENT_CONFIG.set(_rollout_config(model))
        returned: list[Trajectory | None] = []

        async def run() -> None:
            returned.append(await fn(*args, **kwargs))

        try:
            captured = await capture_auto_trajectory(run())
        finally:
            CURRENT_CONFIG.reset(token)
        return _merge(returned[0], captured)

    return wrapper


def _rollout_config(model: Any) -> RolloutConfig:
    client = None
    if getattr(model, "inference_base_url", None) and hasattr(model, "openai_client"):
        # The same httpx client as model.openai_client(): its requests follow the model's live
        # replicas and carry the rollout's trace context (artery.completion spans).
        client = getattr(model.openai_client(), "_client", None)
    return RolloutConfig(
        thread_id=str(uuid.uuid4()),
        base_url=model.inference_base_url,
        api_key=model.inference_api_key or "artery",
        model=model.inference_model_name or model.name,
        http_async_client=client,
    )


def _merge(result: Trajectory | None, captured: Trajectory) -> Trajectory:
    if result is None:
        return captured
    if not isinstance(result, Trajectory):
        raise TypeError(f"a wrapped rollout must return an art.Trajectory (or None), not {type(result)}")
    if not captured.messages_and_choices:
        return result  # no chat completion: nothing to replace
    result.messages_and_choices = captured.messages_and_choices
    result.tools = captured.tools
    result.additional_histories = [*captured.additional_histories, *result.additional_histories]
    if result.initial_policy_version is None:
        result.initial_policy_version = captured.initial_policy_version
    if result.final_policy_version is None:
        result.final_policy_version = captured.final_policy_version
    return result


def current_config() -> RolloutConfig:
    try:
        return CURRENT_CONFIG.get()
    except LookupError:
        raise RuntimeError(
            "init_chat_model() is called inside a rollout wrapped by "
            "artery.langgraph.wrap_rollout(model, fn): that is where it finds the model"
        ) from None


def _chat_openai(config: RolloutConfig, **kwargs: Any) -> ChatOpenAI:
    settings: dict[str, Any] = {"temperature": 1.0, "logprobs": True, **kwargs}
    if config.http_async_client is not None:
        settings.setdefault("http_async_client", config.http_async_client)
    # ChatOpenAI would make the SecretStr from a str itself; its signature asks for one.
    api_key = SecretStr(config.api_key) if config.api_key is not None else None
    return ChatOpenAI(base_url=config.base_url, api_key=api_key, model=config.model, **settings)


def init_chat_model(
    model: Literal[None] = None,
    *,
    model_provider: str | None = None,
    configurable_fields: Literal[None] = None,
    config_prefix: str | None = None,
    **kwargs: Any,
) -> LoggingLLM:
    """The chat model of the wrapped rollout's ``art.Model`` (as in ART: a ``LoggingLLM`` around a
    ``ChatOpenAI`` at temperature 1). ``model`` and ``model_provider`` are LangChain's and are
    ignored, as ART does; other keyword arguments (``max_tokens``, ``temperature``, ...) go to
    ``ChatOpenAI``. Logprobs are asked for unless ``logprobs=False``."""
    return LoggingLLM(_chat_openai(current_config(), **kwargs))


class LoggingLLM(Runnable):
    """ART's wrapper around the rollout's ``ChatOpenAI``: a 10-minute bound on ``ainvoke``, tool
    arguments as dicts, ``with_structured_output`` through a tool call. The recording itself is
    the HTTP capture of ``wrap_rollout``, so ``logger`` is kept for ART's signature only."""

    def __init__(self, llm: Any, logger: Any = None, structured_output: Any = None, tools: Any = None):
        self.llm = llm
        self.logger = logger
        self.structured_output = structured_output
        self.tools = [convert_to_openai_tool(t) for t in tools] if tools else None

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._finish(self.llm.invoke(input, config=config, **kwargs))

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        result = await asyncio.wait_for(self.llm.ainvoke(input, config=config, **kwargs), INVOKE_TIMEOUT_S)
        return self._finish(result)

    def _finish(self, result: Any) -> Any:
        if hasattr(result, "get") and result.get("parsed"):
            return result.get("parsed")
        for call in getattr(result, "tool_calls", None) or []:
            if isinstance(call.get("args"), str):
                call["args"] = json.loads(call["args"])
        if self.structured_output is not None:
            calls = getattr(result, "tool_calls", None)
            if calls:
                return self.structured_output.model_validate(calls[0]["args"])
            return self.structured_output.model_validate(json.loads(result.content))
        return result

    def bind_tools(self, tools: Any, **kwargs: Any) -> LoggingLLM:
        return LoggingLLM(self.llm.bind_tools(tools, **kwargs), self.logger, tools=tools)

    def with_structured_output(self, schema: Any, **kwargs: Any) -> LoggingLLM:
        return LoggingLLM(
            self.llm.bind_tools([schema]),
            self.logger,
            structured_output=schema,
            tools=[schema],
        )

    def with_retry(self, **kwargs: Any) -> LoggingLLM:
        return self  # as ART: retries belong to the rollout, which can be retried whole

    def with_config(self, config: RunnableConfig | None = None, **kwargs: Any) -> LoggingLLM:
        """As ART: the chat model of the current rollout again, with ``max_tokens`` from ``config``
        when it sets one (tools already bound stay bound)."""
        max_tokens = (config or {}).get("max_tokens") or kwargs.get("max_tokens")
        chat = _chat_openai(current_config(), **({"max_tokens": max_tokens} if max_tokens else {}))
        if hasattr(self.llm, "bound"):
            llm = self.llm.__class__(bound=chat, kwargs=self.llm.kwargs, config=self.llm.config)
        else:
            llm = chat
        clone = LoggingLLM(llm, self.logger, structured_output=self.structured_output)
        clone.tools = self.tools
        return clone
