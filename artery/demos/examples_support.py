"""The frame of a training script, so that a script is its rollout and ten lines of loop.

What every example in ``examples/`` (and a user's own script) repeats around the loop: the flags
(which base model, how many steps, groups and rollouts, where the backend is), a backend (the
embedded stack, or a deployed Artery with ``--nats-url``), the model registered and served, a
litellm target for a generator or a judge (``self``: the trained model's own endpoint), one
training step recorded as a point of the reward curve, and the summary at the end::

    async with TrainingRun(args) as run:
        for _ in range(args.steps):
            step = await run.model.get_step()
            groups = await art.gather_trajectory_groups(..., pbar_desc=f"step {step} rollouts")
            await run.train(groups, reward=lambda t: t.reward)
    return run.summary()
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

from artery.backend import Backend
from artery.local import LocalBackend
from artery.model import TrainableModel
from artery.schemas import TrainConfig
from artery.trajectories import Trajectory, TrajectoryGroup

#: The tiny random Qwen2 built locally (no model hub): gibberish answers, but every path runs.
TINY = "artery/tiny-random"


def example_parser(
    doc: str,
    *,
    model_name: str,
    steps: int = 10,
    groups: int = 2,
    group_size: int = 4,
    max_tokens: int = 128,
    temperature: float = 1.0,
    learning_rate: float = 1e-2,
    groups_help: str = "inputs (groups) per step",
    group_size_help: str = "rollouts per input",
    max_tokens_help: str | None = None,
) -> argparse.ArgumentParser:
    """The flags every training script takes, with its own defaults; the script adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--base-model", default=TINY, help="a local directory or a name the stack resolves")
    p.add_argument("--steps", type=int, default=steps, help="training steps in this run")
    p.add_argument("--groups", type=int, default=groups, help=groups_help)
    p.add_argument("--group-size", type=int, default=group_size, help=group_size_help)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=max_tokens_help)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--learning-rate", type=float, default=learning_rate)
    p.add_argument("--project", default="examples")
    p.add_argument("--model-name", default=model_name, help="a re-run with the same name resumes it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend-path", default=".artery", help="LocalBackend's directory (stack, history)")
    p.add_argument("--device", default="cpu", help="LocalBackend's trainer and inference device")
    p.add_argument("--nats-url", help="join a deployed Artery (art.Backend) instead of starting one")
    p.add_argument("--inference-url", help="with --nats-url: the OpenAI-compatible base URL (.../v1)")
    return p


def add_llm_flags(p: argparse.ArgumentParser, role: str, default: str | None, what: str) -> None:
    """``--<role>-model``, ``--<role>-api-base`` and ``--<role>-api-key`` (default from
    ``ARTERY_<ROLE>_API_KEY``) for a model the script calls through litellm."""
    p.add_argument(f"--{role}-model", default=default, help=what)
    p.add_argument(f"--{role}-api-base", help=f"an OpenAI-compatible base URL for --{role}-model")
    p.add_argument(f"--{role}-api-key", default=os.environ.get(f"ARTERY_{role.upper()}_API_KEY"))


def check_llm_flags(p: argparse.ArgumentParser, args: argparse.Namespace, *roles: str) -> None:
    """An ``--<role>-api-base`` is for a model named ``openai/<name>``, not for ``self``."""
    for role in roles:
        if getattr(args, f"{role}_api_base") and getattr(args, f"{role}_model") == "self":
            p.error(f"--{role}-api-base needs --{role}-model openai/<name>, not self")


def litellm_target(
    flag: str, api_base: str | None, api_key: str | None, model: TrainableModel
) -> tuple[str, dict[str, Any]]:
    """(litellm model name, extra litellm parameters) for a ``--<role>-model`` flag; ``self`` is
    the trained model's own endpoint."""
    if flag == "self":
        params = model.litellm_completion_params()
        params["max_completion_tokens"] = 1024  # the whole answer must fit a small model's context
        return params.pop("model"), params
    extra: dict[str, Any] = {}
    if api_base:
        extra["api_base"] = api_base
    if api_base or api_key:
        extra["api_key"] = api_key or "none"
    return flag, extra


