"""Which engine and interpreter an inference replica runs under: the vLLM engine's replicas run
from ``.venv-vllm`` (``make setup-vllm``), everything else from this interpreter; a missing venv is
a message naming the make target, before anything starts. Which engine serves by default (the
fastest that can serve the model here), and vLLM-CPU's LoRA kernels, checked against vLLM's
formula. None of it needs vLLM installed. (The engine itself: test_engine_vllm.py.)"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys

import pytest
import torch

import artery.ops.stack as stack_module
import artery.ops.stack_engine as stack_engine
from artery.local.backend import LocalBackend, with_tis_cap
from artery.ops.cli import main as artery_main
from artery.ops.stack import EngineUnavailable, Stack, inference_python
from artery.ops.stack_engine import (
    DTYPE_MISMATCH_TIS_CAP,
    EngineChoice,
    ModelFacts,
    base_model_facts,
    choose_engine,
    model_facts,
    replica_engine,
)
from artery.schemas import TrainConfig
from artery.services.inference.engine import vllm_cpu_compiled_lora, vllm_cpu_worker, vllm_lora_targets
from artery.shared import lifeline
from artery.shared.cpu import cpu_has_bf16, cpu_has_fp16_weights
from artery.shared.models import TINY
from artery.shared.tiny_model import tiny_model_path

VLLM_HERE = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def no_vllm_venv(tmp_path, monkeypatch):
    monkeypatch.setattr(stack_module, "VLLM_VENV", tmp_path / ".venv-vllm")
    return tmp_path / ".venv-vllm"


def test_the_transformers_engine_and_other_services_run_from_this_interpreter():
    assert inference_python({}) == sys.executable
    assert inference_python({"ARTERY_INFERENCE_ENGINE": "transformers"}) == sys.executable


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_a_missing_vllm_venv_names_the_make_target(no_vllm_venv):
    with pytest.raises(EngineUnavailable, match="make setup-vllm"):
        inference_python({"ARTERY_INFERENCE_ENGINE": "vllm"})
    # Half-built (no stamp: the install did not finish) counts as missing.
    (no_vllm_venv / "bin").mkdir(parents=True)
    (no_vllm_venv / "bin" / "python").touch()
    with pytest.raises(EngineUnavailable, match="make setup-vllm"):
        inference_python({"ARTERY_INFERENCE_ENGINE": "vllm"})


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_the_vllm_engine_runs_from_the_vllm_venv(no_vllm_venv, tmp_path):
    (no_vllm_venv / "bin").mkdir(parents=True)
    (no_vllm_venv / "bin" / "python").touch()
    (no_vllm_venv / ".installed").touch()
    assert inference_python({"ARTERY_INFERENCE_ENGINE": "vllm"}) == str(no_vllm_venv / "bin" / "python")
    # ARTERY_VLLM_PYTHON wins, and must exist.
    other = tmp_path / "python"
    other.touch()
    env = {"ARTERY_INFERENCE_ENGINE": "vllm", "ARTERY_VLLM_PYTHON": str(other)}
    assert inference_python(env) == str(other)
    with pytest.raises(EngineUnavailable, match="no such interpreter"):
        inference_python({**env, "ARTERY_VLLM_PYTHON": str(tmp_path / "nope")})


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_stack_starts_vllm_replicas_from_their_venv_and_refuses_without_it(no_vllm_venv, tmp_path):
    stack = Stack(home=tmp_path / "stack", nats_url="nats://127.0.0.1:1", database_url="postgresql://x")
    with pytest.raises(EngineUnavailable, match="make setup-vllm"):
        stack.start_service("inference-p-m", service="inference", env={"ARTERY_INFERENCE_ENGINE": "vllm"})
    assert "inference-p-m" not in stack.processes  # nothing was started


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_artery_up_with_engine_vllm_and_no_venv_stops_before_starting_anything(no_vllm_venv, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        artery_main(
            [
                "up",
                "--home",
                str(tmp_path / "home"),
                "--engine",
                "vllm",
                "--serve",
                "p/m=SmolLM2-135M-Instruct",
            ]
        )
    assert "make setup-vllm" in str(stopped.value)
    assert not (tmp_path / "home").exists()


# --------------------------------------------------------------------------- the default engine
#
# LocalBackend and the demos run a replica on the fastest engine that can serve the model here:
# vLLM-CPU in bfloat16 when the CPU has bf16 instructions, .venv-vllm is built and the model
# qualifies, else transformers. The
# choice is a pure function of those facts (artery.ops.stack_engine); an engine or a
# dtype someone named always wins.

SMOLLM2_SHAPE = ModelFacts(head_dim=64)  # hidden 576 / 9 heads
TINY_SHAPE = ModelFacts(head_dim=32)  # hidden 64 / 2 heads


def auto(**facts) -> EngineChoice:
    given = {
        "explicit": None,
        "explicit_dtype": None,
        "device": "cpu",
        "vllm_installed": True,
        "bf16_cpu": True,
    }
    return choose_engine(**{**given, "model": SMOLLM2_SHAPE, **facts})


def test_auto_picks_vllm_in_bf16_when_it_is_installed_and_the_model_qualifies():
    choice = auto()
    assert (choice.engine, choice.dtype, choice.tis_cap) == ("vllm", "bfloat16", DTYPE_MISMATCH_TIS_CAP)
    assert choice.env == {"ARTERY_INFERENCE_ENGINE": "vllm", "ARTERY_INFERENCE_DTYPE": "bfloat16"}
    assert choice.log_line().startswith("inference engine: vllm in bfloat16 (the default")
    assert auto(explicit="auto").engine == "vllm"


@pytest.mark.parametrize(
    ("facts", "why"),
    [
        ({"vllm_installed": False}, "make setup-vllm"),
        ({"model": TINY_SHAPE}, "head_dim 32"),
        ({"model": ModelFacts(None, "weights not found locally")}, "weights not found locally"),
        ({"device": "cuda"}, "device cuda"),
        ({"bf16_cpu": False}, "no bf16 instructions"),
    ],
)
def test_auto_falls_back_to_transformers_and_says_why(facts, why):
    choice = auto(**facts)
    assert (choice.engine, choice.dtype, choice.tis_cap) == ("transformers", None, None)
    assert why in choice.reason and why in choice.log_line()
    assert choice.env == {"ARTERY_INFERENCE_ENGINE": "transformers"}


def test_an_engine_or_dtype_someone_named_wins():
    assert auto(explicit="transformers").engine == "transformers"
    named = auto(explicit="vllm", vllm_installed=False, model=TINY_SHAPE)  # Stack then says what is missing
    assert (named.engine, named.dtype, named.reason) == ("vllm", "bfloat16", "vllm asked for")
    fp32 = auto(explicit_dtype="float32")
    assert (fp32.engine, fp32.dtype, fp32.tis_cap) == ("vllm", "float32", None)  # the trainer's dtype
    assert auto(explicit="transformers", explicit_dtype="bfloat16").tis_cap == DTYPE_MISMATCH_TIS_CAP
    # A name no replica knows is passed on: the replica refuses it (LocalServingUnavailableError).
    assert auto(explicit="tgi").env == {"ARTERY_INFERENCE_ENGINE": "tgi"}


SMOLLM2_WEIGHTS = ModelFacts(head_dim=64, weight_bytes=538_090_408)


@pytest.mark.parametrize("why", [{"bf16_cpu": False}, {"vllm_installed": False}])
def test_the_transformers_default_reads_fp16_weights_where_fbgemm_runs_them(why):
    # A decode step reads every weight from memory: fp16 weights halve the bytes, the arithmetic
    # stays float32, and the float32 trainer corrects the small difference.
    choice = auto(model=SMOLLM2_WEIGHTS, fp16_weights_cpu=True, **why)
    assert (choice.engine, choice.dtype) == ("transformers", "float16")
    assert choice.tis_cap == DTYPE_MISMATCH_TIS_CAP
    assert choice.env == {"ARTERY_INFERENCE_ENGINE": "transformers", "ARTERY_INFERENCE_DTYPE": "float16"}
    assert "fp16 weights" in choice.log_line()
    # Not without fbgemm's instructions, for weights a CPU's caches hold, for weights of unknown
    # size, on a GPU, or when a dtype or engine was named.
    for other in (
        {"fp16_weights_cpu": False},
        {"model": ModelFacts(head_dim=64, weight_bytes=555_880)},
        {"model": SMOLLM2_SHAPE},
        {"device": "cuda"},
    ):
        assert auto(**{"model": SMOLLM2_WEIGHTS, "fp16_weights_cpu": True, **why, **other}).dtype is None
    named = auto(model=SMOLLM2_WEIGHTS, fp16_weights_cpu=True, explicit_dtype="float32", **why)
    assert (named.dtype, named.tis_cap) == ("float32", None)
    assert auto(model=SMOLLM2_WEIGHTS, fp16_weights_cpu=True, explicit="transformers", **why).dtype is None


def test_vllm_named_on_a_cpu_without_bf16_instructions_serves_in_float32():
    # bf16 matmuls without the instructions take a slow path (a fifth of float32 here), so a
    # named vLLM gets float32, the trainer's dtype (no correction); a named dtype still wins.
    named = auto(explicit="vllm", bf16_cpu=False)
    assert (named.engine, named.dtype, named.tis_cap) == ("vllm", "float32", None)
    assert auto(explicit="vllm", explicit_dtype="bfloat16", bf16_cpu=False).dtype == "bfloat16"


# /proc/cpuinfo as two machines show it: an AVX2-only EPYC, a Sapphire Rapids (AMX), an Arm core.
AVX2_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2 sha_ni vaes\n"
AMX_FLAGS = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_FEATURES = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_fp16_weights_need_avx2_fma_and_f16c():
    assert cpu_has_fp16_weights(AVX2_FLAGS)
    assert cpu_has_fp16_weights(AMX_FLAGS.replace("avx2", "avx2 fma f16c"))
    assert not cpu_has_fp16_weights(ARM_FEATURES)  # fbgemm is x86 only
    assert not cpu_has_fp16_weights("flags\t: sse2 avx fma f16c\n")  # no AVX2
    assert not cpu_has_fp16_weights("")


def test_bf16_instructions_are_read_from_the_cpu_flags():
    assert not cpu_has_bf16(AVX2_FLAGS)
    assert cpu_has_bf16(AMX_FLAGS)
    assert cpu_has_bf16(ARM_FEATURES)
    assert not cpu_has_bf16("")  # unreadable: float32, never the slow path
    assert not cpu_has_bf16("flags\t: avx512f avx512_vnni\n")  # AVX-512 without its bf16 part


def test_model_facts_come_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9}))
    assert model_facts(tmp_path).head_dim == 64
    assert model_facts(tmp_path).weight_bytes is None  # no weight files
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 200)
    assert model_facts(tmp_path).weight_bytes == 500
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"head_dim": 128}}))
    assert model_facts(tmp_path).head_dim == 128
    missing = model_facts(tmp_path / "nowhere")
    assert missing.head_dim is None and "config.json" in (missing.why_unknown or "")
    assert model_facts(None).why_unknown == "weights not found locally"


def test_the_tiny_models_shape_is_known_before_it_is_built(tmp_path, monkeypatch):
    """A machine that never built the tiny model chooses its engine for its head size, not for
    an unknown shape; the size is the one the built model's config.json gives."""
    monkeypatch.setenv("ARTERY_CACHE_DIR", str(tmp_path))
    before = base_model_facts(TINY)
    assert not (tmp_path / "models").exists()  # nothing built to know it
    assert before.why_unknown is None
    assert before.head_dim == model_facts(tiny_model_path()).head_dim == 16


