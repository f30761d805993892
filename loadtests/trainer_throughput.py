"""Trainer throughput: tokens/s of Artery's GRPO step on a Qwen3-shaped model, against a minimal
hand-written GRPO step on the same model, batch and device, in the same run.

Sized for a GPU (the default where there is one: ``qwen3-0.6b`` in bf16); on the CPU the default is ``tiny``.
No model hub is reachable here, so the model is built from a config with random weights:
``qwen3-0.6b`` has Qwen3-0.6B's published sizes (28 layers, hidden 1024, 16 query and 8 key/value
heads of 128, MLP 3072, vocabulary 151,936, tied embeddings); a step's throughput does not depend on
the weights' values. The tokenizer is the tiny test model's (``artery.shared.tiny_model``); token
ids are drawn below its vocabulary.

The workload: ``groups`` x ``group_size`` trajectories per step, one prompt of about
``--prompt-tokens`` tokens per group (as rendered by the chat template) and completions of exactly
``--completion-tokens`` sampled tokens with logprobs, rewards spread within each group so that
every advantage is non-zero. Both sides train the same LoRA (rank ``--lora-rank``, alpha twice
that, no dropout) on q/k/v/o/gate/up/down (``lm_head`` left out of both: Artery's default adds it),
in micro-batches of ``--micro-batch`` sequences, then clip the gradient norm at 1 and take one
AdamW step:

- ``artery``: ``Policy.train_step`` end to end: advantages, chat-template rendering and sample
  splicing, padding, forward with chunked logprobs, the loss, backward, clipping, the step;
- ``baseline``: the floor the same libraries reach: the same PEFT model class and LoRA, the
  token ids concatenated once outside the clock, one forward per micro-batch, a row-at-a-time
  log-softmax of the completion positions, a PPO-clip loss on group-normalised advantages,
  backward, clipping, AdamW.

Trained tokens are the completion tokens that carried a loss (Artery's ``tokens_trained``); total
tokens add the prompts. The sides alternate step by step after ``--warmup`` steps each. prime-rl's
published 11.9k tokens/s (full-parameter RL on Qwen3-0.6B at 16K sequence length, one H100) is
recorded as a reference, not as a same-run ratio.

Results: ``loadtests/results/trainer_throughput.json``.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtests import harness
from loadtests.harness import argv_of, load_average, machine, report, sync_device, table
from loadtests.synthetic import synthetic_groups

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LEARNING_RATE = 1e-5
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PRIME_RL_REFERENCE = {
    "tokens_per_s": 11900,
    "what": "full-parameter RL, Qwen3-0.6B, 16K sequence length, 1xH100"
    " (prime-rl benchmarks/results/BENCHMARKS.md)",
}

#: Qwen3Config arguments per shape; ``vocab_size`` None: the tokenizer's.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6,
    ),
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=None, tie_word_embeddings=True,
        rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6,
    ),
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Config:
    shape: str
    device: str
    dtype: str
    groups: int
    group_size: int
    prompt_tokens: int
    completion_tokens: int
    micro_batch: int
    lora_rank: int
    steps: int
    warmup: int
    seed: int
    output: Path


def build_model(shape: str, home: Path) -> Path:
    """A random Qwen3 of ``shape`` with the tiny test model's tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from artery.shared.tiny_model import tiny_model_path

    tokenizer_dir = Path(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sizes = dict(SHAPES[shape])
    sizes["vocab_size"] = sizes["vocab_size"] or len(tokenizer)
    config = Qwen3Config(
        **sizes, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(home)
    tokenizer.save_pretrained(home)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, home / name)
    return home


class ArterySide:
    def __init__(self, config: Config, model_path: Path) -> None:
        from artery.schemas import TrainConfig
        from artery.services.trainer.policy import LoraSettings, OptimSettings, Policy

        self.config = config
        self.policy = Policy.create(
            model_path,
            LoraSettings(
                rank=config.lora_rank, alpha=2 * config.lora_rank, dropout=0.0, target_modules=TARGETS
            ),
            OptimSettings(micro_batch_size=config.micro_batch, max_grad_norm=1.0),
            device=config.device,
            dtype=TORCH_DTYPES[config.dtype],
            seed=config.seed,
        )
        self.train_config = TrainConfig(learning_rate=LEARNING_RATE)
        self.max_seq_len = 2 * (config.prompt_tokens + config.completion_tokens) + 64

    def step(self, groups: list[list[Any]]) -> tuple[float, int]:
        sync_device(self.config.device)
        started = time.perf_counter()
        result = self.policy.train_step(groups, self.train_config, max_seq_len=self.max_seq_len)
        sync_device(self.config.device)
        elapsed = time.perf_counter() - started
        if not result.trained:
            raise RuntimeError(f"Artery's step trained nothing: {result.skip_reason}")
        return elapsed, int(result.metrics["tokens_trained"])


class BaselineSide:
    """The same PEFT LoRA model, trained by the shortest correct GRPO step."""

    def __init__(self, config: Config, model_path: Path, groups: list[list[Any]], tokenizer: Any) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.config = config
        dtype = getattr(torch, TORCH_DTYPES[config.dtype])
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map={"": config.device})
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=2 * config.lora_rank,
            lora_dropout=0.0,
            target_modules=list(TARGETS),
        )
        self.model = get_peft_model(base, lora)
        for p in self.model.parameters():  # the adapter in float32, as Artery keeps it
            if p.requires_grad:
                p.data = p.data.float()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=LEARNING_RATE, betas=(0.9, 0.99), weight_decay=0.1)
        rows, old, advantages = [], [], []
        for group in groups:
            rewards = torch.tensor([t.reward for t in group])
            normalised = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            messages = [{"role": "user", "content": group[0].messages[0].content}]
            prompt = list(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
            )
            for trajectory, advantage in zip(group, normalised.tolist(), strict=True):
                sample = trajectory.messages[-1].sample
                rows.append(prompt + list(sample.token_ids))
                old.append(list(sample.logprobs))
                advantages.append(advantage)
        width = max(len(r) for r in rows)
        pad = tokenizer.pad_token_id
        self.input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=config.device)
        self.prompt_len = [len(r) - len(o) for r, o in zip(rows, old, strict=True)]
        self.old = [torch.tensor(o, device=config.device) for o in old]
        self.advantages = torch.tensor(advantages, device=config.device)
        self.tokens = sum(len(o) for o in old)

    def step(self) -> tuple[float, int]:
        import torch

        config = self.config
        sync_device(config.device)
        started = time.perf_counter()
        n = self.input_ids.shape[0]
        for first in range(0, n, config.micro_batch):
            rows = range(first, min(first + config.micro_batch, n))
            logits = self.model(input_ids=self.input_ids[rows.start : rows.stop]).logits
            loss = torch.zeros((), device=config.device)
            for k, row in enumerate(rows):
                start, count = self.prompt_len[row], len(self.old[row])
                targets = self.input_ids[row, start : start + count]
                scores = torch.log_softmax(logits[k, start - 1 : start - 1 + count].float(), dim=-1)
                new = scores.gather(-1, targets[:, None]).squeeze(-1)
                ratio = torch.exp(new - self.old[row])
                advantage = self.advantages[row]
                clipped = torch.clamp(ratio, 0.8, 1.2)
                loss = loss - torch.minimum(ratio * advantage, clipped * advantage).sum() / self.tokens
            loss.backward()
            del logits
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync_device(config.device)
        return time.perf_counter() - started, self.tokens


