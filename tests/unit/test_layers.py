"""Layering, checked on the source with `ast` (nothing is imported to check it).

1. The pure core (engine, model, quant, weights, tokenizer, parallel, routing, control, index,
   transfer, sim, kernels) imports no `tandem.services`, no grpc and no asyncio, and does not touch
   the process environment: services parse flags and environment and pass plain config in
   (STYLE.md 1, 3, 16).
2. Nothing under `tandem/` (but its linked services/ folder) imports `tandem.services` (the
   `tandem` command lives in tandem.services.cli).
3. The project's own modules (`tandem` with its linked `services/` and `kernels/` folders:
   `tandem.services`, `tandem.kernels`) import each other without a cycle.

Every import counts, wherever it is: one inside a function runs only on some code path, so a
top-level-only scan would miss exactly the lazy imports that hide a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[2]
PURE_DIRS = (
    "tandem/engine",
    "tandem/model",
    "tandem/quant",
    "tandem/weights",
    "tandem/tokenizer",
    "tandem/parallel",
    "tandem/routing",
    "tandem/control",
    "tandem/index",
    "tandem/transfer",
    "tandem/sim",
    "kernels",
)
PROJECT_PACKAGES = ("tandem", "services", "kernels")
# Top-level folders linked into the package (tandem/services, tandem/kernels): their modules
# are tandem.services.* and tandem.kernels.*, the only names the project installs.
LINKED_DIRS = ("services", "kernels")
GENERATED_DIRS = ("tandem/v1",)  # protos/generate.py output
# Attributes of `os` that read or write the process environment.
ENV_NAMES = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


class Import(NamedTuple):
    line: int
    module: str  # absolute: relative imports are resolved against the importing file
    names: tuple[str, ...]  # `from module import names`; () for `import module`


def python_files(root: Path, dirs: Sequence[str], exclude: Sequence[str] = ()) -> list[Path]:
    skip = [root / d for d in exclude]
    return sorted(
        p
        for d in dirs
        for p in (root / d).rglob("*.py")
        if not any(p.is_relative_to(s) for s in skip)
    )


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts and parts[0] in LINKED_DIRS:  # installed (and imported) under `tandem`
        parts.insert(0, "tandem")
    return ".".join(parts)


def imports(tree: ast.AST, path: Path, root: Path) -> Iterator[Import]:
    """Every import statement in `tree`, at any depth."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, ())
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                # `from ..x import y` in package a.b.c names a.b.x; it cannot climb out of
                # the top-level package (Python raises ImportError for that).
                parts = package.split(".") if package else []
                up = node.level - 1
                if up >= len(parts):
                    raise ValueError(f"{path}:{node.lineno}: relative import beyond top level")
                module = ".".join([*parts[: len(parts) - up], *([module] if module else [])])
            yield Import(node.lineno, module, tuple(a.name for a in node.names))


def _is_services(module: str) -> bool:
    return module == "tandem.services" or module.startswith("tandem.services.")


def _forbidden_module(module: str) -> bool:
    top = module.partition(".")[0]
    # grpc_health, grpc_reflection, grpc_status are grpc too.
    return _is_services(module) or top in ("asyncio", "grpc") or top.startswith("grpc_")


