"""No test module imports another test module (or conftest): pieces several tests share live
in ``tests/helpers/`` (imported as ``tests.helpers.<module>``). Checked from the source with
`ast` (nothing is imported or run), at any depth (lazy imports inside functions count).

Modules that still import a test module are listed in ALLOW_TEST_IMPORTS, file by file: the
known debt, to shrink. An unlisted import fails the test; an entry that no longer matches
fails `test_allowlist_is_not_stale`. `python tests/project/test_test_imports.py` prints the
current findings in the table's form.

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


# The known debt (to shrink; never to grow): move the shared piece into tests/helpers.
ALLOW_TEST_IMPORTS: dict[str, list[str]] = {
    'codec/test_codec_bitstream_versions.py': ['tests.codec.test_codec_digests'],
    'codec/test_codec_outlier_channels.py': ['tests.codec.test_codec_outliers'],
    'codec/test_codec_tables.py': ['tests.codec.test_codec_entropy'],
    'codec/test_kvtc_decode_fast.py': ['test_codec_kvtc'],
    'codec/test_kvtc_decode_into.py': ['test_codec_kvtc'],
    'codec/test_kvtc_grouped.py': ['test_codec_kvtc'],
    'codec/test_kvtc_tiers.py': ['test_codec_kvtc', 'test_codec_kvtc_layout'],
    'harness/test_harness_lifecycle.py': ['tests.conftest'],
    'harness/test_run_benchmarks.py': ['tests.conftest'],
    'streaming/test_store_lost_reply.py': ['tests.streaming.test_store_faults'],
    'streaming/test_store_publish.py': ['tests.streaming.test_store_faults'],
    'vllm_connector/test_connector_async_load.py': ['tests.conftest'],
    'vllm_connector/test_connector_prefix.py': ['tests.conftest'],
    'vllm_connector/test_connector_records.py': ['tests.conftest'],
    'vllm_connector/test_connector_tenants.py': ['tests.conftest'],
    'vllm_connector/test_connector_trust.py': ['tests.conftest'],
    'vllm_connector/test_context_keys.py': ['tests.conftest'],
    'vllm_connector/test_vllm_connector.py': ['tests.conftest'],
}


def test_no_test_module_imports_another():
    bad = {f: sorted(set(m) - set(ALLOW_TEST_IMPORTS.get(f, []))) for f, m in findings().items()}
    bad = {f: m for f, m in bad.items() if m}
    assert not bad, f"import the shared piece from tests/helpers instead: {bad}"


def test_allowlist_is_not_stale():
    found = findings()
    stale = {f: sorted(set(m) - set(found.get(f, []))) for f, m in ALLOW_TEST_IMPORTS.items()}
    stale = {f: m for f, m in stale.items() if m}
    assert not stale, f"fixed: strike these entries off ALLOW_TEST_IMPORTS: {stale}"


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
