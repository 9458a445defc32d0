"""roundpipe's import graph, read from the source: no module is imported, torch is not needed.

Prints the arrows between folders, the module cycles and the arrows that run up the layer order;
``tests/test_import_graph.py`` fails on a new cycle or a new upward arrow.

    .venv/bin/python scripts/import_graph.py            # folders, cycles, upward arrows
    .venv/bin/python scripts/import_graph.py --modules  # ... and every module's imports

It exits with status 1 while it finds anything (the test's allow-list is not applied here).

What counts as an import (module ``A`` imports ``B``):

- every ``import`` and ``from ... import`` statement naming a module of ``roundpipe/``, at module
  level or inside a function alike: an import hidden in a function still makes ``A`` need ``B``;
- ``from P import x`` is an arrow to the module ``P.x`` when ``x`` is a module, else to ``P``;
  importing ``P.x`` also runs the ``__init__`` of ``P``, but that implicit arrow is not counted;
- a package's ``__init__.py`` *is* the package (``roundpipe.train``): an ``__init__`` that
  re-exports its children has arrows down to them, so a child that imports its parent package
  makes the cycle (the child should import the sibling module that defines the name instead);
- an import under ``if TYPE_CHECKING:`` never runs. It is left out of the cycles (a type named in
  a hint, such as the table that ``schedule/check.py`` validates, is not an import order), but it
  counts for the layer order: a lower layer that names an upper layer's type knows about it.

A *unit* is a first-level folder of ``roundpipe/`` (``sim/``) or a top-level module (``config.py``;
``__init__.py`` is the package ``roundpipe`` itself). ``LAYERS`` orders the units bottom to top;
an arrow from a unit to a unit of a higher layer runs *up*. Units of one layer may import each
other, as long as they form no cycle.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "roundpipe"

# The layer order of docs/design.md section 2, bottom to top: a unit imports only units of its own
# layer or of the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors.py", "presets/", "schedule/"),  # plain data and rules; no torch
    ("partition/",),  # costs and the partitioner; no torch
    ("sim/",),  # simulator, tuner, the automatic choice; no torch
    (
        "backend/",
        "config.py",
        "models/",
        "number_codes.py",
        "optim/",
        "settings_table.py",
        "testing/",
    ),  # what the runtime builds on
    ("distributed/",),  # data parallelism's collectives, over the optimizer's master store
    ("runtime/",),  # the Pipeline (its data-parallel side: runtime/data_parallel.py)
    ("train/",),  # the training product
    ("commands/", "cli.py", "__init__.py"),  # the commands, the `roundpipe` entry point, the public API
)


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` (module names) at ``line``; ``type_only`` under TYPE_CHECKING,
    ``deferred`` inside a function (it runs when the function is first called)."""

    source: str
    target: str
    line: int
    type_only: bool = False
    deferred: bool = False


