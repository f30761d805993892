"""The layering a reader relies on, checked from the source: services know each other only through
``schemas`` and ``shared``; ``shared`` and ``schemas`` know no service and no SDK module; and no two
modules import each other at load time (an import loop makes the load order matter)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Top-level folders and the import names they are installed under (pyproject's package-dir).
FOLDERS = {
    "artery": "artery",
    "services": "artery.services",
    "shared": "artery.shared",
    "schemas": "artery.schemas",
}


@functools.cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def imported(path: Path, *, load_time: bool) -> set[str]:
    """The project's modules ``path`` imports: every import, or (``load_time``) only those run when
    it is imported (module level, not under ``if TYPE_CHECKING``; function bodies are deferred)."""
    known = modules()
    found: set[str] = set()

    def add(node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif node.module and node.level == 0 and node.module.startswith("artery"):
            for alias in node.names:  # ``from package import module`` needs that module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                add(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)

    tree = ast.parse(path.read_text())
    if load_time:
        visit(tree.body)
    else:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                add(node)
    return {name for name in found if name in known}


def test_services_shared_and_schemas_never_import_the_sdk():
    for module, path in modules().items():
        if module.startswith("artery.services"):
            allowed = ("artery.shared", "artery.schemas", "artery.services")
        elif module.startswith(("artery.shared", "artery.schemas")):
            allowed = ("artery.shared", "artery.schemas")
        else:
            continue
        wrong = sorted(n for n in imported(path, load_time=False) if not n.startswith(allowed))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_services_know_each_other_only_through_subjects():
    for module, path in modules().items():
        if module.count(".") < 2 or not module.startswith("artery.services."):
            continue
        service = module.split(".")[2]
        others = sorted(
            n
            for n in imported(path, load_time=False)
            if n.startswith("artery.services.") and n.split(".")[2] != service
        )
        assert not others, f"{path.relative_to(ROOT)} imports another service: {others}"


def test_no_load_time_import_loops():
    graph = {
        module: {
            target
            for target in imported(path, load_time=True)
            # A package's __init__ importing its own submodules is how packages work.
            if target != module and not target.startswith(module + ".")
        }
        for module, path in modules().items()
    }
    state: dict[str, str] = {}
    loops: list[str] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                loops.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                walk(target, [*stack, target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not loops, "import loops: " + "; ".join(loops)