@pytest.mark.skipif(VLLM_HERE, reason="this interpreter has vllm: it would serve the vllm engine itself")
def test_a_replica_gets_vllm_only_where_the_venv_is_built_and_the_model_qualifies(
    no_vllm_venv, tmp_path, monkeypatch
):
    smol = tmp_path / "smol"  # a SmolLM2-shaped model directory: only its config.json is read
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9}))
    tiny = str(tiny_model_path())
    monkeypatch.setattr(stack_engine, "cpu_has_bf16", lambda: True)
    assert replica_engine(str(smol), {}).engine == "transformers"  # no .venv-vllm yet
    (no_vllm_venv / "bin").mkdir(parents=True)
    (no_vllm_venv / "bin" / "python").touch()
    (no_vllm_venv / ".installed").touch()
    assert replica_engine(str(smol), {}).env == {
        "ARTERY_INFERENCE_ENGINE": "vllm",
        "ARTERY_INFERENCE_DTYPE": "bfloat16",
    }
    assert replica_engine(tiny, {}).engine == "transformers"  # head_dim 16
    assert replica_engine(TINY, {}).engine == "transformers"
    assert replica_engine(str(smol), {"ARTERY_INFERENCE_ENGINE": "transformers"}).engine == "transformers"
    assert replica_engine(str(smol), {"ARTERY_INFERENCE_DEVICE": "cuda"}).engine == "transformers"
    monkeypatch.setattr(stack_engine, "cpu_has_bf16", lambda: False)  # an AVX2-only CPU
    assert replica_engine(str(smol), {}).engine == "transformers"


