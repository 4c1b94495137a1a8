"""No import circle anywhere in `fimoe_lab/`: the package's modules import in one direction.

The graph is read statically (`ast`) from every `.py` file of the package, so it sees every import a module can
run, not only those a test happens to trigger:

- `import fimoe_lab.a.b` and `from fimoe_lab.a import b` (or the relative `from .a import b`) are an edge to the
  module `fimoe_lab.a.b`; `from fimoe_lab.a import name` where `name` is not a submodule is an edge to the package
  `fimoe_lab.a` (its `__init__`).
- Imports inside functions count as well as module-level ones: a function-local import only defers the cycle to
  run time, it does not remove the two-way dependence, and it is the usual way a circle hides.
- Imports under `if TYPE_CHECKING:` do not count: they never run, and annotations may name types of a layer above.
- A parent package that Python runs on the way to a submodule (`fimoe_lab/checkpoints/__init__.py` before
  `fimoe_lab.checkpoints.reader`) is not an edge: a package's `__init__` is its public facade, it re-exports what
  its modules define, so every module of a package would otherwise sit in a circle with its own facade.

No private name crosses modules either: no module imports a `_name` from another fimoe_lab module or reads
`module._name` of one it imported; what modules share is public (and documented where it is defined).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "fimoe_lab"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of the tree (functions included), skipping `if TYPE_CHECKING:` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking_block(node):
            stack.extend(getattr(node, "orelse", []))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names if alias.name in modules)
            continue
        if node.level:
            base_parts = here.split(".")
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base not in modules:
            continue
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in modules else base)
    targets.discard(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    """Module name -> the `fimoe_lab` modules it imports (statically, functions included)."""
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle `[a, b, ..., a]` of the graph, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path = [root]
        iters = [iter(sorted(graph[root]))]
        state[root] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "fimoe_lab.layout" in graph and "fimoe_lab.checkpoints.reader" in graph
    # a known one-way edge, so an empty graph cannot pass
    assert "fimoe_lab.layout" in graph["fimoe_lab.steps"]


def test_find_cycle_names_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def private_crossings() -> list[str]:
    """``path:line: what`` for every `_name` (not dunder) that a module takes from another fimoe_lab module."""
    found = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported: set[str] = set()  # local names bound to fimoe_lab modules or their members
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fimoe_lab")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{name}:{node.lineno}: imports {alias.name}")
                    imported.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                imported.update(
                    (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("fimoe_lab")
                )
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in imported
            ):
                found.append(f"{name}:{node.lineno}: reads {node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_modules():
    assert private_crossings() == []


def test_no_import_circle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])
