"""The demos (``make demo``: ``demo``; ``make demo-agent``: ``demo_agent``) and what the example
agents under ``examples/`` share (``examples_support``)."""
