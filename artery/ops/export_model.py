"""``artery export-model``: a published step of a model, for tools outside Artery.

Two layouts:

- ``peft``: the adapter in the standard PEFT layout (``adapter_config.json``,
  ``adapter_model.safetensors``), with the base model's identity in ``base_model_name_or_path``
  (the name the model was registered with; for a warm start, the base under the starting adapter),
  the base's tokenizer and a model card (``README.md``) saying where it came from. Load it with
  ``PeftModel.from_pretrained(base, DIR)``, or give it to vLLM as a LoRA (``--lora-modules``).
- ``merged``: the base weights with the adapter merged in, a plain transformers model directory
  (``config.json``, ``model.safetensors``, tokenizer) that ``AutoModelForCausalLM`` and vLLM load
  as they load any model. Merged in float32 and saved in the base's own dtype (``--dtype``
  overrides). When the adapter trains ``lm_head`` and the base ties it to the input embeddings
  (the tiny model, SmolLM2), merging into the shared matrix would change the embeddings too: the
  output matrix is untied first, and the saved config says ``tie_word_embeddings: false``.

The step comes from the publisher's record (``checkpoints``) and its bytes from the adapter
Object Store, checked against their sha256 before anything is written; ``DIR`` is replaced whole.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from artery.shared import bus
from artery.shared.adapters import get_adapter, unpack_adapter
from artery.shared.models import warm_start
from artery.shared.settings import CommonSettings

FORMATS = ("peft", "merged")


@dataclass(frozen=True)
class PublishedStep:
    project: str
    model: str
    step: int
    object_name: str
    sha256: str
    #: As the model was registered: a name, a directory, or a warm-start adapter directory.
    base_model: str

    @property
    def base_identity(self) -> str:
        """The weights the adapter applies to: the registered base, or a warm start's own base."""
        warm = warm_start(self.base_model)
        return warm.base_model if warm is not None else self.base_model


async def find_step(database_url: str, project: str, model: str, step: int | None) -> PublishedStep:
    """The published step (default: the newest one still in the Object Store); ``LookupError``
    saying which steps there are when it is not there."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT step, object_name, sha256, base_model, deleted_at FROM checkpoints"
            " WHERE project = $1 AND model = $2 AND published_at IS NOT NULL ORDER BY step",
            project,
            model,
        )
    finally:
        await conn.close()
    live = [r for r in rows if r["deleted_at"] is None]
    if step is None:
        chosen = live[-1] if live else None
    else:
        chosen = next((r for r in live if r["step"] == step), None)
    if chosen is None:
        deleted = [r["step"] for r in rows if r["deleted_at"] is not None]
        raise LookupError(
            f"{project}/{model} has no published step {step if step is not None else ''}".rstrip()
            + f" (published: {[r['step'] for r in live] or 'none'}"
            + (f"; deleted by retention: {deleted}" if deleted else "")
            + ")"
        )
    return PublishedStep(
        project=project,
        model=model,
        step=int(chosen["step"]),
        object_name=chosen["object_name"],
        sha256=chosen["sha256"],
        base_model=chosen["base_model"],
    )


async def fetch_adapter(settings: CommonSettings, found: PublishedStep, dest: Path) -> Path:
    """The step's adapter, verified and unpacked into ``dest``."""
    nc = await bus.connect(settings, name="artery-export-model", max_reconnect_attempts=3)
    try:
        data = await get_adapter(nc.jetstream(), found.object_name)
    finally:
        await bus.close(nc)
    return unpack_adapter(data, dest, found.sha256)


