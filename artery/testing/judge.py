"""A scripted OpenAI-compatible judge for RULER tests: a real HTTP server answering set contents.

Tests of the SDK's RULER, of the reward service and of the examples talk to it over HTTP, the way
they would talk to a provider, so the whole litellm path runs. Contents are scripted either as a
list (consumed in order, the last one repeating) or as a function of the request body.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# At module level: FastAPI resolves the handler's ``Request`` annotation in this module's globals.
from fastapi import FastAPI, Request

Answer = str | Callable[[dict], str]


def scores_json(*items: tuple[str, float]) -> str:
    """The judge's structured answer: one score and explanation per trajectory id."""
    return json.dumps(
        {"scores": [{"trajectory_id": i, "explanation": f"why {i}", "score": s} for i, s in items]}
    )


class ScriptedJudge:
    """Answers ``/v1/chat/completions`` with scripted contents; records every request body."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.requests: list[dict] = []
        self.url = ""
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            self.requests.append(body)
            answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            content = answer(body) if callable(answer) else answer
            return {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "judge"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
            }

        self.app = app

    @property
    def api_base(self) -> str:
        return self.url + "/v1"

    def params(self) -> dict:
        """litellm parameters that route a call to this judge."""
        return {"api_base": self.api_base, "api_key": "x"}


@contextmanager
def serve_scripted_judge(timeout_s: float = 10.0) -> Iterator[ScriptedJudge]:
    """Run a :class:`ScriptedJudge` on a free loopback port in a background thread."""
    import uvicorn

    judge = ScriptedJudge()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(judge.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the scripted judge did not start")
        time.sleep(0.02)
    judge.url = f"http://127.0.0.1:{port}"
    try:
        yield judge
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
