"""The trainer service: GRPO steps on a LoRA adapter from scored trajectory groups.

The math (group advantages, the loss variants) and the data preparation (trajectories to training
sequences) are pure functions in their own modules, with no NATS, database or service code, so they
are unit-tested on the CPU against hand-computed values and against TRL.
"""