def write_peft(adapter_dir: Path, found: PublishedStep, output: Path) -> Path:
    """``adapter_dir`` (as the trainer saved it) in the standard layout, under ``output``."""
    from transformers import AutoTokenizer

    staging = _staging(output)
    try:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copyfile(adapter_dir / name, staging / name)
        config = json.loads((staging / "adapter_config.json").read_text())
        # The trainer wrote the path the base was loaded from on its machine; its identity is
        # the name the model was registered with.
        config["base_model_name_or_path"] = found.base_identity
        config["inference_mode"] = True
        (staging / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        AutoTokenizer.from_pretrained(_tokenizer_source(found)).save_pretrained(staging)
        (staging / "README.md").write_text(_model_card(found, "peft"))
        return _move_into_place(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_merged(adapter_dir: Path, found: PublishedStep, output: Path, dtype: str = "auto") -> Path:
    """The base weights with the adapter merged in, saved as a plain transformers model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from artery.shared.models import resolve_base_model

    base_path = resolve_base_model(found.base_identity)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    saved_dtype = _saved_dtype(base_path, dtype)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    output_layer = base.get_output_embeddings()
    tied = output_layer is not None and output_layer.weight is base.get_input_embeddings().weight
    if tied and _targets_output_layer(adapter_config, base):
        output_layer.weight = torch.nn.Parameter(output_layer.weight.detach().clone())
        base.config.tie_word_embeddings = False
        text_config = base.config.get_text_config()
        if text_config is not base.config:
            text_config.tie_word_embeddings = False
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged = merged.to(saved_dtype)
    staging = _staging(output)
    try:
        merged.save_pretrained(staging, safe_serialization=True)
        AutoTokenizer.from_pretrained(_tokenizer_source(found)).save_pretrained(staging)
        (staging / "README.md").write_text(_model_card(found, "merged"))
        return _move_into_place(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


async def export_model(
    settings: CommonSettings,
    database_url: str,
    project: str,
    model: str,
    output: Path,
    *,
    fmt: str,
    step: int | None = None,
    dtype: str = "auto",
) -> PublishedStep:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    check_output(output)
    found = await find_step(database_url, project, model, step)
    with tempfile.TemporaryDirectory(prefix="artery-export-") as scratch:
        adapter_dir = await fetch_adapter(settings, found, Path(scratch) / "adapter")
        if fmt == "peft":
            write_peft(adapter_dir, found, output)
        else:
            write_merged(adapter_dir, found, output, dtype)
    return found


# --------------------------------------------------------------------------- internals


def _tokenizer_source(found: PublishedStep) -> str:
    from artery.shared.models import resolve_base_model

    warm = warm_start(found.base_model)
    return warm.tokenizer_path() if warm is not None else resolve_base_model(found.base_model)


def _targets_output_layer(adapter_config: dict, base) -> bool:
    names = adapter_config.get("target_modules") or []
    output_name = next(
        (name for name, module in base.named_modules() if module is base.get_output_embeddings()), "lm_head"
    )
    if isinstance(names, str):  # a regular expression over module names
        import re

        return re.fullmatch(names, output_name) is not None
    return output_name.split(".")[-1] in names or output_name in names


def _saved_dtype(base_path: str, dtype: str):
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    config = json.loads((Path(base_path) / "config.json").read_text()) if Path(base_path).is_dir() else {}
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, stored)


def _staging(output: Path) -> Path:
    output.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))


def check_output(output: Path) -> None:
    """``output`` may be new, an empty directory or an earlier export (its model card says so), and
    nothing else: an export replaces the directory, and ``.`` or a home directory must never go."""
    if not output.exists() and not output.is_symlink():
        return
    if output.is_symlink() or not output.is_dir():
        raise FileExistsError(f"{output} exists and is not a directory")
    if not any(output.iterdir()) or _is_export(output):
        return
    raise FileExistsError(f"{output} is not empty and not an earlier export: choose a new directory")


def _is_export(directory: Path) -> bool:
    card = directory / "README.md"
    return card.is_file() and "\n- artery\n" in card.read_text(errors="replace")[:2000]


def _move_into_place(staging: Path, output: Path) -> Path:
    """The new export in place of the old one, which is removed only once the new one is there."""
    check_output(output)  # again: the directory may have changed while the model was written
    old = None
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
        output.rename(old / output.name)
    staging.rename(output)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return output


def _model_card(found: PublishedStep, fmt: str) -> str:
    lines = [
        "---",
        f"base_model: {found.base_identity}",
        *(["library_name: peft"] if fmt == "peft" else []),
        "tags:",
        "- artery",
        "- grpo",
        "- lora",
        "---",
        "",
        f"# {found.project}/{found.model} at step {found.step}",
        "",
        f"Exported by `artery export-model --format {fmt}` from Artery's adapter store "
        f"(object `{found.object_name}`, sha256 `{found.sha256}`).",
        "",
        f"Base model: `{found.base_identity}`"
        + (f" (warm-started from the adapter `{found.base_model}`)" if warm_start(found.base_model) else ""),
        "",
    ]
    if fmt == "peft":
        lines += ["A LoRA adapter: `PeftModel.from_pretrained(base, this_directory)`.", ""]
    else:
        lines += [
            "The adapter merged into the base: `AutoModelForCausalLM.from_pretrained(this_directory)`.",
            "",
        ]
    return "\n".join(lines)
