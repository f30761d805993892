"""Trainer step benchmark: one Artery GRPO step against one TRL ``GRPOTrainer`` step, same model and shapes.

What runs, in this process, on the same device and the same tiny random Qwen2 (``artery/tiny-random``):

- Artery: ``Policy`` (transformers + PEFT) and ``Policy.train_step``; the completions come from
  ``model.generate`` through ``artery.testing.tasks.sample_trajectories`` (what the inference
  service would have sampled: token ids, logprobs, decoded text, reward).
- TRL: ``GRPOTrainer`` with a small in-memory dataset of the same prompt, the same reward function,
  no vLLM, ``report_to=[]``, output in a temporary directory.

Same for both: ``groups`` x ``group_size`` completions per step (TRL: ``per_device_train_batch_size =
groups * group_size``, ``num_generations = group_size``), at most ``max_new_tokens`` new tokens at
temperature 1 with no top-k/top-p, the dapo loss (eps 0.2 / 0.28, no KL), AdamW (betas 0.9/0.99,
weight decay 0.1, max grad norm 1), all sequences of a step in one forward pass, and the same LoRA
(r 8, alpha 16, no dropout) on q/k/v/o/gate/up/down. TRL refuses LoRA on ``lm_head`` (it computes
logprobs from ``lm_head.weight`` directly), so this comparison leaves ``lm_head`` out for both;
Artery's default includes it (the tiny model only learns with it), and a last row times that.
The learning rate is small (1e-5) so that the completions keep the same length over the run.

What each number includes (per step, wall clock):

- ``artery generate``: one ``model.generate`` call for all the step's completions (as TRL makes;
  the prompt is the same), cut into groups; the logprobs of the sampled tokens from
  the generation logits, decoding, the reward, building wire ``Trajectory`` objects.
- ``artery train_step``: advantages, chat-template rendering and sample splicing of every
  trajectory, padding, forward, loss, backward, clipping, the AdamW step. Training only.
- ``artery full step``: the two above, back to back, in the same step.
- ``trl generate+score``: TRL's ``_generate_and_score_completions`` (prompt templating, generation,
  reward, advantages, and whatever logprob passes TRL makes there), timed by wrapping it.
- ``trl full step``: ``on_step_begin`` to ``on_step_end`` of the HF Trainer loop: the above, then the
  forward/backward, clipping and the optimizer step (TRL's own step, generation included).
- ``trl train only``: full step minus generate+score, step by step.

Rounds alternate the two (Artery's steps, then TRL's) so that whatever else runs on the machine
weighs on both; the first steps of each are warm-up and not counted. torch runs with ``--threads``
intra-op threads (1 by default: on a shared 2-core machine more threads make a tiny model's step
times jump by 10-50x whenever another process wants a core).

Long module: one benchmark, read top to bottom: the two runners (Artery's policy, TRL's trainer) on the
same groups, the result and its table. What every benchmark shares is ``loadtests/harness.py``.
"""

from __future__ import annotations

import datetime as dt
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtests import harness
from loadtests.harness import argv_of, load_average, machine, report, sync_device, table

TARGETS_WITHOUT_LM_HEAD = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEARNING_RATE = 1e-5


@dataclass(frozen=True, kw_only=True)
class Config:
    groups: int
    group_size: int
    max_new_tokens: int
    steps: int
    warmup: int
    rounds: int
    threads: int
    device: str
    quick: bool
    seed: int
    output: Path


def _stats(values: list[float]) -> dict[str, Any]:
    ordered = sorted(values)
    return {
        "n": len(values),
        "median_ms": round(1000 * statistics.median(ordered), 2),
        "mean_ms": round(1000 * statistics.fmean(ordered), 2),
        "min_ms": round(1000 * ordered[0], 2),
        "p90_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 2),
    }


# --------------------------------------------------------------------------- Artery


class ArteryRunner:
    def __init__(self, config: Config, model_path: str, target_modules: tuple[str, ...]) -> None:
        from artery.schemas import TrainConfig
        from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy

        self.config = config
        self.policy = Policy.create(
            model_path,
            LoraSettings(rank=8, alpha=16, dropout=0.0, target_modules=target_modules),
            OptimSettings(micro_batch_size=config.groups * config.group_size, max_grad_norm=1.0),
            device=config.device,
            seed=config.seed,
        )
        self.train_config = TrainConfig(
            learning_rate=LEARNING_RATE, loss_fn="dapo", epsilon=0.2, epsilon_high=0.28
        )
        self.generate_s: list[float] = []
        self.train_s: list[float] = []
        self.completion_tokens: list[float] = []
        self.trained: list[bool] = []

    def step(self, record: bool) -> None:
        from artery.testing.tasks import half_alphabet_reward, half_alphabet_task_prompt, sample_trajectories

        policy, config = self.policy, self.config
        started = time.perf_counter()
        policy.model.eval()
        # One generate call for every completion of the step, as TRL makes (the prompt is the same),
        # then cut into groups.
        samples = sample_trajectories(
            policy.model,
            policy.tokenizer,
            half_alphabet_task_prompt(),
            half_alphabet_reward,
            n=config.groups * config.group_size,
            max_new_tokens=config.max_new_tokens,
        )
        size = config.group_size
        groups = [samples[i : i + size] for i in range(0, len(samples), size)]
        sync_device(config.device)
        generated = time.perf_counter()
        result = policy.train_step(groups, self.train_config, max_seq_len=512)
        sync_device(config.device)
        finished = time.perf_counter()
        if record:
            self.generate_s.append(generated - started)
            self.train_s.append(finished - generated)
            tokens = [len(t.messages[-1].sample.token_ids) for g in groups for t in g]
            self.completion_tokens.append(statistics.fmean(tokens))
            self.trained.append(result.trained)