def test_local_backend_leaves_the_engine_to_the_choice_unless_named(tmp_path):
    assert "ARTERY_INFERENCE_ENGINE" not in LocalBackend(path=tmp_path / "a").inference_env
    assert "ARTERY_INFERENCE_ENGINE" not in LocalBackend(path=tmp_path / "b", engine="auto").inference_env
    named = LocalBackend(path=tmp_path / "c", engine="transformers")
    assert named.inference_env["ARTERY_INFERENCE_ENGINE"] == "transformers"


def test_bf16_samples_are_trained_with_the_cap_unless_the_caller_set_one():
    assert with_tis_cap(None, {}, 2.0) == TrainConfig(truncated_importance_sampling=2.0)
    given = TrainConfig(learning_rate=1e-4, truncated_importance_sampling=1.5)
    assert with_tis_cap(given, {}, 2.0) is given
    assert with_tis_cap(TrainConfig(), {"truncated_importance_sampling": 3.0}, 2.0) == TrainConfig()
    assert with_tis_cap(TrainConfig(learning_rate=1e-4), {}, 2.0).learning_rate == 1e-4


# --------------------------------------------------------------------------- LoRA vLLM-CPU compiles
#
# vllm_cpu_compiled_lora's ops add each row's adapter product (index -1: no adapter, nothing added)
# and stay opaque to torch.compile, so a graph traced on one batch serves the next, whatever its
# size and adapters. The reference is vLLM's own formula (weights[indices], then per token
# einsum "bi,boi->bo").


