"""What the tests of ``examples/`` share: loading a script, its ``--help``, a scripted OpenAI client,
the judge's answer by trajectory id, and the history a run wrote."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

from openai.types.chat import ChatCompletion

from artery.testing.judge import scores_json
from tests.helpers import load_script

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>/train.py`` as a module (the examples are scripts, not a package)."""
    return load_script(EXAMPLES / name / "train.py", f"example_{name}")


def script_help(name: str) -> str:
    """What ``python examples/<name>/train.py --help`` prints: the script runs on its own."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name / "train.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def completion(message: dict, token_ids: list[int] | None = None) -> ChatCompletion:
    """A response as Artery's inference service returns it: with ``token_ids``, the choice carries
    them and a logprob for each (what training uses)."""
    choice: dict = {
        "index": 0,
        "message": {"role": "assistant", **message},
        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
        choice["logprobs"] = {
            "content": [
                {"token": f"t{t}", "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in token_ids
            ]
        }
    return ChatCompletion.model_validate(
        {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    )


class FakeClient:
    """``client.chat.completions.create`` answering scripted responses, recording each request."""

    def __init__(self, responses: list[ChatCompletion]):
        self.responses = list(responses)
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **request):
        self.requests.append(json.loads(json.dumps(request)))
        return self.responses.pop(0)


def scores_by_id(body: dict) -> str:
    """The judge's answer to a request: trajectory ``i`` of ``n`` scores ``i / n``."""
    text = "\n".join(str(m.get("content")) for m in body["messages"])
    ids = re.findall(r'<trajectory id="(\d+)">', text)
    return scores_json(*((i, int(i) / len(ids)) for i in ids))


def scripted_llms(api_base: str, *roles: str) -> list[str]:
    """The flags that point each role's model (``--generator-model``, ``--judge-model``) at the
    scripted server: ``openai/<role>`` at ``api_base``."""
    flags = []
    for role in roles:
        flags += [f"--{role}-model", f"openai/{role}", f"--{role}-api-base", api_base]
    return flags


def history(backend_path: Path, model: str) -> list[dict]:
    """The rows ``model.log``/``model.train`` wrote for the project ``examples``'s ``model``."""
    path = backend_path / "examples" / "models" / model / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