def forbidden_imports(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """What a core module must not do, as "file:line: what" in line order (file from root)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    os_aliases: set[str] = set()
    for imp in imports(tree, path, root):
        if _forbidden_module(imp.module):
            found.append((imp.line, f"imports {imp.module}"))
        elif imp.module == "os":
            found.extend((imp.line, f"os.{n}") for n in imp.names if n in ENV_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_aliases.update(a.asname or a.name for a in node.names if a.name == "os")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ENV_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id in os_aliases
        ):
            found.append((node.lineno, f"os.{node.attr}"))
    rel = path.relative_to(root).as_posix()
    return [f"{rel}:{line}: {what}" for line, what in sorted(found)]


def import_graph(
    root: Path, packages: Sequence[str], exclude: Sequence[str] = ()
) -> dict[str, dict[str, int]]:
    """Module -> {project module it imports: line of the first such import}.

    `from a import b` is an edge to the module a.b when that is a module, else to a.
    `import a.b.c` is an edge to a.b.c only, although Python runs a and a.b first: counting
    the parents would make every package whose `__init__` re-exports its submodules a cycle.
    """
    paths = {module_name(p, root): p for p in python_files(root, packages, exclude)}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        edges: dict[str, int] = {}
        for imp in imports(ast.parse(path.read_text(), str(path)), path, root):
            attrs = [n for n in imp.names if f"{imp.module}.{n}" not in paths]
            targets = [f"{imp.module}.{n}" for n in imp.names if n not in attrs]
            if attrs or not imp.names:  # `import m`, or names defined in m itself
                targets.append(imp.module)
            for target in targets:
                if target in paths and target != name:
                    edges[target] = min(edges.get(target, imp.line), imp.line)
        graph[name] = edges
    return graph


def find_cycle(graph: Mapping[str, Mapping[str, int]]) -> list[str] | None:
    """One cycle as [a, b, ..., a] (deterministic: nodes visited in sorted order), or None."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if nxt in stack:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle is not None:
                    return cycle
        stack.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            cycle = visit(node)
            if cycle is not None:
                return cycle
    return None


def describe_cycle(cycle: Sequence[str], graph: Mapping[str, Mapping[str, int]]) -> str:
    """ "a -> b (a:12) -> a (b:3)": each arrow with the line of the importing statement."""
    hops = [f"{dst} ({src}:{graph[src][dst]})" for src, dst in zip(cycle, cycle[1:], strict=False)]
    return " -> ".join([cycle[0], *hops])


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# ----------------------------------------------------------------------------- the real tree


def test_core_imports_no_services_grpc_asyncio_and_reads_no_environment() -> None:
    for d in PURE_DIRS:  # a renamed package would otherwise drop out of the check silently
        assert any((REPO_ROOT / d).rglob("*.py")), f"{d} has no Python files"
    problems = [p for f in python_files(REPO_ROOT, PURE_DIRS) for p in forbidden_imports(f)]
    assert problems == []


def test_tandem_imports_no_services() -> None:
    """The library (`tandem`: core, client, ctl; not its linked services/ folder) stands below
    the services: the `tandem` command, which starts them, lives in tandem.services.cli."""
    found = [
        f"{path.relative_to(REPO_ROOT)}:{imp.line}: {imp.module}"
        for path in python_files(REPO_ROOT, ("tandem",), GENERATED_DIRS)
        for imp in imports(ast.parse(path.read_text(), str(path)), path, REPO_ROOT)
        if _is_services(imp.module)
    ]
    assert any(python_files(REPO_ROOT, ("tandem",)))
    assert found == []


def test_every_import_names_the_installed_package() -> None:
    """Only `tandem` is installed: the services/ and kernels/ folders are tandem.services and
    tandem.kernels. An import under their folder names would load a second copy of a module
    from a checkout (or fail when installed), and `kernels` is Hugging Face's distribution."""
    dirs = (*PROJECT_PACKAGES, "tests", "benchmarks", "scripts", "protos")
    found = [
        f"{path.relative_to(REPO_ROOT)}:{imp.line}: {imp.module}"
        for path in python_files(REPO_ROOT, dirs, GENERATED_DIRS)
        for imp in imports(ast.parse(path.read_text(), str(path)), path, REPO_ROOT)
        if imp.module.partition(".")[0] in LINKED_DIRS
    ]
    assert found == []


def test_no_import_cycle_among_project_modules() -> None:
    graph = import_graph(REPO_ROOT, PROJECT_PACKAGES, GENERATED_DIRS)
    assert "tandem.transfer.nixl" in graph and "tandem.services.up" in graph
    # The builder sees edges of every kind in this tree: a lazy one and a submodule one.
    assert "tandem.services.up" in graph["tandem.services.cli.main"]  # imported inside a function
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {describe_cycle(cycle, graph)}"


# ------------------------------------------------------------------ the checkers on fixtures


def test_forbidden_imports_reports_exactly_the_violations(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "core/__init__.py": "",
            "core/net.py": '"""Talks gRPC."""\nimport json\nimport grpc.aio\n',
            "core/lazy.py": (
                "def to_proto(x):\n"
                "    from tandem.services.common import convert\n"
                "    return convert.f(x)\n"
            ),
            "core/env.py": 'import os\n\nLEVEL = os.environ.get("X")\n',
            "core/env_alias.py": (
                "from os import getenv\n"
                "import os as _os\n"
                "\n"
                "def f():\n"
                "    import asyncio\n"
                '    _os.putenv("A", "1")\n'
                '    return getenv("X")\n'
            ),
            # Relative imports name the project's own modules, not grpc or services.
            "core/rel.py": "from .grpc import stub\nfrom . import services\n",
            "core/clean.py": (
                "import os\n"
                "import os.path\n"
                "\n"
                "environ = {}\n"
                "def cache_dir(home: str) -> str:\n"
                '    return os.path.join(home, environ.get("sub", "cache"))\n'
            ),
        },
    )
    reported = {
        p.name: forbidden_imports(p, tmp_path) for p in sorted((tmp_path / "core").glob("*.py"))
    }
    assert reported == {
        "__init__.py": [],
        "clean.py": [],
        "env.py": ["core/env.py:3: os.environ"],
        "env_alias.py": [
            "core/env_alias.py:1: os.getenv",
            "core/env_alias.py:5: imports asyncio",
            "core/env_alias.py:6: os.putenv",
        ],
        "lazy.py": ["core/lazy.py:2: imports tandem.services.common"],
        "net.py": ["core/net.py:3: imports grpc.aio"],
        "rel.py": [],
    }


def test_import_graph_finds_a_cycle_through_every_kind_of_edge(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            # `from pkg import b` names the submodule pkg.b, not the package.
            "pkg/a.py": "import json\nfrom pkg import b\n",
            "pkg/b.py": "from .c import helper\n",
            # Closes the cycle only inside a function.
            "pkg/c.py": "def helper():\n    import pkg.a\n    return pkg.a\n",
            "pkg/d.py": "from pkg.a import thing\n",
        },
    )
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {
        "pkg": {},
        "pkg.a": {"pkg.b": 2},
        "pkg.b": {"pkg.c": 1},
        "pkg.c": {"pkg.a": 2},
        "pkg.d": {"pkg.a": 1},
    }
    cycle = find_cycle(graph)
    assert cycle == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert describe_cycle(cycle, graph) == (
        "pkg.a -> pkg.b (pkg.a:2) -> pkg.c (pkg.b:1) -> pkg.a (pkg.c:2)"
    )

    # Without the lazy import the same tree is acyclic (d -> a -> b -> c is a chain).
    (tmp_path / "pkg/c.py").write_text("def helper():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, ["pkg"])) is None