def per_token_reference(inputs, weights, indices, dtype):
    selected = weights[indices].to(dtype)
    if selected.dim() == 4:
        selected = selected.squeeze(1)
    return torch.einsum("bi, boi -> bo", inputs.to(dtype), selected)


def adapter_reference(inputs, weights, indices):
    """Per-token products as above, rows without an adapter (-1) zero."""
    out = per_token_reference(inputs, weights, indices.clamp(min=0), torch.float32)
    return out * (indices >= 0).unsqueeze(1)


class FakePunicaWrapper:
    """What the wrapper methods read of vLLM's ``PunicaWrapperCPU``: a per-token index buffer
    longer than any batch, as vLLM allocates it (its tail holds an earlier batch's indices)."""

    def __init__(self, indices: list[int]) -> None:
        self._token_lora_indices = torch.full((64,), 3, dtype=torch.long)
        self._token_lora_indices[: len(indices)] = torch.tensor(indices, dtype=torch.long)


def lora_by_slices(wrapper, x, a, b, slices):
    """vLLM's wrapper's own steps: a float32 buffer per slice, shrink, then expand into the base
    output (ones here), through the methods this module installs."""
    out = torch.ones(x.shape[0], sum(slices) + 2)
    buffers = tuple(torch.zeros(x.shape[0], a.shape[2]) for _ in slices)
    vllm_cpu_compiled_lora.add_shrink(wrapper, buffers, x, (a,) * len(slices), 0.5)
    vllm_cpu_compiled_lora.add_expand(wrapper, out, buffers, (b,) * len(slices), slices)
    return out


