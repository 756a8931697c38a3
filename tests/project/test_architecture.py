"""The project's structure, checked from the source: dependencies point one way.

Parses every module of the project with `ast` (nothing is imported or run) and checks the
rules of docs/architecture.md:
- the shared vocabulary is the basement: `cachegen_common` (flags, units, result header) imports
  no project package at all, and `codec` does not import it (the codec stays standalone);
- the codec knows no model, engine, network or measurement: `codec` imports none of
  kv_extraction_hf, streaming, harness, third_party, evaluation, bench, cachegen_common (anywhere in
  a module, lazy imports inside functions included);
- the streaming stage knows no model: `streaming` imports none of kv_extraction_hf,
  harness, bench, third_party;
- no stage package (kv_extraction_hf, codec, streaming, evaluation, third_party) imports
  the orchestration (harness) or the measurements (bench);
- the LMCache serde plugin (third_party.lmcache) imports only the codec of ours (none of
  kv_extraction_hf, streaming, harness, bench, evaluation, third_party.vllm);
- visualize_results.py and its figure package `visualize` read results.json: they import
  none of the stage packages that do work (kv_extraction_hf, codec, streaming, third_party),
  nor harness or bench (the pure summary functions of `evaluation` are allowed);
- no import cycle inside a package, counting imports inside functions (a lazy import
  defers a cycle, it does not remove it: the two modules still need each other); only
  imports under `if TYPE_CHECKING:` (never executed) are left out. Third-party imports
  (numba, triton, torch, ... often lazy because optional or heavy) are not nodes of
  the graph, so they need no allow-list here. Known cycles outside codec/ that are not
  cut yet are listed in KNOWN_CYCLES with the reason; the test fails when one is cut
  (update the list) or a new one appears.

Run: .venv/bin/python -m pytest tests/project/test_architecture.py -q
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("kv_extraction_hf", "codec", "streaming", "evaluation", "third_party")
PACKAGES = ("cachegen_common",) + STAGES + ("harness", "bench", "visualize")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _project_modules() -> dict[str, Path]:
    """Every module of the project's packages and its top-level scripts: name -> path."""
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            mods[_module_name(p)] = p
    for p in sorted(ROOT.glob("*.py")):
        mods[p.stem] = p
    return mods


MODULES = _project_modules()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, module_level_only: bool, name: str | None = None,
             type_checking: bool = True) -> list[tuple[str, int]]:
    """(imported module, line) of every import in the file. A relative import is resolved
    against the file's package; `from P import x` gives P.x when that is a project module,
    else P. With module_level_only, imports inside functions or TYPE_CHECKING blocks are
    skipped (class bodies and module-level try/if blocks run at import and are kept);
    with type_checking=False, TYPE_CHECKING blocks are skipped (at any depth)."""
    name = name or _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                        ast.Lambda)):
                continue
            if (module_level_only or not type_checking) and isinstance(child, ast.If) \
                    and _is_type_checking(child):
                for sub in child.orelse:
                    visit_stmt(sub)
                continue
            visit_stmt(child)

    def visit_stmt(child: ast.AST) -> None:
        if isinstance(child, ast.Import):
            out.extend((a.name, child.lineno) for a in child.names)
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (child.level - 1)] if child.level > 1 else base
                mod = ".".join(base + ([child.module] if child.module else []))
            else:
                mod = child.module or ""
            for a in child.names:
                sub = f"{mod}.{a.name}" if mod else a.name
                out.append((sub if sub in MODULES else mod, child.lineno))
        visit(child)

    visit(tree)
    return out


def _top(mod: str) -> str:
    return mod.split(".")[0]


