"""Imports point downward: no module circle, no arrow up the layer order of docs/design.md section 2.

``scripts/import_graph.py`` reads the imports from the source (no module is imported, torch is not
needed) and declares the layer order; its docstring says what counts as an import. Run it to see
the graph, the circles and the upward arrows with their line numbers.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What the checker finds and may stay: nothing. An entry must name an arrow that still occurs (the
# test fails on an entry that no longer does, so the list cannot go stale) and say why it stays.
KNOWN: set[str] = set()


def _load_checker():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


checker = _load_checker()


@pytest.fixture(scope="module")
def graph():
    return checker.ImportGraph.read(ROOT / "roundpipe")


def test_no_new_import_circle_or_upward_arrow_and_the_allow_list_is_exact(graph):
    found = graph.problems()
    new, gone = sorted(found - KNOWN), sorted(KNOWN - found)
    assert not new, (
        "imports that break the layer order (run scripts/import_graph.py for lines; move the shared "
        "definition down or pass it in, do not hide the import in a function):\n  " + "\n  ".join(new)
    )
    assert not gone, "allow-list entries that no longer occur; delete them from KNOWN:\n  " + "\n  ".join(
        gone
    )


def test_every_folder_and_top_level_module_has_a_place_in_the_layer_order(graph):
    assert graph.unlayered() == []
    declared = [unit for layer in checker.LAYERS for unit in layer]
    assert len(declared) == len(set(declared)), "a unit is declared in two layers"
    assert set(declared) == set(graph.units.values()), "LAYERS names a folder or file that is gone"


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


def test_an_import_inside_a_function_closes_a_circle_and_a_type_checking_one_does_not(tmp_path):
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "from pkg.low.a import A\n",
            "pkg/low/a.py": "class A:\n    def b(self):\n        from . import b\n        return b\n",
            "pkg/low/b.py": "from pkg.low.a import A\n",
            "pkg/low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low import d\n",
            "pkg/low/d.py": "import pkg.low.c\n",
        },
    )
    graph = checker.ImportGraph.read(root)
    assert graph.module_cycles() == [("pkg.low.a", "pkg.low.b")]
    assert graph.type_only_cycles() == [("pkg.low.c", "pkg.low.d")]


def test_a_child_importing_its_package_init_is_the_circle_and_a_re_export_alone_is_not(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "from pkg.low.a import A\nfrom pkg.low.b import B\n",
        "pkg/low/a.py": "A = 1\n",
        "pkg/low/b.py": "from pkg.low.a import A\nB = A\n",
    }
    assert checker.ImportGraph.read(_package(tmp_path / "one", files)).module_cycles() == []
    files["pkg/low/b.py"] = "from pkg.low import A\nB = A\n"  # the name through the package's __init__
    cycles = checker.ImportGraph.read(_package(tmp_path / "two", files)).module_cycles()
    assert cycles == [("pkg.low", "pkg.low.b")]


def test_an_import_from_a_lower_layer_to_a_higher_one_runs_up_and_names_the_modules(tmp_path):
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.high import H\n",
            "pkg/high/__init__.py": "from pkg.high.h import H\n",
            "pkg/high/h.py": "from pkg.low.l import L\nH = L\n",
            "pkg/low/__init__.py": "",
            "pkg/low/l.py": "L = 1\n\ndef f():\n    from ..high import h\n    return h\n",
        },
    )
    layers = (("low/",), ("high/",), ("__init__.py",))
    graph = checker.ImportGraph.read(root)
    assert graph.problems(layers) == {"up: low.l -> high.h", "cycle: high.h low.l"}
    assert graph.problems((("low/", "high/"), ("__init__.py",))) == {
        "cycle: high.h low.l",
        "layer cycle: high/ low/",
    }


MAX_LINES = 600  # a module past this has more than one job: split it along a seam


def test_no_module_of_the_package_is_over_600_lines():
    root = Path(__file__).resolve().parents[1] / "roundpipe"
    long = {
        p.relative_to(root).as_posix(): n
        for p in root.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job: {long}"