def make_backend(args: argparse.Namespace, *, service_judge: bool = False) -> Backend:
    """``art.Backend`` with ``--nats-url``, else the embedded stack on ``--device``. With
    ``service_judge``, the embedded reward service judges with ``--judge-model`` (a deployment's
    judge is its operator's to set)."""
    if args.nats_url:
        return Backend(nats_url=args.nats_url, inference_url=args.inference_url)
    backend = LocalBackend(path=args.backend_path, inference_env={"ARTERY_INFERENCE_DEVICE": args.device})
    backend.stack.extra_env["ARTERY_TRAINER_DEVICE"] = args.device
    if service_judge:
        backend.stack.extra_env["ARTERY_REWARD_JUDGE_MODEL"] = args.judge_model
        if args.judge_api_base:
            backend.stack.extra_env["ARTERY_REWARD_JUDGE_API_BASE"] = args.judge_api_base
            backend.stack.extra_env["ARTERY_REWARD_JUDGE_API_KEY"] = args.judge_api_key or "none"
    return backend


def mean(trajectories: Iterable[Trajectory], of: Callable[[Trajectory], float]) -> float:
    return statistics.fmean(of(t) for t in trajectories)


class TrainingRun:
    """A script's model on its backend, from registration to the summary.

    ``async with TrainingRun(args) as run`` registers ``run.model`` (and says when it is served);
    ``await run.train(groups, name=metric, ...)`` takes a step and records a point of the curve;
    leaving the block reads the final step and closes the backend; ``run.summary(**extra)``.
    """

    def __init__(self, args: argparse.Namespace, *, backend: Backend | None = None):
        self.args = args
        self.backend = backend or make_backend(args)
        self.model = TrainableModel(
            name=args.model_name,
            project=args.project,
            base_model=args.base_model,
            base_path=args.backend_path,
        )
        self.curve: list[dict] = []
        self.final_step: int | None = None
        self.started = time.monotonic()

    @property
    def name(self) -> str:
        return f"{self.args.project}/{self.args.model_name}"

    async def __aenter__(self) -> TrainingRun:
        try:
            print(f"registering {self.name} ({self.args.base_model})...", flush=True)
            await self.model.register(self.backend)
            if self.model.inference_base_url is None:
                raise SystemExit(
                    f"no inference replica serves {self.name}: start one (artery up --serve "
                    f"{self.name}={self.args.base_model}) or pass --inference-url"
                )
        except BaseException:
            await self.backend.close()
            raise
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.final_step = await self.model.get_step()
        finally:
            await self.backend.close()

    def ready(self, what: str = "") -> None:
        print(f"ready in {time.monotonic() - self.started:.1f}s; {what or self.model.inference_base_url}")

    async def train(
        self,
        groups: list[TrajectoryGroup],
        *,
        example: str = "",
        **metrics: Callable[[Trajectory], float],
    ) -> dict:
        """One step on ``groups``; the point records each metric's mean over the trajectories
        (``reward=lambda t: t.reward``...), the new step, whether anything trained and the loss."""
        step = await self.model.get_step()
        trajectories = [t for g in groups for t in g]
        result = await self.model.train(groups, config=TrainConfig(learning_rate=self.args.learning_rate))
        point: dict[str, Any] = {"step": step, "new_step": result.step}
        point |= {name: mean(trajectories, of) for name, of in metrics.items()}
        point |= {
            "trajectories": len(trajectories),
            "trained": bool(result.metrics.get("trained", 1.0)),
            "loss": result.metrics.get("loss"),
            "reward_trained": result.metrics.get("reward_mean"),
        }
        self.curve.append(point)
        figures = "  ".join(f"{name.replace('_', ' ')} {point[name]:.3f}" for name in metrics)
        outcome = f"loss {point['loss']:+.4f}" if point["trained"] else "nothing trained (equal rewards)"
        print(f"step {result.step:>3}: {figures}  {outcome}" + (f"  e.g. {example!r}" if example else ""))
        return point

    def summary(self, **extra: Any) -> dict:
        out = {
            "model": self.name,
            "steps": len(self.curve),
            "final_step": self.final_step,
            **extra,
            "wall_time_s": round(time.monotonic() - self.started, 1),
            "curve": self.curve,
        }
        print(
            f"done: {len(self.curve)} steps in {out['wall_time_s']}s; the model is at step {self.final_step}"
        )
        return out