def lora_in_one_call(wrapper, x, a, b, slices):
    """What vLLM's LoRA linear layer calls: ``add_lora_linear``, one op for every slice."""
    out = torch.ones(x.shape[0], sum(slices) + 2)
    vllm_cpu_compiled_lora.add_lora_linear(
        wrapper, out, x, (a,) * len(slices), (b,) * len(slices), 0.5, slices
    )
    return out


@pytest.mark.parametrize(
    "batches",
    [([2, 2, 2, 2, 2], [0, 2, -1]), ([-1, -1, -1, -1], [1, 1, 1, 1, 1, 1, 1])],
    ids=["one-adapter-then-mixed", "none-then-one"],
)
@pytest.mark.parametrize("lora_linear", [lora_by_slices, lora_in_one_call])
def test_compiled_lora_serves_each_batch_its_own_adapters(batches, lora_linear):
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(4, 1, 8, 16, generator=generator)  # vLLM's [slots, 1, rank, in]
    b = torch.randn(4, 1, 12, 8, generator=generator)  # [slots, 1, out, rank]
    compiled = torch.compile(lora_linear, fullgraph=True, dynamic=True)
    for indices in batches:  # the second batch replays the graph traced on the first
        index = torch.tensor(indices, dtype=torch.long)
        x = torch.randn(len(indices), 16, generator=generator)
        shrunk = 0.5 * adapter_reference(x, a, index)
        product = adapter_reference(shrunk, b, index)
        want = torch.ones(len(indices), 26)
        want[:, :12] += product
        want[:, 12:24] += product
        for run in (lora_linear, compiled):
            torch.testing.assert_close(run(FakePunicaWrapper(indices), x, a, b, (12, 12)), want)


@pytest.mark.parametrize("indices", [[1, 1, 1, 1], [1, -1, 3, 1, 0]], ids=["one-adapter", "mixed-and-none"])
def test_lora_linear_gives_each_slice_its_own_weights_in_bf16(indices):
    """A fused layer as vLLM's ``qkv_proj``: slices of different widths, each with its own A and B,
    served in bfloat16 (the CPU default); every slice lands at its own offset."""
    generator = torch.Generator().manual_seed(4)
    slices = (12, 4, 4)
    a = [torch.randn(4, 1, 8, 16, generator=generator).to(torch.bfloat16) for _ in slices]
    b = [torch.randn(4, 1, size, 8, generator=generator).to(torch.bfloat16) for size in slices]
    index = torch.tensor(indices)
    x = torch.randn(len(indices), 16, generator=generator).to(torch.bfloat16)
    out = torch.ones(len(indices), sum(slices), dtype=torch.bfloat16)
    vllm_cpu_compiled_lora.add_lora_linear(
        FakePunicaWrapper(indices), out, x, tuple(a), tuple(b), 0.5, slices
    )
    offset = 0
    for a_slice, b_slice, size in zip(a, b, slices, strict=True):
        want = 1 + adapter_reference(0.5 * adapter_reference(x, a_slice, index), b_slice, index)
        torch.testing.assert_close(out[:, offset : offset + size].float(), want, rtol=0.05, atol=0.1)
        offset += size
    assert (out[index < 0] == 1).all()


