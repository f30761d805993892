"""The layering a reader relies on, checked from the source: services know each other only through
``schemas`` and ``shared`` (a service imports nothing of ``artery.*`` but those and its own
package); ``shared`` and ``schemas`` know no service and no SDK module; no two modules import each
other at load time (an import loop makes the load order matter), and in the SDK not even for a
type; the SDK imports no service; each top-level package says which folder it is and is linked
under ``artery/`` so static tools resolve it; test-only code lives in ``artery.testing``, not in
``shared``; a module over ``MAX_LINES`` says why."""

from __future__ import annotations

import ast
import functools
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Top-level folders and the import names they are installed under (each linked under ``artery/``).
FOLDERS = {
    "artery": "artery",
    "services": "artery.services",
    "shared": "artery.shared",
    "schemas": "artery.schemas",
}


#: The top-level folders that ``artery/`` holds as links (``artery/shared -> ../shared``).
LINKED = ("services", "shared", "schemas")


@functools.cache
def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if folder == "artery" and path.relative_to(ROOT / folder).parts[0] in LINKED:
                continue  # the same file as under its own top-level folder
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


#: Parses every source file in a child process and writes the trees, pickled, to stdout.
_PARSE_ALL = """
import ast, pickle, sys
paths = sys.stdin.read().split("\\n")
sys.stdout.buffer.write(pickle.dumps({p: ast.parse(open(p, encoding="utf-8").read()) for p in paths}))
"""


@functools.cache
def _trees() -> dict[str, ast.Module]:
    """Every project source file's syntax tree, parsed in a child process of its own.

    Python 3.11's ``ast.parse`` keeps its recursion-depth count in state shared between threads
    (CPython gh-106905): when any other thread of the test process parses at the same time (3.11
    formats a traceback by parsing the failing line), the conversion raises ``SystemError: AST
    constructor recursion depth mismatch``. A child process has no other threads."""
    # Resolved: a file under ``artery/``'s linked folders is its top-level folder's file, parsed once.
    paths = sorted(
        {str(p.resolve()) for folder in (*FOLDERS, *CODE_FOLDERS) for p in (ROOT / folder).rglob("*.py")}
    )
    done = subprocess.run(
        [sys.executable, "-c", _PARSE_ALL], input="\n".join(paths).encode(), capture_output=True, check=True
    )
    return pickle.loads(done.stdout)


def parsed(path: Path) -> ast.Module:
    return _trees()[str(path.resolve())]


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

    tree = parsed(path)
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
    loops = _loops(graph)
    assert not loops, "import loops: " + "; ".join(loops)


def _loops(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first walk meets, as ``a -> b -> a``."""
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
    return loops


def test_no_import_loops_in_the_sdk_even_for_types():
    """In ``artery/``, each file depends one way: not even a type-only (``TYPE_CHECKING``) or a
    deferred (in a function) import goes back, so a reader can take the modules in order."""
    sdk = {m: p for m, p in modules().items() if p.is_relative_to(ROOT / "artery")}
    graph = {
        module: {
            target
            for target in imported(path, load_time=False)
            if target in sdk and target != module and not target.startswith(module + ".")
        }
        for module, path in sdk.items()
    }
    loops = _loops(graph)
    assert not loops, "import loops: " + "; ".join(loops)


#: The most lines a module has before it must say, near its top, why it is one module.
MAX_LINES = 400
#: The line that says it, in the module's docstring or a comment among its first lines.
LONG_MARKER = "Long module:"
#: Where the project's own code is (tests aside): the installed folders, benchmarks, examples.
CODE_FOLDERS = ("artery", "services", "shared", "schemas", "loadtests", "examples")


def _states_why(path: Path) -> bool:
    """A line of the module's docstring, or a comment among its first lines, starts with the marker."""
    text = path.read_text()
    lines = (ast.get_docstring(parsed(path)) or "").splitlines() + text.splitlines()[:40]
    return any(line.lstrip("# ").startswith(LONG_MARKER) for line in lines)


def test_long_modules_say_why_they_are_one_module():
    long = []
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if len(path.read_text().splitlines()) > MAX_LINES and not _states_why(path):
                long.append(path.relative_to(ROOT).as_posix())
    assert not long, f"over {MAX_LINES} lines without a '{LONG_MARKER} <reason>' line at the top: {long}"


def test_each_top_level_package_says_which_folder_it_is():
    """The mapping of import names onto folders is visible where a reader lands: each folder's
    ``__init__`` docstring names both (docs/architecture/layout.md maps them all)."""
    for folder, name in FOLDERS.items():
        doc = ast.get_docstring(parsed(ROOT / folder / "__init__.py")) or ""
        assert f"``{name}``" in doc or f"``import {name}" in doc, f"{folder}/__init__.py: name {name}"
        assert f"``{folder}/``" in doc or folder == "artery", f"{folder}/__init__.py: name its folder"


def test_the_top_level_folders_are_linked_where_their_import_names_are():
    """``artery/shared`` is ``shared/`` (a relative link, so a checkout anywhere resolves), which is
    what lets mypy, pyright and an editor's go-to-definition find ``artery.shared.codec``: no
    import hook and no package-dir mapping stands between an import name and its file."""
    for folder in LINKED:
        link = ROOT / "artery" / folder
        assert link.is_symlink() and link.readlink() == Path("..") / folder, f"artery/{folder}"
        assert link.resolve() == (ROOT / folder).resolve()
    assert "package-dir" not in (ROOT / "pyproject.toml").read_text()


#: What ``artery/`` holds beside the SDK: operator tools (the ``artery`` command, the embedded
#: stack, replay, export), the demos, and the test kit. These may know the services.
OUTSIDE_THE_SDK = ("artery.ops", "artery.demos", "artery.testing")


def test_the_sdk_imports_no_service():
    """An SDK module runs in the agent's program: a service's module would drag its dependencies
    (and its settings) there. What both need (the contract's number rule) lives in ``shared``;
    operator tools, demos and the test kit, which may know the services, are subpackages of
    their own."""
    for module, path in modules().items():
        if module.startswith(("artery.services", "artery.shared", "artery.schemas", *OUTSIDE_THE_SDK)):
            continue
        services = sorted(n for n in imported(path, load_time=False) if n.startswith("artery.services"))
        assert not services, f"{path.relative_to(ROOT)} imports a service: {services}"


def test_test_only_code_is_not_in_shared():
    """``shared`` is what the services run on; what only tests and benchmarks use (a NATS cluster
    of child processes, stand-in judges) is the test kit, ``artery.testing``."""
    for path in sorted((ROOT / "shared").rglob("*.py")):
        tree = parsed(path)
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"pytest", "artery.testing"}, f"{path.relative_to(ROOT)} is test code"
