"""No test module imports another test module (or conftest): pieces several tests share live
in ``tests/helpers/`` (imported as ``tests.helpers.<module>``). Checked from the source with
`ast` (nothing is imported or run), at any depth (lazy imports inside functions count).

Strict: there is no allowlist. Helpers, constants and fixtures-as-functions go to a module
under tests/helpers/ named for what it holds; pytest fixtures that several files use go to a
conftest.py (tests/conftest.py or the folder's), which pytest provides without an import.
`python tests/project/test_test_imports.py` prints any findings.

Run: .venv/bin/python -m pytest tests/project/test_test_imports.py -q
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _is_test_module(mod: str) -> bool:
    last = mod.rpartition(".")[2]
    return last.startswith("test_") or last == "conftest"


def test_imports(path: Path) -> list[str]:
    """The test modules (``test_*``, ``conftest``) that ``path`` imports, by name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if _is_test_module(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _is_test_module(node.module):
                out.add(node.module)
            else:   # from tests.codec import test_codec_digests
                out |= {f"{node.module}.{a.name}" for a in node.names if _is_test_module(a.name)}
    return sorted(out)


test_imports.__test__ = False   # a scanner, not a test


def findings() -> dict[str, list[str]]:
    """tests-relative path -> the test modules it imports, for every module with one."""
    found = {}
    for p in sorted(TESTS.rglob("*.py")):
        got = test_imports(p)
        if got:
            found[p.relative_to(TESTS).as_posix()] = got
    return found


def test_no_test_module_imports_another():
    bad = findings()
    assert not bad, f"import the shared piece from tests/helpers (or use a conftest fixture) instead: {bad}"


def test_scanner_sees_both_forms(tmp_path):
    p = tmp_path / "t.py"
    p.write_text("from tests.codec import test_codec_digests as d\n"
                 "def f():\n    from test_codec_kvtc import x\n"
                 "from tests.helpers.kv import make_kv\n")
    assert test_imports(p) == ["test_codec_kvtc", "tests.codec.test_codec_digests"]


if __name__ == "__main__":
    for f, m in findings().items():
        print(f"    {f!r}: {m!r},")
    print(f"{len(findings())} modules")
