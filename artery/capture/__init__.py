"""Capture scopes and exchanges: every model call a rollout makes over HTTP, recorded.

``with art.Trajectory() as t:`` (or ``await art.trajectory(coro)``) opens a scope; each POST to a
``/chat/completions``, ``/completions``, ``/responses`` or ``/messages`` path made inside it,
through httpx, aiohttp or requests, becomes an exchange of ``t.exchanges``: the raw request, the
native response (streams put back together), the served model and the times. When the trajectory
is sent, its exchanges become the chat messages and samples training uses (``to_messages``).

This package's ``__init__`` imports nothing: ``artery.trajectories`` uses its modules, and
``api`` (the public scope functions) uses ``artery.trajectories``.
"""