# --------------------------------------------------------------------------- TRL


class TrlRunner:
    """A fresh ``GRPOTrainer`` per round (``train()`` builds its optimizer and loop each call)."""

    def __init__(self, config: Config, model_path: str) -> None:
        self.config = config
        self.model_path = model_path
        self.step_s: list[float] = []
        self.generate_s: list[float] = []
        self.completion_tokens: list[float] = []

    def run(self, steps: int, warmup: int) -> None:
        import torch
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from artery.testing.tasks import half_alphabet_reward, half_alphabet_task_prompt

        config = self.config
        runner = self

        def reward(completions: list[Any], **_: Any) -> list[float]:
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [half_alphabet_reward(text) for text in texts]

        class StepTimer(TrainerCallback):
            def __init__(self) -> None:
                self.index = 0
                self.started = 0.0
                self.generate_s = 0.0

            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.generate_s = 0.0
                self.started = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                sync_device(config.device)
                elapsed = time.perf_counter() - self.started
                if self.index >= warmup:
                    runner.step_s.append(elapsed)
                    runner.generate_s.append(self.generate_s)
                self.index += 1

        timer = StepTimer()
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        batch = config.groups * config.group_size
        dataset = Dataset.from_dict({"prompt": [half_alphabet_task_prompt()] * (batch * (steps + warmup))})
        with tempfile.TemporaryDirectory(prefix="artery-bench-trl-") as output_dir:
            args = GRPOConfig(
                output_dir=output_dir,
                max_steps=steps + warmup,
                per_device_train_batch_size=batch,
                num_generations=config.group_size,
                max_completion_length=config.max_new_tokens,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                learning_rate=LEARNING_RATE,
                lr_scheduler_type="constant",
                loss_type="dapo",
                epsilon=0.2,
                epsilon_high=0.28,
                beta=0.0,
                weight_decay=0.1,
                adam_beta1=0.9,
                adam_beta2=0.99,
                max_grad_norm=1.0,
                gradient_accumulation_steps=1,
                use_cpu=config.device == "cpu",
                bf16=False,
                report_to=[],
                save_strategy="no",
                logging_steps=1,
                disable_tqdm=True,
                seed=config.seed,
            )
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=reward,
                args=args,
                train_dataset=dataset,
                processing_class=tokenizer,
                peft_config=LoraConfig(
                    r=8,
                    lora_alpha=16,
                    lora_dropout=0.0,
                    target_modules=list(TARGETS_WITHOUT_LM_HEAD),
                    task_type="CAUSAL_LM",
                ),
                callbacks=[timer],
            )
            trainer.remove_callback(PrinterCallback)  # it prints every log line with tqdm disabled
            generate = trainer._generate_and_score_completions

            def timed_generate(*a: Any, **kw: Any) -> Any:
                started = time.perf_counter()
                out = generate(*a, **kw)
                sync_device(config.device)
                timer.generate_s += time.perf_counter() - started
                return out

            trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign]
            trainer.train()
            logged = [
                h["completions/mean_length"]
                for h in trainer.state.log_history
                if "completions/mean_length" in h
            ]
            self.completion_tokens += logged[warmup:]


# --------------------------------------------------------------------------- the run


