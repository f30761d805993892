"""ART's ``art.langgraph``: a LangGraph agent's rollout becomes a ``Trajectory``.

.. code-block:: python

    from langgraph.prebuilt import create_react_agent

    from artery.langgraph import init_chat_model, wrap_rollout


    async def rollout(question: str) -> art.Trajectory:
        agent = create_react_agent(init_chat_model(), tools)
        await agent.ainvoke({"messages": [("user", question)]})
        return art.Trajectory(reward=...)  # messages filled in by wrap_rollout


    trajectory = await wrap_rollout(model, rollout)("2+2?")

Needs the ``langgraph`` extra: ``pip install 'artery[langgraph]'`` (``langgraph`` and
``langchain-openai``).
"""

try:
    import langchain_core  # noqa: F401
    import langchain_openai  # noqa: F401
    import langgraph  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by test_langgraph's extra check
    raise ImportError(
        f"artery.langgraph needs the 'langgraph' extra ({exc.name} is missing): "
        "pip install 'artery[langgraph]'"
    ) from exc

from artery.langgraph.llm_wrapper import (
    CURRENT_CONFIG,
    LoggingLLM,
    RolloutConfig,
    init_chat_model,
    wrap_rollout,
)

__all__ = ["CURRENT_CONFIG", "LoggingLLM", "RolloutConfig", "init_chat_model", "wrap_rollout"]