def module_name(path: Path, root: Path) -> str:
    """``roundpipe/sim/engine.py`` -> ``roundpipe.sim.engine``; a package's ``__init__`` is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import node of ``tree``, with whether it sits under ``if TYPE_CHECKING:`` and whether
    inside a function."""
    stack = [(tree, False, False)]
    while stack:
        node, type_only, deferred = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only, deferred
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, True, deferred) for child in node.body)
            stack.extend((child, type_only, deferred) for child in node.orelse)
            continue
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, type_only, inner) for child in ast.iter_child_nodes(node))


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` runs: itself, or the nearest package above it that is a module of ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def arrows_of(name: str, path: Path, modules: dict[str, Path]) -> list[Arrow]:
    """The imports of one module that name modules of the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node, type_only, deferred in _imports(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, modules) for alias in node.names]
        else:
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                child = f"{base}.{alias.name}"
                targets.append(child if child in modules else _resolve(base, modules))
        for target in targets:
            if target is not None and target != name:
                out.append(Arrow(name, target, node.lineno, type_only, deferred))
    return sorted(set(out), key=lambda a: (a.target, a.line))


def unit_of(path: Path, root: Path) -> str:
    """The folder or top-level file a module lies in: ``sim/``, ``config.py``, ``__init__.py``."""
    parts = path.relative_to(root).parts
    return parts[0] + "/" if len(parts) > 1 else parts[0]


def layer_index(layers: tuple[tuple[str, ...], ...] = LAYERS) -> dict[str, int]:
    return {unit: i for i, layer in enumerate(layers) for unit in layer}


def strongly_connected(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The cycles of ``graph``: its strongly connected components of two or more nodes, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    nodes = sorted(set(graph) | {w for ws in graph.values() for w in ws})
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(tuple(sorted(component)))
    return sorted(found)


@dataclass
class ImportGraph:
    """The package's modules, their units and the arrows between them."""

    modules: dict[str, Path]
    units: dict[str, str]  # module -> unit
    arrows: list[Arrow]

    @classmethod
    def read(cls, root: Path = ROOT / PACKAGE) -> ImportGraph:
        modules = find_modules(root)
        arrows = [a for name, path in modules.items() for a in arrows_of(name, path, modules)]
        units = {name: unit_of(path, root) for name, path in modules.items()}
        return cls(modules, units, arrows)

    def module_graph(self, *, type_only: bool = False) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = defaultdict(set)
        for a in self.arrows:
            if type_only or not a.type_only:
                graph[a.source].add(a.target)
        return graph

    def unit_graph(self) -> dict[str, set[str]]:
        graph: dict[str, set[str]] = defaultdict(set)
        for a in self.arrows:
            if self.units[a.source] != self.units[a.target]:
                graph[self.units[a.source]].add(self.units[a.target])
        return graph

    def module_cycles(self) -> list[tuple[str, ...]]:
        """Modules that import each other, directly or round a circle (TYPE_CHECKING imports left out)."""
        return strongly_connected(self.module_graph())

    def type_only_cycles(self) -> list[tuple[str, ...]]:
        """Circles closed only by TYPE_CHECKING imports: shown, not failed on."""
        plain = set(self.module_cycles())
        return [c for c in strongly_connected(self.module_graph(type_only=True)) if c not in plain]

    def unlayered(self, layers=LAYERS) -> list[str]:
        """Units that ``layers`` does not place."""
        return sorted(set(self.units.values()) - set(layer_index(layers)))

    def upward(self, layers=LAYERS) -> list[Arrow]:
        """Arrows from a unit to a unit of a higher layer (TYPE_CHECKING imports included)."""
        layer = layer_index(layers)
        return [
            a
            for a in self.arrows
            if layer.get(self.units[a.source], -1) < layer.get(self.units[a.target], -1)
        ]

    def layer_cycles(self, layers=LAYERS) -> list[tuple[str, ...]]:
        """Units of one layer that import each other round a circle."""
        layer = layer_index(layers)
        same = {u: {w for w in ws if layer.get(w) == layer.get(u)} for u, ws in self.unit_graph().items()}
        return strongly_connected(same)

    def problems(self, layers=LAYERS) -> set[str]:
        """Everything the layer order forbids, one line each (``tests/test_import_graph.py``
        compares them with its allow-list): ``cycle: a b c``, ``up: a -> b``, ``layer cycle: u v``,
        ``no layer: u``; module names without the package prefix."""
        found = {"cycle: " + " ".join(map(_short, c)) for c in self.module_cycles()}
        found |= {f"up: {_short(a.source)} -> {_short(a.target)}" for a in self.upward(layers)}
        found |= {"layer cycle: " + " ".join(c) for c in self.layer_cycles(layers)}
        return found | {f"no layer: {u}" for u in self.unlayered(layers)}


def _short(module: str) -> str:
    return module.partition(".")[2] or module


def report(graph: ImportGraph, *, modules: bool = False) -> str:
    lines = ["layers, bottom to top:"]
    lines += [f"  {i}: {' '.join(layer)}" for i, layer in enumerate(LAYERS)]
    lines.append("\nfolders (-> what they import):")
    units = graph.unit_graph()
    for unit in sorted(set(graph.units.values())):
        lines.append(f"  {unit:<14} -> {' '.join(sorted(units.get(unit, ()))) or '-'}")
    if modules:
        lines.append("\nmodules (-> what they import; name* inside a function, name~ type-only):")
        by_source = defaultdict(list)
        for a in graph.arrows:
            by_source[a.source].append(a)
        for name in sorted(graph.modules):
            targets = sorted(
                {
                    _short(a.target) + ("~" if a.type_only else "*" if a.deferred else "")
                    for a in by_source[name]
                }
            )
            lines.append(f"  {_short(name)} -> {' '.join(targets) or '-'}")
    cycles = graph.module_cycles()
    lines.append(f"\nmodule cycles: {len(cycles)}")
    for cycle in cycles:
        inside = [a for a in graph.arrows if a.source in cycle and a.target in cycle and not a.type_only]
        lines.append("  " + " ".join(_short(m) for m in cycle))
        lines += [f"    {_short(a.source)}:{a.line} -> {_short(a.target)}" for a in inside]
    type_only = graph.type_only_cycles()
    lines.append(f"\ncycles closed only by TYPE_CHECKING imports (not failed on): {len(type_only)}")
    lines += ["  " + " ".join(_short(m) for m in cycle) for cycle in type_only]
    up = graph.upward()
    lines.append(f"\narrows that run up the layer order: {len(up)}")
    lines += [
        f"  {_short(a.source)}:{a.line} -> {_short(a.target)}"
        f"   ({graph.units[a.source]} -> {graph.units[a.target]}){' type-only' if a.type_only else ''}"
        for a in up
    ]
    for cycle in graph.layer_cycles():
        lines.append(f"\nunits of one layer in a cycle: {' '.join(cycle)}")
    for unit in graph.unlayered():
        lines.append(f"\nunit {unit} has no place in LAYERS")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="also list every module's imports")
    args = parser.parse_args(argv)
    graph = ImportGraph.read()
    print(report(graph, modules=args.modules))
    return 1 if graph.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