def run(config: Config) -> dict[str, Any]:
    import peft
    import torch
    import transformers
    import trl

    from artery.shared.models import TINY, resolve_base_model

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(config.seed)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        model_path = resolve_base_model(TINY)
        ours = ArteryRunner(config, model_path, TARGETS_WITHOUT_LM_HEAD)
        ours_lm_head = ArteryRunner(config, model_path, (*TARGETS_WITHOUT_LM_HEAD, "lm_head"))
        theirs = TrlRunner(config, model_path)
        for _ in range(config.warmup):
            ours.step(record=False)
            ours_lm_head.step(record=False)
        for round_index in range(config.rounds):
            for _ in range(config.steps):
                ours.step(record=True)
            for _ in range(config.steps):
                ours_lm_head.step(record=True)
            theirs.run(config.steps, warmup=config.warmup)
            print(f"round {round_index + 1}/{config.rounds} done", flush=True)
    finally:
        torch.set_num_threads(threads_before)

    full = [g + t for g, t in zip(ours.generate_s, ours.train_s, strict=True)]
    trl_train = [s - g for s, g in zip(theirs.step_s, theirs.generate_s, strict=True)]
    rows = {
        "artery_generate": _stats(ours.generate_s),
        "artery_train_step": _stats(ours.train_s),
        "artery_full_step": _stats(full),
        "trl_generate_and_score": _stats(theirs.generate_s),
        "trl_train_only": _stats(trl_train),
        "trl_full_step": _stats(theirs.step_s),
        "artery_train_step_with_lm_head": _stats(ours_lm_head.train_s),
    }
    ratio = {
        "full_step_trl_over_artery": round(
            rows["trl_full_step"]["median_ms"] / rows["artery_full_step"]["median_ms"], 2
        ),
        "train_trl_over_artery": round(
            rows["trl_train_only"]["median_ms"] / rows["artery_train_step"]["median_ms"], 2
        ),
        "generate_trl_over_artery": round(
            rows["trl_generate_and_score"]["median_ms"] / rows["artery_generate"]["median_ms"], 2
        ),
    }
    return {
        "benchmark": "trainer_step",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(
            load_average(),
            device=config.device,
            torch_threads=config.threads,
            torch=torch.__version__,
            transformers=transformers.__version__,
            peft=peft.__version__,
            trl=trl.__version__,
        ),
        "config": {
            **{k: v for k, v in asdict(config).items() if k != "output"},
            "model": TINY,
            "completions_per_step": config.groups * config.group_size,
            "loss": "dapo (eps 0.2 / 0.28), no KL",
            "learning_rate": LEARNING_RATE,
            "lora": {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": list(TARGETS_WITHOUT_LM_HEAD)},
        },
        "completion_tokens_mean": {
            "artery": round(statistics.fmean(ours.completion_tokens), 2),
            "trl": round(statistics.fmean(theirs.completion_tokens), 2) if theirs.completion_tokens else None,
        },
        "artery_steps_trained": sum(ours.trained),
        "per_step": rows,
        "ratios_of_medians": ratio,
    }


def render(result: dict[str, Any]) -> str:
    c, m, rows = result["config"], result["machine"], result["per_step"]
    notes = {
        "artery_generate": "model.generate + logprobs + decode + reward",
        "artery_train_step": "Policy.train_step: training only",
        "artery_full_step": "generate + train_step",
        "trl_generate_and_score": "TRL _generate_and_score_completions",
        "trl_train_only": "TRL full step - generate+score",
        "trl_full_step": "TRL step (generation included)",
        "artery_train_step_with_lm_head": "Artery's default targets (+ lm_head)",
    }
    figures = [("per step", "median ms", "mean ms", "p90 ms", "n", "includes")]
    for name, s in rows.items():
        figures.append(
            (
                name.replace("_", " "),
                f"{s['median_ms']:.1f}",
                f"{s['mean_ms']:.1f}",
                f"{s['p90_ms']:.1f}",
                str(s["n"]),
                notes[name],
            )
        )
    r = result["ratios_of_medians"]
    tokens = result["completion_tokens_mean"]
    return "\n".join(
        [
            f"trainer step: {c['model']}, {c['groups']} groups x {c['group_size']} completions of <= "
            f"{c['max_new_tokens']} tokens, LoRA r8 on {len(c['lora']['target_modules'])} projections "
            "(no lm_head), "
            f"{c['loss']}" + ("  [--quick: a smoke test, not a measurement]" if c["quick"] else ""),
            f"machine: {m['cpu_count']} CPUs (load {m['load_average_1m_before']} before), "
            f"device {m['device']}, "
            f"{m['torch_threads']} torch thread(s); torch {m['torch']}, transformers {m['transformers']}, "
            f"peft {m['peft']}, trl {m['trl']}",
            f"{c['rounds']} round(s) of {c['steps']} steps each, after {c['warmup']} warm-up step(s); "
            f"mean completion tokens: artery {tokens['artery']}, trl {tokens['trl']}",
            "",
            *table(figures, right={1, 2, 3, 4}),
            "",
            f"TRL / Artery (medians): full step {r['full_step_trl_over_artery']}x, "
            f"training {r['train_trl_over_artery']}x, generation {r['generate_trl_over_artery']}x",
        ]
    )


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("trainer_step", __doc__)
    parser.add_argument("--groups", type=int, default=2, help="groups per step (default 2)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per group (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="longest completion (default 8)")
    parser.add_argument("--steps", type=int, help="measured steps per round and side (default 10; quick 3)")
    parser.add_argument("--warmup", type=int, help="warm-up steps, not counted (default 2; quick 1)")
    parser.add_argument("--rounds", type=int, help="rounds alternating the two sides (default 3; quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--quick", action="store_true", help="a few steps: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    rounds = args.rounds or (1 if args.quick else 3)
    if min(args.groups, args.group_size, args.max_new_tokens, steps, rounds, args.threads) < 1 or warmup < 0:
        parser.error("sizes, --steps, --rounds and --threads must be positive, --warmup >= 0")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2 (GRPO compares within a group)")
    return Config(
        groups=args.groups,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        steps=steps,
        warmup=warmup,
        rounds=rounds,
        threads=args.threads,
        device=args.device,
        quick=args.quick,
        seed=args.seed,
        output=args.output,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv_of(argv))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's and TRL's advice about a tiny model on a CPU
        result = run(config)
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