def _figures(seconds: list[float], trained: int, total: int) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {
        "steps": len(seconds),
        "median_step_s": round(median, 4),
        "trained_tokens_per_step": trained,
        "total_tokens_per_step": total,
        "trained_tokens_per_s": round(trained / median, 1),
        "total_tokens_per_s": round(total / median, 1),
    }


def _peak_gib(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def run(config: Config) -> dict[str, Any]:
    import torch

    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="artery-bench-throughput-") as home:
        print(f"building a random {config.shape} model ...", flush=True)
        model_path = build_model(config.shape, Path(home))
        artery = ArterySide(config, model_path)
        groups = synthetic_groups(
            artery.policy.tokenizer,
            random.Random(config.seed),
            groups=config.groups,
            group_size=config.group_size,
            prompt_tokens=config.prompt_tokens,
            completion_tokens=config.completion_tokens,
        )
        baseline = BaselineSide(config, model_path, groups, artery.policy.tokenizer)
        prompt_tokens = sum(baseline.prompt_len)
        before = {name: p.detach().clone() for name, p in artery.policy.named_trainable}
        times: dict[str, list[float]] = {"artery": [], "baseline": []}
        trained = {"artery": 0, "baseline": baseline.tokens}
        for index in range(config.warmup + config.steps):
            counted = index >= config.warmup
            a_s, trained["artery"] = artery.step(groups)
            b_s, _ = baseline.step()
            if counted:
                times["artery"].append(a_s)
                times["baseline"].append(b_s)
            label = "step" if counted else "warm-up"
            print(f"{label} {index + 1}: artery {a_s:.3f} s, baseline {b_s:.3f} s", flush=True)
        moved = max(
            float((p.detach() - before[name]).abs().max()) for name, p in artery.policy.named_trainable
        )
    contenders = {
        name: _figures(times[name], trained[name], trained[name] + prompt_tokens)
        for name in ("artery", "baseline")
    }
    return {
        "benchmark": "trainer_throughput",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "model": f"{config.shape}, random weights, the tiny test model's tokenizer",
        "contenders": contenders,
        "artery_vs_baseline": round(
            contenders["artery"]["trained_tokens_per_s"] / contenders["baseline"]["trained_tokens_per_s"], 3
        ),
        "artery_adapter_moved": moved,
        "peak_gpu_memory_gib": _peak_gib(config.device),
        "prime_rl_reference": PRIME_RL_REFERENCE,
        "machine": machine(
            load_before,
            torch=torch.__version__,
            device=torch.cuda.get_device_name() if config.device.startswith("cuda") else "cpu",
        ),
    }


