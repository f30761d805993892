"""The README stays a front page, and its links and the generated configuration page hold.

`make docs` builds the site in strict mode (broken links inside docs/ fail there); the README is
read on the forge, outside MkDocs, so its links are checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

from artery.shared.settings import describe
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def load_generator():
    return load_script(ROOT / "docs" / "gen_config.py", "gen_config")


def test_readme_is_a_front_page():
    lines = README.count("\n")
    assert lines <= 200, f"README.md has {lines} lines; the rest belongs in docs/"
    # CI's .ci/run runs `make test` as the README's test command.
    assert "make test   #" in README and "make demo   #" in README


def test_readme_links_resolve():
    targets = re.findall(r"\]\(((?!https?://)[^)#\s]+)(?:#[^)]*)?\)", README)
    assert targets, "the README links into docs/"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_configuration_page_lists_every_setting_of_every_service():
    generator = load_generator()
    sections = generator.sections()
    services = {path.parent.name for path in (ROOT / "services").glob("*/settings.py")}
    assert {title.lower() for title, _, _ in sections} >= services
    page = generator.render()
    for _, cls, prefix in sections:
        for variable, default, description in describe(cls, prefix):
            assert f"| `{variable}` | `{default}` |" in page.replace("\\|", "|"), variable
            assert description, f"{variable} has no description in its settings struct"


def test_configuration_page_lists_what_artery_config_prints(capsys):
    from artery.ops.cli import cmd_config

    cmd_config(None)
    printed = re.findall(r"^(ARTERY_\w+)", capsys.readouterr().out, flags=re.M)
    assert len(printed) > 50
    page = load_generator().render()
    missing = [variable for variable in printed if f"`{variable}`" not in page]
    assert not missing, f"docs/gen_config.py leaves out settings artery config prints: {missing}"
