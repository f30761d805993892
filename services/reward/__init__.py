"""The reward service: scores groups that asked for an LLM judge (RULER) and announces the rewards."""
