#!/usr/bin/env python3
"""Check the import graph of tpagent's packages: no cycle, and no layer importing one above it.

    usage: check_layers.py [ROOT]        ROOT: the repository (by default, this script's)

The layers are written in one place, ROOT's pyproject.toml::

    [tool.tpagent.layers]
    order = ["host", "snapshot", ..., "tpagent.daemon", "cli"]   # bottom to top
    beside = "tpagent_rank"                                       # loaded into users' processes

A layer is a top-level package or a subpackage; a module belongs to the longest layer that is a
prefix of its dotted name (``tpagent.migration.source`` to ``tpagent.migration``, the package
``tpagent`` itself to ``tpagent``).  Every ``.py`` under the layers' top-level packages is
parsed with ``ast`` (nothing is imported or run; protoc's generated ``*_pb2*.py`` are left out).
Every import counts wherever it stands (in a function, under ``if TYPE_CHECKING:``), relative
ones resolved, and so does ``importlib.import_module("a.literal.name")``.  The rules:

  * no cycle between modules;
  * a module imports only modules of its own layer and of the layers below it;
  * the package beside them (tpagent_rank), which is loaded into users' training processes,
    imports only itself, the standard library, and torch (the user's own); a module of it that
    imports torch at its top is imported by the others only inside a function (lazily), and
    never by the package itself.  Any layer may import its modules that need no torch;
  * the code keeps its shape: no module over MAX_MODULE lines; no function over MAX_FUNCTION
    lines unless a comment on its ``def`` line (or the line above) says why, starting ``# long:``;
    no line that packs several assignments (``a, b = x, y``; a swap or rotation of the same
    names is one assignment).

Prints a summary of the graph (for the release notes) on stdout, one line per problem on
stderr, and exits 1 if there was any problem (2: ROOT is not a directory).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

#: What the package beside the layers may import besides itself and the standard library.
RANK_MAY_IMPORT = frozenset({"torch"})
MAX_LINE = 120
MAX_MODULE = 500
MAX_FUNCTION = 80


@dataclass(frozen=True)
class Layers:
    """``[tool.tpagent.layers]`` of the repository's pyproject.toml."""

    order: tuple[str, ...]  # bottom to top: top-level packages and subpackages
    beside: str  # the package loaded into users' processes

    @property
    def packages(self) -> tuple[str, ...]:
        """The top-level packages read: the layers' and the one beside them."""
        return (*dict.fromkeys(layer.split(".")[0] for layer in self.order), self.beside)

    def of(self, name: str) -> str | None:
        """The layer of module ``name``: the longest layer that is ``name`` or a package above it."""
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in self.order:
                return ".".join(parts[:n])
        return None

    def below(self, a: str, b: str) -> bool:
        return self.order.index(a) < self.order.index(b)


def read_layers(root: Path) -> Layers:
    """The layers written in ``root``/pyproject.toml (ValueError says what is wrong)."""
    try:
        table = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["tpagent"]["layers"]
        order = table["order"]
        beside = table["beside"]
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{root / 'pyproject.toml'} has no [tool.tpagent.layers] with order and beside ({e})") from e
    if not (isinstance(order, list) and order and all(isinstance(x, str) and x for x in order)):
        raise ValueError("[tool.tpagent.layers] order must be a list of package names, bottom to top")
    if len(set(order)) != len(order) or not isinstance(beside, str) or beside in order:
        raise ValueError("[tool.tpagent.layers] names a layer twice, or beside is not one name of its own")
    return Layers(tuple(order), beside)


@dataclass(frozen=True)
class Import:
    name: str  # absolute: "a.b" for ``import a.b``, "a.b.c" for ``from a.b import c``
    line: int
    in_function: bool  # run when the function is called, not at import


@dataclass
class Module:
    name: str
    path: Path  # relative to ROOT
    lines: list[str]
    imports: list[Import] = field(default_factory=list)
    tree: ast.Module | None = None

    @property
    def package(self) -> str:
        return self.name.split(".")[0]