def test_the_logits_lora_leaves_rows_without_an_adapter_alone():
    """``lm_head``'s LoRA, per sequence: a base-model row in a batch with adapter rows gets nothing,
    even with every slot taken (vLLM's CPU kernels read -1 as the last slot's adapter)."""
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(4, 1, 8, 16, generator=generator)
    b = torch.randn(4, 1, 40, 8, generator=generator)  # the vocabulary: 40 (logits padded to 42)
    x = torch.randn(3, 16, generator=generator)
    wrapper = FakePunicaWrapper([])
    wrapper.sampler_indices = torch.tensor([3, -1, 0])
    logits = torch.zeros(3, 42)
    vllm_cpu_compiled_lora.add_lora_logits(wrapper, logits, x, a, b, 0.5)
    want = adapter_reference(
        0.5 * adapter_reference(x, a, wrapper.sampler_indices), b, wrapper.sampler_indices
    )
    torch.testing.assert_close(logits[:, :40], want, rtol=1e-4, atol=1e-4)
    assert not logits[1].any() and not logits[:, 40:].any()


def test_compiled_lora_embedding_and_overwrite():
    generator = torch.Generator().manual_seed(2)
    b = torch.randn(3, 1, 10, 4, generator=generator)
    x = torch.randn(5, 4, generator=generator)
    index = torch.tensor([1, -1, 0, 1, 1])
    y = torch.ones(5, 10)
    vllm_cpu_compiled_lora.add_lora_embedding(FakePunicaWrapper(index.tolist()), y, x, b)
    torch.testing.assert_close(y, 1 + adapter_reference(x, b, index))
    replaced = torch.ones(5, 14)
    vllm_cpu_compiled_lora.lora_expand(replaced, x, b, index, 4, 10, False)
    rows = index >= 0
    torch.testing.assert_close(replaced[rows, 4:], adapter_reference(x, b, index)[rows])
    assert (replaced[~rows] == 1).all() and (replaced[:, :4] == 1).all()


# --------------------------------------------------------------------------- vLLM-CPU's idle worker


class FakeSpinCondition:
    """The part of vLLM's ``SpinCondition`` the patch touches: a reader polls for ``busy_loop_s``."""

    def __init__(self, is_reader: bool) -> None:
        self.is_reader, self.busy_loop_s, self.waits = is_reader, 1.0 if is_reader else 0.0, []

    def wait(self, timeout_ms=None) -> None:
        self.waits.append((self.busy_loop_s, timeout_ms))


def test_an_idle_worker_polls_for_milliseconds_not_a_second():
    built_before = FakeSpinCondition(is_reader=True)  # the worker's queue exists before the import
    writer = FakeSpinCondition(is_reader=False)
    assert vllm_cpu_worker.shorten_idle_spin(FakeSpinCondition, 0.02)
    assert vllm_cpu_worker.shorten_idle_spin(
        FakeSpinCondition, 0.5
    )  # installed once: no wrapper on the wrapper
    built_before.wait(timeout_ms=7)
    writer.wait()
    FakeSpinCondition(is_reader=True).wait()
    assert built_before.waits == [(0.02, 7)] and built_before.busy_loop_s == 0.02
    assert writer.waits == [(0.0, None)]  # a writer never polls: left alone

    class Other:  # another vLLM, without ``wait``: nothing to patch, and it says so
        pass

    assert not vllm_cpu_worker.shorten_idle_spin(Other)


class FakeCpuModelRunner:
    """vLLM's ``CPUModelRunner`` as far as its warm-up goes: ``warming_up_model`` runs
    ``profile_run``, which passes the whole token budget to ``_dummy_run``."""

    max_num_tokens = 8192

    def __init__(self) -> None:
        self.passes: list[tuple[int, bool]] = []

    def _dummy_run(self, num_tokens: int, is_profile: bool = False) -> None:
        self.passes.append((num_tokens, is_profile))

    def profile_run(self) -> None:
        self._dummy_run(self.max_num_tokens, is_profile=True)

    def warming_up_model(self) -> None:
        self.profile_run()


