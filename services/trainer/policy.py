"""The trained policy: a base model, a PEFT LoRA adapter on it, and the AdamW optimizer of that adapter.

``Policy.train_step`` is one GRPO step over scored trajectory groups, in this process (no NATS, no
database): rewards become group advantages, degenerate groups are skipped and counted,
trajectories become padded sequences, and micro-batches accumulate gradients normalised over the
whole optimizer step, so splitting a batch into micro-batches never changes the update.

``Policy.save`` writes a checkpoint directory that restores exactly, without pickle::

    <dir>/adapter/               what inference loads (adapter_config.json, adapter_model.safetensors)
    <dir>/optimizer.safetensors  AdamW's tensors as "<param index>.<key>" (exp_avg, exp_avg_sq, step)
    <dir>/optimizer.json         param groups (hyperparameters), non-tensor state, parameter names
    <dir>/rng.safetensors        torch's global RNG state(s), for LoRA dropout
    <dir>/trainer_state.json     step, settings, seed

``Policy.restore`` rebuilds the same adapter and optimizer state, so the step after a restart is
the step the uninterrupted run would have taken.

A policy has its base model to itself (adapter ``default``), or shares it with the policies of
other models (``slots``): then its adapter has a name of its own, ``activate`` makes it the one the
model runs and trains, and what it saves is what a policy of its own would save.

The parts live beside it: what a step computes without the model (``step``: settings, group
advantages, micro-batches, the loss), the adapter's shape and loading (``lora``), the optimizer
state files (``optimizer_state``), memory-lean token logprobs (``logprobs``) and heap trimming (``memory``).

Long module: one object's life (create or restore, an RL step, an SFT step, save) around one piece
of state (the model, its adapter, its optimizer), read top to bottom; what needs no model is in
``step``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from artery.schemas import TrainConfig, TrainSFTConfig, Trajectory
from artery.services.trainer.adapter_files import AdapterFiles
from artery.services.trainer.budgets import ModelShape, StepBudget
from artery.services.trainer.logprobs import next_token_logprobs, token_logprobs
from artery.services.trainer.lora import (
    DEFAULT_ADAPTER,
    DEFAULT_TARGET_MODULES,
    LoraSettings,
    effective_lora,
    load_peft,
    load_unsloth,
    unsloth_available,
    warm_start_lora,
)
from artery.services.trainer.losses import (
    LossFn,
    LossInputs,
    importance_stats,
    off_policy_inputs,
)
from artery.services.trainer.memory import freed_heap
from artery.services.trainer.optimizer_state import (
    flatten_optimizer_state,
    optimizer_steps,
    rng_state,
    set_rng_state,
    unflatten_optimizer_state,
)
from artery.services.trainer.precision import autocast, autocast_dtype, frozen_weights_cast
from artery.services.trainer.sequences import TrainingSequence, build_sequences, pad_batch, sft_sequences
from artery.services.trainer.step import (
    DataParallel,
    GroupPlan,
    OptimSettings,
    StepResult,
    cached_loss,
    chunks,
    loss_config,
    mean,
    merge_updates,
    plan_groups,
    sft_loss,
    trained_tokens,
)
from artery.services.trainer.tensor_bytes import safetensors_bytes

#: Re-exported: where callers (tests, benchmarks) have always found them.
__all__ = [
    "DEFAULT_TARGET_MODULES",
    "GroupPlan",
    "LoraSettings",
    "OptimSettings",
    "Policy",
    "StepResult",
    "flatten_optimizer_state",
    "loss_config",
    "next_token_logprobs",
    "plan_groups",
    "sft_loss",
    "token_logprobs",
    "unflatten_optimizer_state",
]

ADAPTER_DIR = "adapter"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
RNG_TENSORS = "rng.safetensors"
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class PreparedStep:
    """A GRPO step's groups made into sequences (``Policy.prepare_step``): everything before the
    first tensor, so that it can run, and be refused, before inference is paused."""

    plan: GroupPlan
    sequences: list[TrainingSequence]
    report: Any


@dataclass(frozen=True)
class PreparedSFT:
    """An SFT step's batches as sequences, with their learning rates and counters (``prepare_sft``)."""

    batches: list[tuple[list[TrainingSequence], float]]
    counts: dict[str, float]