class _Imports(ast.NodeVisitor):
    """The imports of one module, relative ones made absolute against ``package``."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.found: list[Import] = []
        self.errors: list[tuple[int, str]] = []
        self._depth = 0  # functions we are inside

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, name: str, node: ast.stmt | ast.expr) -> None:
        self.found.append(Import(name, node.lineno, self._depth > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            if node.level > len(parts):
                self.errors.append((node.lineno, "a relative import goes above the top-level package"))
                return
            base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
        for alias in node.names:
            self._add(base if alias.name == "*" else f"{base}.{alias.name}", node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
                self._add(arg.value, node)
        self.generic_visit(node)


def _is_generated(path: Path) -> bool:
    return path.stem.endswith(("_pb2", "_pb2_grpc"))


def read_modules(root: Path, layers: Layers) -> tuple[dict[str, Module], list[str]]:
    """Every module of the packages under ``root``, by dotted name, and the problems met."""
    modules: dict[str, Module] = {}
    problems: list[str] = []
    for package in layers.packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            if _is_generated(path) or "__pycache__" in rel.parts:
                continue
            parts = rel.with_suffix("").parts
            is_init = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_init else parts)
            text = path.read_text(encoding="utf-8")
            module = Module(name, rel, text.splitlines())
            modules[name] = module
            try:
                tree = ast.parse(text, filename=str(rel))
            except SyntaxError as e:
                problems.append(f"{rel}:{e.lineno}: cannot be parsed: {e.msg}")
                continue
            module.tree = tree
            visitor = _Imports(name if is_init else name.rpartition(".")[0])
            visitor.visit(tree)
            module.imports = visitor.found
            problems += [f"{rel}:{line}: {msg}" for line, msg in visitor.errors]
    return modules, problems


def resolve(name: str, modules: dict[str, Module]) -> str:
    """The module that importing ``name`` runs: ``name`` itself or the longest prefix of it
    that is a module of ours (``from a import b`` where ``b`` is a function names ``a.b``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return name


def edges_of(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    """module -> {module of ours it imports: the line of the first such import}."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, module in modules.items():
        for imp in module.imports:
            target = resolve(imp.name, modules)
            if target in modules and target != name:
                graph[name].setdefault(target, imp.line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (each one a cycle
    or several tied together), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth first within it)."""
    start = component[0]
    members = set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in members and w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle")  # (a strongly connected component has one)


def cycle_problems(modules: dict[str, Module], graph: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for component in strongly_connected(graph):
        cycle = shortest_cycle(graph, component)
        where = ", ".join(f"{modules[a].path}:{graph[a][b]}" for a, b in pairwise(cycle))
        line = f"cycle: {' -> '.join(cycle)} ({where})"
        rest = sorted(set(component) - set(cycle))
        if rest:
            line += f"; tied into it too: {', '.join(rest)}"
        out.append(line)
    return out


def layer_problems(modules: dict[str, Module], layers: Layers) -> list[str]:
    stdlib = sys.stdlib_module_names
    rank = layers.beside
    tops = {layer.split(".")[0] for layer in layers.order}
    order = " < ".join(layers.order)
    # The modules beside the layers that need torch to exist (its delegating backend): they may import it
    # at their top, as long as the rest of that package imports them only lazily, in a function.
    torch_bound = {
        m.name
        for m in modules.values()
        if m.package == rank and any(i.name.split(".")[0] in RANK_MAY_IMPORT and not i.in_function for i in m.imports)
    }
    out = []
    for module in modules.values():
        mine = layers.of(module.name)
        for imp in module.imports:
            top = imp.name.split(".")[0]
            at = f"{module.path}:{imp.line}: {module.name} imports {imp.name}"
            if module.package == rank:
                if top in tops:
                    layered = ", ".join(sorted(tops))
                    out.append(f"{at}: {rank} runs in users' processes and imports nothing of {layered}")
                elif top not in stdlib and top not in RANK_MAY_IMPORT and top != rank:
                    out.append(f"{at}: {rank} imports only the standard library and torch")
                elif top in RANK_MAY_IMPORT and not imp.in_function and module.name == rank:
                    out.append(f"{at} at import time: importing {rank} must not import torch")
                elif imp.name in torch_bound and not imp.in_function and module.name not in torch_bound:
                    out.append(f"{at} (which needs torch) at import time: import it inside the function that needs it")
                continue
            theirs = layers.of(resolve(imp.name, modules)) if top in tops else None
            if mine is not None and theirs is not None and layers.below(mine, theirs):
                out.append(f"{at}: {mine} imports {theirs}, a layer above it ({order})")
            elif top == rank and resolve(imp.name, modules) in torch_bound and not imp.in_function:
                out.append(f"{at} (which needs torch) at import time: import it inside the function that needs it")
    return out


def _functions(module: Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    nodes = ast.walk(module.tree) if module.tree is not None else ()
    return [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _length(node: ast.stmt) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1


def _said_why(module: Module, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether a comment on the ``def`` line, or on the line above it, says why it is long."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    around = module.lines[max(0, first - 2) : node.lineno]
    return any("# long:" in line for line in around)


def _packed(node: ast.AST) -> bool:
    """``a, b = x, y``: several assignments on one line (not a swap or rotation of the same names)."""
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple)):
        return False
    targets, value = node.targets[0].elts, node.value
    if not isinstance(value, ast.Tuple) or len(value.elts) != len(targets) or len(targets) < 2:
        return False
    return sorted(map(ast.unparse, targets)) != sorted(map(ast.unparse, value.elts))


def shape_problems(modules: dict[str, Module]) -> list[str]:
    out = []
    for module in modules.values():
        if len(module.lines) > MAX_MODULE:
            out.append(f"{module.path}: {len(module.lines)} lines, over {MAX_MODULE}: split it along a real seam")
        for fn in _functions(module):
            if _length(fn) > MAX_FUNCTION and not _said_why(module, fn):
                out.append(
                    f"{module.path}:{fn.lineno}: {fn.name} is {_length(fn)} lines, over {MAX_FUNCTION}: make it "
                    "named steps, or say why on its def line (# long: ...)"
                )
        if module.tree is not None:
            out += [
                f"{module.path}:{node.lineno}: several assignments on one line: one per line"
                for node in ast.walk(module.tree)
                if _packed(node)
            ]
    return out


def summary(modules: dict[str, Module], graph: dict[str, dict[str, int]], layers: Layers) -> list[str]:
    """The graph in a few lines: modules per layer, the imports between layers (the import graph
    of the packages and subpackages), the largest module, lines over MAX_LINE."""

    def layer(name: str) -> str:
        return layers.of(name) or layers.beside

    per_layer = Counter(layer(m) for m in modules)
    counts = ", ".join(f"{x} {per_layer[x]}" for x in (*layers.order, layers.beside) if per_layer[x])
    total_lines = sum(len(m.lines) for m in modules.values())
    crossing = Counter((layer(a), layer(b)) for a, targets in graph.items() for b in targets if layer(a) != layer(b))
    between = ", ".join(f"{a} -> {b} {n}" for (a, b), n in sorted(crossing.items())) or "none"
    edges = sum(map(len, graph.values()))
    long_lines = Counter({str(m.path): sum(len(line) > MAX_LINE for line in m.lines) for m in modules.values()})
    files_with = sum(1 for n in long_lines.values() if n)
    worst = ", ".join(f"{path} {n}" for path, n in long_lines.most_common(5) if n)
    out = [
        f"modules: {len(modules)} ({counts}), {total_lines} lines",
        f"imports between them: {edges} edges; between layers: {between}",
    ]
    if modules:
        largest = max(modules.values(), key=lambda m: len(m.lines))
        out.append(f"largest module: {largest.path}, {len(largest.lines)} lines")
    functions = [(_length(fn), m, fn) for m in modules.values() for fn in _functions(m)]
    if functions:
        n, m, fn = max(functions, key=lambda x: x[0])
        out.append(f"longest function: {m.path}:{fn.lineno} {fn.name}, {n} lines")
    out.append(f"lines over {MAX_LINE} characters: {long_lines.total()} in {files_with} files")
    if worst:
        out[-1] += f" (most: {worst})"
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: check_layers.py [ROOT]", file=sys.stderr)
        return 2
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    if not root.is_dir():
        print(f"check_layers.py: {root} is not a directory; give the repository's root.", file=sys.stderr)
        return 2
    try:
        layers = read_layers(root)
    except ValueError as e:
        print(f"check_layers.py: {e}.", file=sys.stderr)
        return 2
    modules, problems = read_modules(root, layers)
    graph = edges_of(modules)
    problems = [*cycle_problems(modules, graph), *layer_problems(modules, layers), *shape_problems(modules), *problems]
    print("\n".join(summary(modules, graph, layers)), flush=True)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
