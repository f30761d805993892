"""``make demo-agent``: SmolLM2-135M-Instruct learns a multi-turn tool-using task, through every service.

The agent is asked arithmetic questions (``task``) and offered one tool, a calculator, through
the OpenAI ``tools`` parameter; the inference service parses the model's Hermes tool calls, the
agent (``agent``) runs them and returns ``role="tool"`` messages, and the model answers. The
reward is programmatic (``task.reward``), or a RULER judge's (``--judge-model``). Held-out
questions are evaluated before and after training (``evaluate``); ``run`` writes ``summary.json``
(the shape of ``make demo``'s) and ``reward_curve.png``. ``python -m artery.demos.demo_agent --help``.
"""