def test_vllm_cpus_warm_up_pass_runs_a_short_batch_and_nothing_else_changes():
    assert vllm_cpu_worker.shorten_warmup(FakeCpuModelRunner, 256)
    assert vllm_cpu_worker.shorten_warmup(FakeCpuModelRunner, 64)  # installed once: 256 stays
    runner = FakeCpuModelRunner()
    runner.warming_up_model()
    runner.profile_run()  # outside the warm-up: the whole budget, as vLLM asks
    runner._dummy_run(16)
    assert runner.passes == [(256, True), (8192, True), (16, False)]
    assert "_dummy_run" not in vars(runner)  # the cap lived for the warm-up only

    class Other:  # another vLLM, without the methods: nothing to patch, and it says so
        def warming_up_model(self) -> None: ...

    assert not vllm_cpu_worker.shorten_warmup(Other)


# --------------------------------------------------------------------------- a LoRA on lm_head


def test_vllm_is_told_it_can_serve_a_lora_on_lm_head_where_a_class_leaves_it_off(monkeypatch):
    """vLLM serves a LoRA on ``lm_head`` only for a model class that lists it (Llama's does,
    Qwen2's does not). The declaration goes on the class itself, never into the dict that its
    base class shares with every other class; a class this vLLM lacks is skipped."""
    import types

    shared_default: dict[str, str] = {}

    class SupportsLoRA:
        embedding_modules = shared_default

    class Qwen2Like(SupportsLoRA):
        pass

    class LlamaLike(SupportsLoRA):
        embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}

    models = types.ModuleType("fake_vllm_models")
    models.Qwen2Like, models.LlamaLike = Qwen2Like, LlamaLike  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_vllm_models", models)
    classes = (
        "fake_vllm_models.Qwen2Like",
        "fake_vllm_models.LlamaLike",
        "fake_vllm_models.Gone",  # renamed in another vLLM
        "no_such_vllm.models.Qwen2Like",
    )
    assert vllm_lora_targets.declare_lm_head_lora(classes) == ["fake_vllm_models.Qwen2Like"]
    assert Qwen2Like.embedding_modules == {"lm_head": "output_embeddings"}
    assert shared_default == {} and LlamaLike.embedding_modules["lm_head"] == "output_embeddings"
    assert vllm_lora_targets.declare_lm_head_lora(classes) == []  # once is enough


# --------------------------------------------------------------------------- vLLM-CPU's compile cache


def test_a_compiled_model_saved_by_vllm_cpu_loads_at_the_next_start():
    """vLLM calls ``finalize_loading`` on what it loaded; the CPU's plain compiled function has
    none, which made every start compile again. The wrapper adds one that does nothing, and leaves
    a function that has its own (vLLM's GPU backend) alone."""

    def plain_compiled(*inputs):
        return "graph"

    class GpuCompiled:
        def finalize_loading(self, vllm_config):
            return "its own"

    class Artifacts:
        def __init__(self, compiled_fn) -> None:
            self.compiled_fn = compiled_fn

    class Loaded:
        def __init__(self, compiled_fn) -> None:
            self._artifacts = Artifacts(compiled_fn)

    class FakeTorchCompiler:
        pass

    compiler = FakeTorchCompiler()
    compiler.load_compiled_function = lambda file, *, f_globals=None: Loaded(file)
    assert vllm_cpu_worker.load_compiled_as_saved(compiler)
    wrapped = compiler.load_compiled_function
    assert vllm_cpu_worker.load_compiled_as_saved(compiler) and compiler.load_compiled_function is wrapped

    loaded = compiler.load_compiled_function(plain_compiled, f_globals={})
    assert loaded._artifacts.compiled_fn.finalize_loading(vllm_config=None) is None  # as vLLM calls it
    assert loaded._artifacts.compiled_fn() == "graph"
    gpu = compiler.load_compiled_function(GpuCompiled())
    assert gpu._artifacts.compiled_fn.finalize_loading(None) == "its own"
    assert not vllm_cpu_worker.load_compiled_as_saved(FakeTorchCompiler())  # nothing to wrap