def _violations(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for name, path in MODULES.items():
        if name != prefix and not name.startswith(prefix + "."):
            continue
        for mod, line in _imports(path, module_level_only=False):
            if _top(mod) in forbidden or (prefix == "third_party.lmcache"
                                          and mod.startswith("third_party.vllm")):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return bad


def test_modules_found():
    # the scan must see the project, or every rule below passes vacuously
    for must in ("cachegen_common.flags", "cachegen_common.units", "cachegen_common.header", "codec.api", "streaming.store",
                 "kv_extraction_hf.model", "harness.results",
                 "bench.codec", "third_party.vllm.cachegen_connector",
                 "third_party.lmcache.serde", "visualize_results"):
        assert must in MODULES, must


def test_import_scanner_resolves_relative_and_lazy_imports(tmp_path):
    """The scanner itself: relative imports resolve to project modules; lazy imports count
    for the rules but not for cycles; TYPE_CHECKING imports are skipped for cycles."""
    got = {m for m, _ in _imports(ROOT / "codec" / "api.py", module_level_only=True)}
    assert {"codec.bitstream", "codec.errors"} <= got
    # codec/__init__ is lazy (PEP 562): codec.api is imported inside __getattr__
    init = ROOT / "codec" / "__init__.py"
    assert "codec.api" not in {m for m, _ in _imports(init, module_level_only=True)}
    assert "codec.api" in {m for m, _ in _imports(init, module_level_only=False)}
    src = tmp_path / "x.py"
    src.write_text("from . import api\nfrom .errors import CodecError\n"
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import streaming\n"
                   "def f():\n    import kv_extraction_hf.model\n")
    lazy = {m for m, _ in _imports(src, module_level_only=False, name="codec.x")}
    top = {m for m, _ in _imports(src, module_level_only=True, name="codec.x")}
    assert {"codec.api", "codec.errors", "streaming", "kv_extraction_hf.model"} <= lazy
    assert top == {"codec.api", "codec.errors", "typing"}


@pytest.mark.parametrize("package, forbidden", [
    ("cachegen_common", ("kv_extraction_hf", "codec", "streaming", "harness", "third_party", "evaluation",
                "bench")),
    ("codec", ("kv_extraction_hf", "streaming", "harness", "third_party", "evaluation", "bench",
               "cachegen_common")),
    ("streaming", ("kv_extraction_hf", "harness", "bench", "third_party")),
    ("kv_extraction_hf", ("harness", "bench")),
    ("evaluation", ("harness", "bench")),
    ("third_party", ("harness", "bench")),
    # the LMCache serde plugin is our codec inside LMCache: codec only
    ("third_party.lmcache", ("kv_extraction_hf", "streaming", "harness", "bench",
                             "evaluation")),
    ("visualize_results", ("kv_extraction_hf", "codec", "streaming", "third_party", "harness",
                           "bench")),
    # the figure code visualize_results.py re-exports: the same rule
    ("visualize", ("kv_extraction_hf", "codec", "streaming", "third_party", "harness", "bench")),
])
def test_dependencies_point_one_way(package, forbidden):
    bad = _violations(package, forbidden)
    assert not bad, "\n".join(bad)


def _graph(package: str, module_level_only: bool = False) -> dict[str, list[str]]:
    """Import edges among the package's modules: every import, inside functions too
    (module_level_only=False, the default), TYPE_CHECKING blocks left out."""
    nodes = [n for n in MODULES if n == package or n.startswith(package + ".")]
    return {n: sorted({m for m, _ in _imports(MODULES[n], module_level_only=module_level_only,
                                              type_checking=False)
                       if m in nodes and m != n}) for n in nodes}


# Cycles not cut yet, each with its cause. Cutting one: delete its entry.
KNOWN_CYCLES: dict[str, list[list[str]]] = {}


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Cycles found by a depth-first search (each as a path ending where it started)."""
    cycles, state, stack = [], {}, []

    def dfs(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in graph[n]:
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                dfs(m)
        stack.pop()
        state[n] = 2

    for n in graph:
        if n not in state:
            dfs(n)
    return cycles


def test_cycle_search_finds_cycles():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    g = _graph("codec")   # the real graph has edges (the scan resolves relative imports)
    assert "codec.api" in g["codec"] and g["codec.api"]


def test_cycle_search_counts_imports_inside_functions(tmp_path):
    """A lazy import is an edge for the cycle rule; a TYPE_CHECKING one is not."""
    src = tmp_path / "x.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import api\n"
                   "def f():\n    from .errors import CodecError\n"
                   "    if TYPE_CHECKING:\n        from . import bitstream\n")
    got = {m for m, _ in _imports(src, module_level_only=False, name="codec.x",
                                  type_checking=False)}
    assert "codec.errors" in got and "codec.api" not in got and "codec.bitstream" not in got
    # the rule would have caught the codec's old lazy circle (quantize -> fused -> codecs)
    assert _cycles({"codec.quant.reference": ["codec.quant.fused"], "codec.quant.fused": ["codec.codecs"],
                    "codec.codecs": ["codec.quant.reference"]})


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_inside_a_package(package):
    cycles = _cycles(_graph(package))
    assert cycles == KNOWN_CYCLES.get(package, []), \
        "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_level_import_cycle_at_all():
    """Stricter for imports that run at import time: none, known cycles included."""
    for package in PACKAGES:
        cycles = _cycles(_graph(package, module_level_only=True))
        assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