def render(result: dict[str, Any]) -> str:
    header = ("side", "median step s", "trained tok/step", "trained tok/s", "total tok/s")
    rows: list[tuple[str, ...]] = [header]
    for name, f in result["contenders"].items():
        rows.append(
            (
                name,
                f"{f['median_step_s']:.3f}",
                str(f["trained_tokens_per_step"]),
                f"{f['trained_tokens_per_s']:.0f}",
                f"{f['total_tokens_per_s']:.0f}",
            )
        )
    lines = table(rows, right={1, 2, 3, 4})
    lines.append(f"artery / baseline (trained tokens/s): {result['artery_vs_baseline']}")
    reference = result["prime_rl_reference"]
    lines.append(
        f"reference, not this run: prime-rl {reference['tokens_per_s']} tokens/s ({reference['what']})"
    )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> Config:
    parser = harness.parser("trainer_throughput", __doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default qwen3-0.6b on cuda, tiny on cpu")
    parser.add_argument("--device", help="cuda or cpu (default cuda where there is a GPU)")
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), help="base weights (default bf16 on cuda, else fp32)"
    )
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--completion-tokens", type=int, default=1536)
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="steps per side not counted")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = (
        args.groups,
        args.prompt_tokens,
        args.completion_tokens,
        args.micro_batch,
        args.lora_rank,
        args.steps,
    )
    if min(sizes) < 1 or args.warmup < 0 or args.group_size < 2:
        parser.error("sizes and --steps must be positive, --group-size at least 2, --warmup >= 0")
    device = args.device or ("cuda" if harness.gpu_present() else "cpu")
    on_gpu = device.startswith("cuda")
    return Config(
        shape=args.shape or ("qwen3-0.6b" if on_gpu else "tiny"),
        device=device,
        dtype=args.dtype or ("bf16" if on_gpu else "fp32"),
        groups=args.groups,
        group_size=args.group_size,
        prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens,
        micro_batch=args.micro_batch,
        lora_rank=args.lora_rank,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        output=args.output,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv_of(argv))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's advice about a random model
        result = run(config)
    return report(result, render, config.output)


if __name__ == "__main__":
    main()
