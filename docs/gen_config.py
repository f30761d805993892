"""The configuration page, generated from the settings structs at every docs build.

Each service's ``settings.py`` declares a msgspec Struct whose fields are its settings, each with a
default and a description; ``artery.shared.settings.describe`` turns one into rows. Generating the
page when the site is built (this module is a MkDocs hook) means it cannot drift from the code.
Run as a script it prints the page: ``python docs/gen_config.py``.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import msgspec

PAGE = "operations/configuration.md"
ROOT = Path(__file__).resolve().parent.parent

INTRO = """\
# Configuration

Every process reads environment variables, validated at start: a wrong value stops the service
with a message naming the variable. Each service declares its settings as a msgspec Struct in its
`settings.py`; this page is generated from those structs when the site is built
(`docs/gen_config.py`), and `artery config` prints the same list from the installed code. A field
`batch_size` of a struct read with prefix `ARTERY_COLLECTOR_` comes from
`ARTERY_COLLECTOR_BATCH_SIZE`; an empty value counts as unset.
"""

# Read outside the settings structs: by the embedded stack, the SDK or the metrics server.
ELSEWHERE = (
    (
        "`ARTERY_<SERVICE>_METRICS_PORT`",
        "the service's `/metrics`, `/healthz`, `/readyz` port (default 0: a free port, `-1`: none);"
        " see [observability](observability.md)",
    ),
    ("`ARTERY_METRICS_HOST`", "address of the metrics server (default 127.0.0.1)"),
    (
        "`ARTERY_VLLM_PYTHON`",
        "interpreter for vLLM replicas (default: this one if it has vllm, else"
        " `.venv-vllm/bin/python`); see [the vLLM engine](../guides/inference.md#the-vllm-engine)",
    ),
    (
        "`VLLM_CPU_KVCACHE_SPACE`",
        "GiB of KV cache for vLLM on the CPU (default: four of the model's full contexts, at most 2 GiB"
        " unless one context needs more)",
    ),
    (
        "`ARTERY_INFERENCE_URL`",
        "the SDK sends every completion to this URL (a load balancer of your own) instead of the"
        " model's replicas",
    ),
    ("`ARTERY_CACHE_DIR`", "where the demo's SmolLM2 is converted (default `~/.cache/artery`)"),
    ("`OTEL_SERVICE_NAME`", "the SDK's service name in traces (default `artery-agent`)"),
    (
        "`LANGFUSE_PUBLIC_KEY`, `LANGFUSE_SECRET_KEY`, `LANGFUSE_HOST` / `LANGFUSE_BASE_URL`",
        "also send spans to Langfuse; see [observability](observability.md)",
    ),
    ("`WANDB_API_KEY`, `WANDB_DIR`, `WANDB_MODE`", "W&B reporting; see [tracking](../guides/tracking.md)"),
)


def sections() -> list[tuple[str, type[msgspec.Struct], str]]:
    """(title, struct, prefix): the common settings, then every service's, found on disk."""
    from artery.shared import auth, http
    from artery.shared.settings import CommonSettings

    found = [
        ("Every service and the SDK", CommonSettings, "ARTERY_"),
        ("NATS credentials and TLS (every service and the SDK)", auth.NatsAuthSettings, auth.PREFIX),
        ("HTTP servers (inference, console)", http.HttpLimits, http.PREFIX),
    ]
    for path in sorted((ROOT / "services").glob("*/settings.py")):
        module = importlib.import_module(f"artery.services.{path.parent.name}.settings")
        structs = [
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, msgspec.Struct) and cls.__module__ == module.__name__
        ]
        if len(structs) != 1 or not hasattr(module, "PREFIX"):
            raise SystemExit(f"{path}: expected one settings Struct and a PREFIX, found {structs}")
        found.append((path.parent.name.capitalize(), structs[0], module.PREFIX))
    return found


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    from artery.shared.settings import describe

    parts = [INTRO]
    for title, cls, prefix in sections():
        parts.append(f"## {title}\n\n`{cls.__module__}.{cls.__name__}`\n")
        parts.append("| variable | default | meaning |\n|---|---|---|")
        for variable, default, description in describe(cls, prefix):
            parts.append(f"| `{variable}` | `{cell(default)}` | {cell(description)} |")
        parts.append("")
    parts.append("## Read elsewhere\n\n| variable | meaning |\n|---|---|")
    parts.extend(f"| {variable} | {meaning} |" for variable, meaning in ELSEWHERE)
    parts.append("")
    return "\n".join(parts)


def on_files(files, config):
    """MkDocs hook: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files


if __name__ == "__main__":
    print(render())