# ------------------------------------------------------------- vLLM's processes end with their replica
#
# A replica killed outright cannot stop vLLM's engine core, which waits on a socket for requests;
# vllm_cpu_worker watches the replica from vLLM's worker (multiprocessing spawns both). Here a
# script stands in: the replica, the engine core it spawned (separate executor) or not (in-process
# executor: the worker is the engine core), and a worker that runs end_with_the_replica.

PROCESSES = """
import multiprocessing, os, sys, time

from artery.services.inference.engine.vllm_cpu_worker import end_with_the_replica
from artery.shared import lifeline


def worker(pids):
    pids.put(("worker", os.getpid(), end_with_the_replica(grace_s=5.0) is not None))
    time.sleep(600)


def engine_core(pids):
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=worker, args=(pids,))
    child.start()
    pids.put(("engine_core", os.getpid(), True))
    time.sleep(600)  # SIGTERM's default action ends it, as vLLM's handler ends the engine core


if __name__ == "__main__":
    lifeline.tie_spawned_children()  # as VLLMEngine.start does
    spawn = multiprocessing.get_context("spawn")
    pids = spawn.Queue()
    target = worker if sys.argv[1] == "in-process" else engine_core
    spawn.Process(target=target, args=(pids,)).start()
    for _ in range(1 if target is worker else 2):
        print(*pids.get(timeout=120), flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("executor", ["separate", "in-process"])
def test_vllms_processes_end_when_their_replica_is_killed(tmp_path, executor):
    script = tmp_path / "replica.py"
    script.write_text(PROCESSES)
    replica = subprocess.Popen([sys.executable, str(script), executor], stdout=subprocess.PIPE, text=True)
    watched = {}
    try:
        for _ in range(2 if executor == "separate" else 1):
            name, pid, watching = replica.stdout.readline().split()
            watched[name] = lifeline.Watched(int(pid))
            assert watching == "True", f"the {name} does not watch the replica"
        replica.kill()  # SIGKILL: nothing in the replica runs
        replica.wait()
        for name, process in watched.items():
            assert lifeline.first_gone([process], timeout=30) is process, f"the {name} outlived its replica"
    finally:
        replica.kill()
        for process in watched.values():
            process.send(signal.SIGKILL)


def test_no_replica_named_no_watch():
    """Outside a spawned process (the replica imports the module too) nothing is watched."""
    assert vllm_cpu_worker.end_with_the_replica() is None


def test_a_vllm_replica_is_given_the_time_its_first_compile_takes(monkeypatch):
    """``LocalBackend`` and ``artery up`` (at start and at each restart) wait for a vLLM replica as
    long as a cold torch.compile takes on a small CPU; for every other process a few minutes."""
    from artery.ops.cli import SERVICE_START_TIMEOUT_S, _ready_timeouts

    assert stack_engine.VLLM_START_TIMEOUT_S > stack_engine.REPLICA_START_TIMEOUT_S
    assert EngineChoice("vllm", "bfloat16", "bf16 CPU").start_timeout_s == stack_engine.VLLM_START_TIMEOUT_S
    assert EngineChoice("transformers", None, "").start_timeout_s == stack_engine.REPLICA_START_TIMEOUT_S

    monkeypatch.delenv("ARTERY_INFERENCE_ENGINE", raising=False)
    replicas = [("demo", "agent", TINY)]
    vllm_timeout, other_timeout = stack_engine.VLLM_START_TIMEOUT_S, stack_engine.REPLICA_START_TIMEOUT_S
    assert _ready_timeouts(("collector", "trainer"), replicas, "vllm") == {
        "collector": SERVICE_START_TIMEOUT_S,
        "trainer": SERVICE_START_TIMEOUT_S,
        "inference-demo-agent": vllm_timeout,
    }
    # No --engine: the replica runs the environment's engine, else the settings' default.
    assert _ready_timeouts((), replicas, None) == {"inference-demo-agent": other_timeout}
    monkeypatch.setenv("ARTERY_INFERENCE_ENGINE", "vllm")
    assert _ready_timeouts((), replicas, None) == {"inference-demo-agent": vllm_timeout}
