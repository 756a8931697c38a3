"""The house rules of DEVELOPERS.md that reward shape, checked from the source with `ast`.

Every module of the project's packages and top-level scripts is parsed (nothing is imported
or run) and checked for:
- no private name imported across modules: `from M import _x` where M is another module of
  the project (tests are exempt: a test may reach into the unit it tests). A name another
  module needs is public; code that only one module needs lives in that module;
- no re-export face outside a package's `__init__`: a module-level `from M import name` of a
  project module whose name is never used in the importing module exists only to forward
  the name; importers should import it from its owner (a package's `__init__` is its face
  and may forward names);
- no function over 150 lines and no class over 400 (counted from the `def`/`class` line to
  the last line of the body): a long unit is cut into named steps.

Every package complies: any violation fails its test, which names the file and the name.
`python tests/project/test_house_rules.py` prints the current violations of each rule (and
the totals), e.g. while moving code.

Run: .venv/bin/python -m pytest tests/project/test_house_rules.py -q
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cachegen_common", "kv_extraction_hf", "codec", "streaming", "evaluation",
            "third_party", "harness", "bench", "visualize", "scripts")
MAX_FUNCTION_LINES = 150
MAX_CLASS_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project's packages and its top-level scripts: name -> path."""
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            mods[_module_name(p)] = p
    for p in sorted(root.glob("*.py")):
        mods[p.stem] = p
    return mods


MODULES = project_modules()


def _is_project(mod: str, path: Path | None = None) -> bool:
    """Whether `mod` is ours: a project module, or a script's sibling imported by its bare
    name (scripts/ put their own folder on sys.path)."""
    if mod in MODULES or mod.split(".")[0] in PACKAGES:
        return True
    return path is not None and bool(mod) and (path.parent / f"{mod.split('.')[0]}.py").is_file()


def _resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".") if package else []
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path, name: str) -> list[str]:
    """`module.name` of every private name the file imports from another project module
    (at any depth: lazy imports inside functions count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            mod = _resolve(node, package)
            if _is_project(mod, path) and mod != name and mod != name.rpartition(".")[2]:
                out += [f"{mod}.{a.name}" for a in node.names if _is_private(a.name)]
    return sorted(set(out))


def forwarded_names(path: Path, name: str) -> list[str]:
    """Names a module imports at module level from a project module and never uses: it only
    forwards them (a re-export face). A package's `__init__` is allowed to and gives []."""
    if path.name == "__init__.py":
        return []
    tree = ast.parse(path.read_text(), filename=str(path))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    out = []
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and \
                _is_project(_resolve(stmt, name.rpartition(".")[0]), path):
            out += [a.asname or a.name for a in stmt.names if (a.asname or a.name) not in used]
    return sorted(set(out))


def long_units(path: Path) -> list[str]:
    """`name:lines` of every function over MAX_FUNCTION_LINES and class over MAX_CLASS_LINES."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > MAX_FUNCTION_LINES:
            out.append(node.name)
        elif isinstance(node, ast.ClassDef) and n > MAX_CLASS_LINES:
            out.append(node.name)
    return sorted(set(out))


def violations(rule) -> dict[str, list[str]]:
    """rel path -> the rule's findings, for every module with at least one."""
    found = {}
    for name, path in MODULES.items():
        got = rule(path) if rule is long_units else rule(path, name)
        if got:
            found[path.relative_to(ROOT).as_posix()] = got
    return found


def _listed(found: dict[str, list[str]]) -> list[str]:
    return [f"{f}: {x}" for f, xs in sorted(found.items()) for x in xs]


def test_scanner_sees_the_project():
    assert {"codec.api", "streaming.load", "harness.run", "bench.codec",
            "visualize_results"} <= set(MODULES)


def test_scanner_finds_each_kind(tmp_path, monkeypatch):
    pkg = tmp_path / "bench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from bench.a import _x, y\n")
    (pkg / "a.py").write_text("_x = 1\ny = 2\n")
    body = "\n".join(["    z = 1"] * MAX_FUNCTION_LINES)
    (pkg / "b.py").write_text(
        "from bench.a import y, _x\nfrom .a import _x as w\nimport os\n"
        f"def f():\n    from bench import a\n    from bench.a import _x\n{body}\n"
        "def g():\n    return w\n")
    init, b = pkg / "__init__.py", pkg / "b.py"
    assert private_imports(b, "bench.b") == ["bench.a._x"]
    assert private_imports(init, "bench") == ["bench.a._x"]        # __init__ too
    assert forwarded_names(b, "bench.b") == ["_x", "y"]           # w is used by g
    assert forwarded_names(init, "bench") == []                   # a package's face
    assert long_units(b) == ["f"] and long_units(pkg / "a.py") == []
    c = pkg / "c.py"
    c.write_text("class K:\n" + "\n".join(["    z = 1"] * MAX_CLASS_LINES) + "\n")
    assert long_units(c) == ["K"]


def test_no_private_import_across_modules():
    bad = _listed(violations(private_imports))
    assert not bad, "private names imported from another module (make them public or " \
        "move the code to its owner):\n" + "\n".join(bad)


def test_no_reexport_face():
    bad = _listed(violations(forwarded_names))
    assert not bad, "names imported only to forward them (import them from their owner):\n" \
        + "\n".join(bad)


def test_no_long_unit():
    bad = _listed(violations(long_units))
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines or classes over " \
        f"{MAX_CLASS_LINES} (cut them into named steps):\n" + "\n".join(bad)


def _print_violations() -> int:
    total = 0
    for title, rule in (("private imports", private_imports), ("forwarded names", forwarded_names),
                        ("long units", long_units)):
        found = violations(rule)
        total += sum(map(len, found.values()))
        print(f"{title}: {sum(map(len, found.values()))} in {len(found)} files")
        for line in _listed(found):
            print(f"    {line}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(_print_violations())