class StepCancelled(Exception):
    """The step was asked to stop between micro-batches (the trainer is shutting down). An update
    of an accumulated step may have been applied already: the caller drops this policy and
    restores the last saved step, and the request is delivered again."""


# --------------------------------------------------------------------------- the policy


class Policy:
    """Base model + LoRA adapter + optimizer. Build with ``create`` or ``restore``."""

    def __init__(
        self,
        *,
        model: Any,
        tokenizer: Any,
        lora: LoraSettings,
        optim: OptimSettings,
        device: torch.device,
        seed: int,
        backend: str,
        base_model_path: str,
        adapter_name: str = DEFAULT_ADAPTER,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.lora = lora
        self.optim = optim
        self.device = device
        self.seed = seed
        #: ``peft`` or ``unsloth``.
        self.backend = backend
        self.base_model_path = base_model_path
        #: The policy version: train_step calls so far (each advances it, trained or not).
        self.step = 0
        #: Set by ``distributed``: a GRPO step shared with other processes; None trains alone.
        self.data_parallel: DataParallel | None = None
        #: This policy's adapter in ``model``, which may hold other models' adapters (``slots``).
        self.adapter_name = adapter_name
        self.activate()  # only this adapter's parameters require grad: they are the optimizer's
        self.named_trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named_trainable:
            raise ValueError("the adapter has no trainable parameters (do the target modules exist?)")
        self._adapter_files = AdapterFiles(self._save_adapter, self._peft_state, self.named_trainable)
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.named_trainable],
            lr=0.0,  # set from each request
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            eps=optim.eps,
        )
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the base weights were loaded in (``resolve_dtype``)."""
        return self.model.get_input_embeddings().weight.dtype

    # --- construction ------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        base_model_path: str | os.PathLike,
        lora: LoraSettings | None = None,
        optim: OptimSettings = OptimSettings(),
        *,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
    ) -> Policy:
        """A fresh adapter (LoRA B = 0, so the policy starts as the base model) on the base model;
        on a PEFT adapter directory (a warm start), that adapter, trainable, in its own shape.
        ``lora`` None: the default shape, or the warm start's."""
        from artery.shared.models import resolve_base_model

        path = resolve_base_model(str(base_model_path))
        lora = effective_lora(path, lora)
        warm = warm_start_lora(path) is not None
        torch_device = torch.device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        # LoRA A is drawn from the global RNG: a private fork keeps creation deterministic per seed
        # without disturbing anyone else's draws.
        with torch.random.fork_rng(devices=cuda_devices(torch_device)):
            torch.manual_seed(seed)
            if torch_device.type == "cuda" and not warm and unsloth_available():
                model, tokenizer = load_unsloth(path, lora, torch_dtype, seed)
                backend = "unsloth"
            else:
                model, tokenizer = load_peft(path, lora, torch_dtype, torch_device)
                backend = "peft"
        model.train()
        return cls(
            model=model,
            tokenizer=tokenizer,
            lora=lora,
            optim=optim,
            device=torch_device,
            seed=seed,
            backend=backend,
            base_model_path=str(base_model_path),
        )

    @classmethod
    def restore(
        cls,
        directory: str | os.PathLike,
        base_model_path: str | os.PathLike,
        lora: LoraSettings | None = None,
        optim: OptimSettings = OptimSettings(),
        *,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
    ) -> Policy:
        """The policy as ``save(directory)`` left it: adapter weights, AdamW moments and step counts,
        the policy step and the RNG state. ``optim`` hyperparameters given here win over the saved
        ones (betas, weight decay, eps: a deliberate change of settings applies from now on)."""
        state, lora = read_checkpoint(directory, base_model_path, lora)
        policy = cls.create(base_model_path, lora, optim, device=device, dtype=dtype, seed=state["seed"])
        policy.resume(directory, state)
        return policy

    def resume(self, directory: str | os.PathLike, state: Mapping[str, Any]) -> None:
        """Take what ``save(directory)`` wrote (``state``: its trainer state, ``read_checkpoint``)."""
        directory = Path(directory)
        self.load_adapter_weights(directory / ADAPTER_DIR)
        self.load_optimizer_state(directory)
        self.step = int(state["step"])
        rng_file = directory / RNG_TENSORS
        if rng_file.is_file():
            set_rng_state(load_file(rng_file))

    def activate(self) -> None:
        """Make this policy's adapter the one its model runs and trains (the others frozen): a
        model shared by several policies (``slots``) runs whichever was activated last."""
        if self.adapter_name != DEFAULT_ADAPTER:
            self.model.set_adapter(self.adapter_name)

    # --- training ----------------------------------------------------------------------------------

    def train_step(
        self,
        groups: Sequence[Sequence[Trajectory]],
        config: TrainConfig,
        *,
        max_seq_len: int,
        temperature: float = 1.0,
        allow_training_without_logprobs: bool = False,
        off_policy: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        budget: StepBudget | None = None,
        should_stop: Callable[[], bool] | None = None,
        prepared: PreparedStep | None = None,
        autocast_mode: str = "off",
    ) -> StepResult:
        """One GRPO step. ``temperature`` is the sampler's: new logprobs are taken at it, as the
        sampler's old ones were. ``config.grad_accumulation_sequences`` (when set) splits the step's
        sequences into optimizer steps of that many sequences each; unset, the step is one update.

        ``budget``: the sequences are checked against it before any tensor is made (raises
        ``BudgetExceeded``). ``should_stop`` is asked before each micro-batch: True raises
        ``StepCancelled`` before the optimizer steps, so a stopping trainer never waits out a step.
        ``prepared``: ``prepare_step`` of the same groups, done already (its budget checked).
        ``autocast_mode``: the passes' precision (``precision``: auto, bfloat16, off)."""
        started = time.perf_counter()
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy samples have no logprobs to train on)")
        if config.max_grad_norm is not None and config.max_grad_norm <= 0:
            raise ValueError("max_grad_norm must be > 0 (or None for the default)")
        settings = loss_config(config, max_seq_len=max_seq_len, off_policy=off_policy)
        loss_fn = cached_loss(settings)  # invalid settings raise here
        # Off-policy: the sampled logprobs weigh each token (truncated IS), not the ratio's "old".
        is_cap = settings.truncated_importance_sampling if off_policy else None
        corrected = settings.truncated_importance_sampling is not None
        pass_dtype = autocast_dtype(autocast_mode, self.device, self.weights_dtype, corrected=corrected)
        if prepared is None:
            prepared = self.prepare_step(
                groups,
                config,
                max_seq_len=max_seq_len,
                allow_training_without_logprobs=allow_training_without_logprobs,
                chat_template_kwargs=chat_template_kwargs,
                budget=budget,
            )
        plan, sequences, report = prepared.plan, prepared.sequences, prepared.report
        self.step += 1
        metrics = dict(plan.metrics)
        metrics.update({key: float(value) for key, value in report.counts().items()})
        metrics["groups_trained"] = float(len({s.group_index for s in sequences}))
        metrics["sequences_dropped"] = float(sum(d.reason != "zero_advantage" for d in report.dropped))
        metrics["tokens_trained"] = float(sum(trained_tokens(s) for s in sequences))
        metrics["learning_rate"] = float(config.learning_rate)

        skip_reason = None
        if not groups:
            skip_reason = "no_groups"
        elif metrics["groups_skipped_equal_rewards"] + metrics["groups_skipped_too_small"] == len(groups):
            skip_reason = "all_groups_skipped"
        elif not sequences:
            skip_reason = "no_trainable_sequences"
        if skip_reason is None:
            size = config.grad_accumulation_sequences or len(sequences)
            try:
                with self._heap_in_use():
                    updates = [
                        self._update(
                            part,
                            loss_fn,
                            config,
                            temperature=temperature,
                            is_cap=is_cap,
                            should_stop=should_stop,
                            pass_dtype=pass_dtype,
                        )
                        for part in chunks(sequences, size)
                    ]
            except StepCancelled:
                self.step -= 1
                raise
            metrics.update(merge_updates(updates))
            if not any(u["applied"] for u in updates):
                skip_reason = "non_finite_gradient"
        metrics["trained"] = float(skip_reason is None)
        metrics["autocast_bf16"] = float(pass_dtype == torch.bfloat16)
        metrics["step_time_s"] = time.perf_counter() - started
        return StepResult(
            step=self.step, trained=skip_reason is None, skip_reason=skip_reason, metrics=metrics
        )

    def prepare_step(
        self,
        groups: Sequence[Sequence[Trajectory]],
        config: TrainConfig,
        *,
        max_seq_len: int,
        allow_training_without_logprobs: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        budget: StepBudget | None = None,
    ) -> PreparedStep:
        """The groups' advantages and sequences, checked against ``budget`` (``BudgetExceeded``)."""
        plan = plan_groups(groups, scale_rewards=config.scale_rewards)
        sequences, report = build_sequences(
            groups,
            plan.advantages,
            self.tokenizer,
            max_seq_len=max_seq_len,
            allow_training_without_logprobs=allow_training_without_logprobs,
            chat_template_kwargs=chat_template_kwargs,
        )
        if budget is not None:
            uncut = max((c.length for c in report.cut), default=0)
            budget.check_sequences(sequences, uncut, ModelShape.of(self.model), self.optim.micro_batch_size)
        return PreparedStep(plan=plan, sequences=sequences, report=report)

    def _heap_in_use(self) -> contextlib.AbstractContextManager:
        """A CPU step's passes: their activations live in this process's heap, which goes back to
        the OS once the trainer has been idle a while (``memory.IdleHeapRelease``)."""
        return freed_heap.step() if self.device.type == "cpu" else contextlib.nullcontext()

    def _update(
        self,
        sequences: list[TrainingSequence],
        loss_fn: LossFn,
        config: TrainConfig,
        *,
        temperature: float,
        is_cap: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        pass_dtype: torch.dtype | None = None,
    ) -> dict[str, float]:
        """One optimizer step over ``sequences``, accumulated over micro-batches. ``is_cap``: the
        samples are off-policy, corrected by truncated importance sampling at that cap.
        ``pass_dtype``: the forward passes autocast to it (None: the weights' dtype)."""
        self.activate()
        model = self.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_sequences = float(len(sequences))  # normalisers for the whole optimizer step
        num_tokens = float(max(sum(trained_tokens(s) for s in sequences), 1))
        kl = config.kl_penalty_coef > 0.0
        loss_sum = ratio_sum = clip_sum = kl_sum = is_ratio_sum = is_truncated_sum = 0.0
        parallel = self.data_parallel
        local = sequences if parallel is None else parallel.shard(sequences)
        # The base model cast once, not per pass; after activate(), which decides which LoRA weights
        # (on a shared base, other models' are frozen too) are trained and so left uncast.
        with frozen_weights_cast(model, pass_dtype):
            for micro in chunks(local, self.optim.micro_batch_size):
                _stop_if_asked(self.optimizer, should_stop)
                batch = {k: v.to(self.device) for k, v in pad_batch(micro, self.pad_id).items()}
                with autocast(self.device, pass_dtype):
                    logprobs = next_token_logprobs(model, batch, temperature)  # [B,T-1]
                ref_logprobs = None
                if kl:  # the base model: the same weights with the adapter switched off
                    with torch.no_grad(), model.disable_adapter(), autocast(self.device, pass_dtype):
                        ref_logprobs = next_token_logprobs(model, batch, temperature)  # [B,T-1]
                old, sampler = batch["old_logprobs"], None  # [B,T-1] NaN where unknown
                if is_cap is not None:
                    old, sampler = off_policy_inputs(logprobs, batch["old_logprobs"])  # [B,T-1] x2
                out = loss_fn(
                    LossInputs(
                        logprobs=logprobs,  # [B,T-1]
                        old_logprobs=old,  # [B,T-1]
                        advantages=batch["advantages"],  # [B]
                        mask=batch["assistant_mask"],  # [B,T-1]
                        ref_logprobs=ref_logprobs,
                        sampler_logprobs=sampler,
                        num_sequences=num_sequences,
                        num_tokens=num_tokens,
                    )
                )
                out.loss.backward()
                tokens = float(batch["assistant_mask"].sum())  # this micro-batch's share of the means
                if is_cap is not None and sampler is not None:  # both set, or neither
                    is_mean, truncated = importance_stats(old, sampler, batch["assistant_mask"], is_cap)
                    is_ratio_sum += is_mean * tokens
                    is_truncated_sum += truncated * tokens
                loss_sum += float(out.loss.detach())
                ratio_sum += float(out.ratio_mean) * tokens
                clip_sum += float(out.clip_fraction) * tokens
                if out.kl_mean is not None:
                    kl_sum += float(out.kl_mean) * tokens
        max_norm = config.max_grad_norm or self.optim.max_grad_norm
        params = [p for _, p in self.named_trainable]
        if parallel is not None:  # every process then clips and steps the same gradient
            parallel.sum_gradients(params)
            sums = parallel.sum_values(
                {"loss": loss_sum, "ratio": ratio_sum, "clip": clip_sum, "kl": kl_sum}
                | {"is_ratio": is_ratio_sum, "is_truncated": is_truncated_sum}
            )
            loss_sum, ratio_sum, clip_sum, kl_sum = sums["loss"], sums["ratio"], sums["clip"], sums["kl"]
            is_ratio_sum, is_truncated_sum = sums["is_ratio"], sums["is_truncated"]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        applied = math.isfinite(grad_norm)
        if applied:
            for group in self.optimizer.param_groups:
                group["lr"] = config.learning_rate
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        result = {
            "applied": float(applied),
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "tokens": num_tokens,
            "ratio_sum": ratio_sum,
            "clip_sum": clip_sum,
        }
        if kl:
            result["kl_sum"] = kl_sum
        if is_cap is not None:
            result["is_ratio_sum"], result["is_truncated_sum"] = is_ratio_sum, is_truncated_sum
        return result

    def sft_step(
        self,
        trajectories: Sequence[Trajectory],
        config: TrainSFTConfig,
        *,
        max_seq_len: int,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        budget: StepBudget | None = None,
        should_stop: Callable[[], bool] | None = None,
        prepared: PreparedSFT | None = None,
        autocast_mode: str = "off",
    ) -> StepResult:
        """One supervised fine-tuning step (ART's ``train_sft``): the trajectories, in order,
        ``config.batch_size`` per optimizer update, each batch at its own learning rate; the loss
        is the cross-entropy of the assistant tokens (every assistant message is trained unless
        ``trainable`` is False; rewards and sampled logprobs play no part). Raises ``ValueError``
        when a list of learning rates does not have one rate per batch; ``budget`` and
        ``should_stop`` and ``prepared`` (``prepare_sft``) as in ``train_step``; ``autocast_mode``
        too, but with no sampler to correct for, ``auto`` keeps SFT in the weights' dtype."""
        started = time.perf_counter()
        trajectories = list(trajectories)
        if prepared is None:
            prepared = self.prepare_sft(
                trajectories,
                config,
                max_seq_len=max_seq_len,
                chat_template_kwargs=chat_template_kwargs,
                budget=budget,
            )
        batches, counts = prepared.batches, dict(prepared.counts)
        rates = [rate for _, rate in batches]
        pass_dtype = autocast_dtype(autocast_mode, self.device, self.weights_dtype, corrected=False)
        self.step += 1
        updates: list[dict[str, float]] = []
        try:
            with self._heap_in_use():
                for sequences, rate in batches:
                    if sequences:
                        updates.append(self._sft_update(sequences, rate, should_stop, pass_dtype))
        except StepCancelled:
            self.step -= 1
            raise
        metrics = {
            **counts,
            "batches": float(len(rates)),
            "learning_rate": mean(rates),
            "tokens_trained": float(sum(u["tokens"] for u in updates)),
        }
        skip_reason = None
        if not trajectories:
            skip_reason = "no_groups"
        elif not updates:
            skip_reason = "no_trainable_sequences"
        else:
            tokens = sum(u["tokens"] for u in updates)
            metrics["loss"] = sum(u["loss"] * u["tokens"] for u in updates) / tokens  # per token
            metrics["grad_norm"] = mean([u["grad_norm"] for u in updates])
            metrics["optimizer_steps"] = float(sum(u["applied"] for u in updates))
            if not any(u["applied"] for u in updates):
                skip_reason = "non_finite_gradient"
        metrics["trained"] = float(skip_reason is None)
        metrics["autocast_bf16"] = float(pass_dtype == torch.bfloat16)
        metrics["step_time_s"] = time.perf_counter() - started
        return StepResult(
            step=self.step, trained=skip_reason is None, skip_reason=skip_reason, metrics=metrics
        )

    def prepare_sft(
        self,
        trajectories: Sequence[Trajectory],
        config: TrainSFTConfig,
        *,
        max_seq_len: int,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        budget: StepBudget | None = None,
    ) -> PreparedSFT:
        """Every batch tokenized, and checked against ``budget``, before the first update."""
        trajectories = list(trajectories)
        rates = config.learning_rates(len(trajectories))
        size = config.resolved_batch_size()
        counts: dict[str, float] = {}
        batches: list[tuple[list[TrainingSequence], float]] = []
        uncut = 0
        for index, rate in enumerate(rates):
            sequences, report = sft_sequences(
                trajectories[index * size : (index + 1) * size],
                self.tokenizer,
                max_seq_len=max_seq_len,
                chat_template_kwargs=chat_template_kwargs,
            )
            for key, value in report.counts().items():
                counts[key] = counts.get(key, 0.0) + float(value)
            uncut = max([uncut, *(c.length for c in report.cut)])
            batches.append((sequences, rate))
        if budget is not None:
            every = [s for sequences, _ in batches for s in sequences]
            budget.check_sequences(every, uncut, ModelShape.of(self.model), self.optim.micro_batch_size)
        return PreparedSFT(batches=batches, counts=counts)

    def _sft_update(
        self,
        sequences: list[TrainingSequence],
        learning_rate: float,
        should_stop: Callable[[], bool] | None = None,
        pass_dtype: torch.dtype | None = None,
    ) -> dict[str, float]:
        """One optimizer update on ``sequences`` at ``learning_rate``, accumulated over micro-batches;
        the forward passes autocast to ``pass_dtype`` (None: the weights' dtype)."""
        self.activate()
        model = self.model
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = float(max(sum(trained_tokens(s) for s in sequences), 1))
        loss_sum = 0.0
        with frozen_weights_cast(model, pass_dtype):  # after activate(), as in _update
            for micro in chunks(sequences, self.optim.micro_batch_size):
                _stop_if_asked(self.optimizer, should_stop)
                batch = {k: v.to(self.device) for k, v in pad_batch(micro, self.pad_id).items()}
                with autocast(self.device, pass_dtype):
                    logprobs = next_token_logprobs(model, batch, 1.0)  # [B,T-1]
                loss = sft_loss(logprobs, batch["assistant_mask"], num_tokens)
                loss.backward()
                loss_sum += float(loss.detach())
        params = [p for _, p in self.named_trainable]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.optim.max_grad_norm))
        applied = math.isfinite(grad_norm)
        if applied:
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"applied": float(applied), "loss": loss_sum, "grad_norm": grad_norm, "tokens": num_tokens}

    # --- checkpoints -------------------------------------------------------------------------------

    @staticmethod
    def adapter_dir(directory: str | os.PathLike) -> Path:
        """Where ``save(directory)`` puts the adapter that inference loads."""
        return Path(directory) / ADAPTER_DIR

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the checkpoint (see the module docstring). The files are written into a temporary
        sibling directory which then replaces ``directory``: a crash leaves the old one or the new."""
        adapter = [(f"{ADAPTER_DIR}/{name}", data) for name, data in self.adapter_files()]
        return write_files(directory, [*adapter, *self.state_files()])

    def adapter_files(self) -> list[tuple[str, bytes]]:
        """The adapter's files (name, bytes) as ``save`` writes them into ``adapter/``."""
        return self._adapter_files.files()

    def state_files(self) -> list[tuple[str, bytes]]:
        """The rest of the checkpoint (name, bytes): the optimizer and RNG state, the trainer state."""
        tensors, structure = flatten_optimizer_state(self.optimizer.state_dict(), self._param_names())
        return [
            (OPTIMIZER_TENSORS, safetensors_bytes(tensors)),
            (OPTIMIZER_JSON, _json_bytes(structure)),
            (RNG_TENSORS, safetensors_bytes(rng_state())),
            (TRAINER_STATE, _json_bytes(self._trainer_state())),
        ]

    def _save_adapter(self, target: Path) -> None:
        # The frozen base lm_head would be saved too when lm_head is a target ("embedding layers
        # found"): it is the base model's, never trained, and can be hundreds of MB.
        own = self.adapter_name == DEFAULT_ADAPTER  # the model's only adapter: saved as always
        selected = {} if own else {"selected_adapters": [self.adapter_name]}
        with _no_model_card(self.model):
            self.model.save_pretrained(
                target, safe_serialization=True, save_embedding_layers=False, **selected
            )
        if not own:
            # PEFT saves a named adapter in a sub-folder of that name (the same files, keys without
            # the name): inference loads the adapter directory itself, as a policy of its own saves it.
            for path in (target / self.adapter_name).iterdir():
                path.rename(target / path.name)
            (target / self.adapter_name).rmdir()

    def _peft_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors under the keys PEFT saves them as (``_save_adapter``'s file)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(
            self.model, adapter_name=self.adapter_name, save_embedding_layers=False
        )

    def _param_names(self) -> list[str]:
        """The trainable parameters' names as a policy of its own has them (adapter ``default``):
        the optimizer state saved by a policy on a shared base restores anywhere."""
        return [
            ".".join(DEFAULT_ADAPTER if part == self.adapter_name else part for part in name.split("."))
            for name, _ in self.named_trainable
        ]

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "optimizer_steps": optimizer_steps(self.optimizer),
            "seed": self.seed,
            "backend": self.backend,
            "base_model": self.base_model_path,
            "lora": dataclasses.asdict(self.lora),
            "optim": dataclasses.asdict(self.optim),
            "torch": torch.__version__,
        }

    def load_adapter_weights(self, adapter_dir: str | os.PathLike) -> None:
        """Copy a saved adapter's weights into this policy's adapter (same LoRA settings)."""
        from peft import set_peft_model_state_dict

        weights = load_file(Path(adapter_dir) / "adapter_model.safetensors", device=str(self.device))
        result = set_peft_model_state_dict(self.model, weights, adapter_name=self.adapter_name)
        unexpected = list(getattr(result, "unexpected_keys", []))
        # Only this adapter's keys: the model may hold other models' adapters (``slots``).
        missing = [
            key
            for key in getattr(result, "missing_keys", [])
            if "lora_" in key and self.adapter_name in key.split(".")
        ]
        if unexpected or missing:
            raise ValueError(f"adapter does not fit: unexpected {unexpected[:5]}, missing {missing[:5]}")

    def load_optimizer_state(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        structure = json.loads((directory / OPTIMIZER_JSON).read_text())
        if structure["param_names"] != self._param_names():
            raise ValueError(f"{directory}: the optimizer state belongs to other parameters")
        tensors = load_file(directory / OPTIMIZER_TENSORS)
        self.optimizer.load_state_dict(unflatten_optimizer_state(tensors, structure))
        for group in self.optimizer.param_groups:  # the settings given now win over the saved ones
            group.update(betas=self.optim.betas, weight_decay=self.optim.weight_decay, eps=self.optim.eps)


# --------------------------------------------------------------------------- internals


def read_checkpoint(
    directory: str | os.PathLike, base_model_path: str | os.PathLike, lora: LoraSettings | None
) -> tuple[dict[str, Any], LoraSettings]:
    """A checkpoint's trainer state, and the adapter shape to restore it as: ``lora`` (None: the
    base model's default), which must be the shape it was saved with (``ValueError``)."""
    directory = Path(directory)
    state_file = directory / TRAINER_STATE
    if not state_file.is_file():
        raise FileNotFoundError(f"{directory}: no {TRAINER_STATE} (not a checkpoint, or an incomplete one)")
    state = json.loads(state_file.read_text())
    from artery.shared.models import resolve_base_model

    lora = effective_lora(resolve_base_model(str(base_model_path)), lora)
    saved_lora = state["lora"]
    shape = (saved_lora["rank"], saved_lora["alpha"], tuple(saved_lora["target_modules"]))
    if shape != (lora.rank, lora.alpha, lora.target_modules):
        raise ValueError(f"{directory}: saved with LoRA {saved_lora}, asked to restore as {lora}")
    return state, lora


def _stop_if_asked(optimizer: torch.optim.Optimizer, should_stop: Callable[[], bool] | None) -> None:
    """Between micro-batches: drop the gradients gathered so far and raise ``StepCancelled``."""
    if should_stop is not None and should_stop():
        optimizer.zero_grad(set_to_none=True)
        raise StepCancelled("the trainer is stopping")


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype; None: bfloat16 on a GPU that has it, else float32."""
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    if dtype is not None:
        return dtype
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def cuda_devices(device: torch.device) -> list[int]:
    """The GPU of ``device``, for ``torch.random.fork_rng``; none on the CPU."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def write_files(directory: str | os.PathLike, files: Iterable[tuple[str, bytes]]) -> Path:
    """``files`` (relative name, bytes) as ``directory``, replaced as a whole: they are written into
    a temporary sibling which is then renamed into place, so a crash leaves the old or the new."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.parent / f".{directory.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        for name, data in files:
            path = partial / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        partial.mkdir(exist_ok=True)  # no files: an empty directory
        _replace_dir(partial, directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return directory


@contextlib.contextmanager
def _no_model_card(model: Any) -> Iterator[None]:
    """PEFT's ``save_pretrained`` without its model card: README.md is rendered from a Jinja
    template compiled on every save (~15 ms of a tiny model's ~22 ms step save) for a file nobody
    reads; an exported model gets a card of its own (``artery.ops.export_model``)."""
    model.create_or_update_model_card = lambda output_dir: None  # the instance's, not PEFT's class
    try:
        yield
    finally:
        del model.create_or_update_model_card


def _replace_dir(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` is moved aside first, then deleted."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        if old is not None:
            with contextlib.suppress(OSError):
                old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
