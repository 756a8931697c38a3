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

Packages that still break a rule are listed in the ALLOW_* tables below, file by file: the
known debt, to shrink. A violation that is not listed fails the test; an entry that no
longer matches anything fails `test_allowlists_are_not_stale`, so a fixed debt is struck off.
`python tests/project/test_house_rules.py` prints the current violations in the tables'
form (and the totals), to regenerate them after a move.

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


# The known debt, file by file (to shrink; never to grow). These packages were outside the
# pass that made kv_extraction_hf, harness, bench, evaluation and visualize comply.
# Private names imported from another module of the project:
ALLOW_PRIVATE: dict[str, list[str]] = {
    'bench/codec.py': [
        'bench.codec_metrics._median_cpu', 'bench.codec_metrics._median_time',
        'bench.codec_metrics._threads'
    ],
    'bench/codec_peer_row.py': [
        'bench.codec_metrics._median_time'
    ],
    'bench/codec_rows.py': [
        'bench.codec_metrics._median_time'
    ],
    'codec/kvtc/__init__.py': [
        'codec.kvtc.calibration._HASH_RE', 'codec.kvtc.calibration._check_calibration',
        'codec.kvtc.fit_grouped._fit_grouped', 'codec.kvtc.kept._KeptSymbols',
        'codec.kvtc.kept._decode_kept', 'codec.kvtc.kept._kept_halves', 'codec.kvtc.kept._kept_nbins',
        'codec.kvtc.kept._n_kept', 'codec.kvtc.layout._PADDED', 'codec.kvtc.layout._SPAN_ARRAY_RE',
        'codec.kvtc.layout._code_rows', 'codec.kvtc.layout._decode_rows', 'codec.kvtc.layout._exact_counts',
        'codec.kvtc.layout._parse_spans', 'codec.kvtc.layout._span_array', 'codec.kvtc.layout._tail_spans',
        'codec.kvtc.layout_grouped._code_rows_grouped', 'codec.kvtc.layout_grouped._decode_rows_grouped',
        'codec.kvtc.layout_grouped._group_features', 'codec.kvtc.pca._metric_gain',
        'codec.kvtc.pca._metric_sqrt', 'codec.kvtc.pca._pca', 'codec.kvtc.rate._RATE_SAMPLE_TOKENS',
        'codec.kvtc.rate._quantize', 'codec.kvtc.rate._rate_bits', 'codec.kvtc.rate._shrink',
        'codec.kvtc.rate._solve_levels', 'codec.kvtc.rate._steps_for', 'codec.kvtc.registry._CALIBRATIONS',
        'codec.kvtc.registry._LOCK', 'codec.kvtc.registry._resolve_calibration',
        'codec.kvtc.rope._ROPE_BF16_KERNEL', 'codec.kvtc.rope._ROPE_KERNEL',
        'codec.kvtc.rope._jit_or_false', 'codec.kvtc.rope._rope_bf16_kernel',
        'codec.kvtc.rope._rope_bf16_py', 'codec.kvtc.rope._rope_cos_sin', 'codec.kvtc.rope._rope_kernel',
        'codec.kvtc.rope._rope_rows_py', 'codec.kvtc.rope._rope_tables', 'codec.kvtc.rope._rotate_half',
        'codec.kvtc.workers._BF16_GEMM', 'codec.kvtc.workers._MAX_DECODE_WORKERS',
        'codec.kvtc.workers._POOL', 'codec.kvtc.workers._POOL_LOCK', 'codec.kvtc.workers._bf16_gemm',
        'codec.kvtc.workers._decode_pool', 'codec.kvtc.workers._decode_workers', 'codec.kvtc.workers._rows',
        'codec.kvtc.workers._split_over_workers'
    ],
    'codec/kvtc/codec.py': [
        'codec.kvtc.layout._KeptSymbols', 'codec.kvtc.layout._SPAN_ARRAY_RE',
        'codec.kvtc.layout._code_rows', 'codec.kvtc.layout._decode_rows', 'codec.kvtc.layout._exact_counts',
        'codec.kvtc.layout._parse_spans', 'codec.kvtc.layout._span_array', 'codec.kvtc.layout._tail_spans',
        'codec.kvtc.registry._resolve_calibration', 'codec.kvtc.rope._rope_bf16_kernel',
        'codec.kvtc.rope._rope_kernel', 'codec.kvtc.rope._rope_tables', 'codec.kvtc.workers._bf16_gemm',
        'codec.kvtc.workers._rows', 'codec.kvtc.workers._split_over_workers'
    ],
    'codec/kvtc/fit.py': [
        'codec.kvtc.calibration._check_calibration', 'codec.kvtc.fit_grouped._fit_grouped',
        'codec.kvtc.pca._metric_gain', 'codec.kvtc.pca._metric_sqrt', 'codec.kvtc.pca._pca',
        'codec.kvtc.rate._RATE_SAMPLE_TOKENS', 'codec.kvtc.rate._shrink', 'codec.kvtc.rate._solve_levels'
    ],
    'codec/kvtc/fit_grouped.py': [
        'codec.kvtc.calibration._check_calibration', 'codec.kvtc.pca._metric_sqrt',
        'codec.kvtc.rate._RATE_SAMPLE_TOKENS', 'codec.kvtc.rate._solve_levels'
    ],
    'codec/kvtc/layout.py': [
        'codec.kvtc.kept._KeptSymbols', 'codec.kvtc.kept._decode_kept', 'codec.kvtc.kept._kept_halves',
        'codec.kvtc.kept._n_kept', 'codec.kvtc.layout_grouped._code_rows_grouped',
        'codec.kvtc.layout_grouped._decode_rows_grouped'
    ],
    'codec/kvtc/layout_grouped.py': [
        'codec.kvtc.kept._KeptSymbols', 'codec.kvtc.kept._decode_kept', 'codec.kvtc.kept._kept_halves',
        'codec.kvtc.kept._n_kept'
    ],
    'codec/kvtc/registry.py': [
        'codec.kvtc.calibration._HASH_RE'
    ],
    'codec/kvtc/transfer.py': [
        'codec.kvtc.calibration._HASH_RE'
    ],
    'streaming/adapt.py': [
        'streaming.adapt_oracle._pareto'
    ],
    'streaming/backends.py': [
        'streaming.folder_backend._OBJ_HEAD', 'streaming.folder_backend._OBJ_MAGIC',
        'streaming.folder_backend._check_key'
    ],
    'streaming/identity_check.py': [
        'streaming.identity_entry._INT_FIELDS', 'streaming.identity_entry._STR_FIELDS'
    ],
    'streaming/link.py': [
        'streaming.link_cleanup._LIVE', 'streaming.link_cleanup._install_handlers',
        'streaming.link_cleanup._kill_ns_pids', 'streaming.link_proxy._ShapingProxy',
        'streaming.link_shaper._LOCK_PATH', 'streaming.link_shaper._METHOD_ALIASES',
        'streaming.link_shaper._NS_RE', 'streaming.link_shaper._VETH_RE',
        'streaming.link_shaper._check_rate', 'streaming.link_shaper._pick_subnet',
        'streaming.link_shaper._pid_alive', 'streaming.link_shaper._run',
        'streaming.link_shaper._used_networks'
    ],
    'streaming/link_cleanup.py': [
        'streaming.link_shaper._NS_RE', 'streaming.link_shaper._VETH_RE',
        'streaming.link_shaper._pid_alive', 'streaming.link_shaper._run'
    ],
    'streaming/protocol.py': [
        'streaming.protocol_frame._VALID_TYPES'
    ],
    'streaming/redis_backend.py': [
        'streaming.redis_conn._CONNECTION_CLASSES'
    ],
    'streaming/redis_client.py': [
        'streaming.store_format._chunk_key', 'streaming.store_format._manifest_key'
    ],
    'streaming/redis_server.py': [
        'streaming.redis_setup._DIR_PREFIX', 'streaming.redis_setup._pdeathsig_preexec'
    ],
    'streaming/store_client.py': [
        'streaming.store_format._ANY'
    ],
    'streaming/store_kv.py': [
        'streaming.store_format._ANY', 'streaming.store_format._cal_key',
        'streaming.store_format._check_gen', 'streaming.store_format._check_hex_key',
        'streaming.store_format._chunk_digest', 'streaming.store_format._chunk_key',
        'streaming.store_format._manifest_key', 'streaming.store_format._parse_gen'
    ],
    'streaming/store_server.py': [
        'streaming.store_format._ANY'
    ],
    'streaming/store_steps.py': [
        'streaming.store_format._check_gen', 'streaming.store_format._parse_gen'
    ],
}

# Names imported only to be forwarded (a module acting as a package face):
ALLOW_FORWARDED: dict[str, list[str]] = {
    'bench/codec.py': [
        '_median_cpu', '_median_time', '_threads', 'decode_breakdown', 'quality', 'rel_l2_per_layer',
        'run_peer_row', 'synthetic_kv'
    ],
    'cachegen_common/flags.py': [
        'ConfigFileError', 'load_config', 'parse_with_config', 'parser_dests'
    ],
    'cachegen_common/header.py': [
        'atomic_write', 'atomic_write_json', 'atomic_write_text', 'json_default'
    ],
    'codec/window.py': [
        'layout_tag', 'min_load_tokens', 'parse_layout_tag', 'stored_fraction'
    ],
    'streaming/adapt.py': [
        'AdaptivePolicy', 'BURST_SAMPLE_FACTOR', 'ClockModel', 'DEFAULT_PRESET', 'Decision', 'DecodeTable',
        'FixedPolicy', 'MIN_BYTES_FOR_ESTIMATE', 'OracleResult', 'POLICY_INPUTS', 'POLICY_PRESETS',
        'POLICY_REQUEST_KEYS', 'Policy', 'PolicyInputs', 'PolicyParams', 'SimResult', 'TEXT',
        'ThroughputEstimator', '_pareto', 'brute_force', 'choose_level', 'oracle', 'oracle_labels',
        'overrun_allowance_s', 'plan_mpc', 'preset', 'simulate', 'split_policy_args'
    ],
    'streaming/backends.py': [
        'MAX_KEY_BYTES', '_OBJ_HEAD', '_OBJ_MAGIC', '_check_key', 'classify_os_error'
    ],
    'streaming/identity.py': [
        'EntryIdentity', 'IDENTITY_FORMAT', 'TOKENIZER_FILES', 'check_entry', 'codec_config_hash',
        'codec_identity', 'codec_version', 'folder_tokenizer_hash', 'folder_weights_hash', 'merge_expected',
        'model_identity'
    ],
    'streaming/link.py': [
        'MAX_PACING_QUANTUM', 'MTU_BYTES', 'PACING_QUANTUM', '_NS_RE', '_VETH_RE', '_pid_alive',
        '_used_networks'
    ],
    'streaming/protocol.py': [
        'FrameTooLarge', 'FrameType', 'HEADER', 'MAGIC', '_VALID_TYPES', 'decode_frame', 'encode_frame'
    ],
    'streaming/redis_backend.py': [
        'RedisTimeoutError'
    ],
    'streaming/redis_server.py': [
        'redis_server_version'
    ],
    'streaming/store.py': [
        'FaultHook', 'LEGACY_MANIFEST_FORMATS', 'LocalStoreClient', 'MANIFEST_FORMAT', 'Manifest',
        'StoreBackend', 'StoreClient', 'StoreServerHandle', 'build_manifest', 'context_key', 'entry_key',
        'new_generation', 'run_steps', 'save_steps', 'start_store_server'
    ],
}

# Functions over 150 lines and classes over 400:
ALLOW_LONG: dict[str, list[str]] = {
    'codec/kvtc/codec.py': [
        'KvtcCodec'
    ],
    'codec/kvtc/fit.py': [
        'fit_calibration'
    ],
}


def _new(found: dict[str, list[str]], allowed: dict[str, list[str]]) -> list[str]:
    return [f"{f}: {x}" for f, xs in sorted(found.items()) for x in xs
            if x not in allowed.get(f, [])]


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


def test_no_new_private_import_across_modules():
    bad = _new(violations(private_imports), ALLOW_PRIVATE)
    assert not bad, "private names imported from another module (make them public or " \
        "move the code to its owner):\n" + "\n".join(bad)


def test_no_new_reexport_face():
    bad = _new(violations(forwarded_names), ALLOW_FORWARDED)
    assert not bad, "names imported only to forward them (import them from their owner):\n" \
        + "\n".join(bad)


def test_no_new_long_unit():
    bad = _new(violations(long_units), ALLOW_LONG)
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines or classes over " \
        f"{MAX_CLASS_LINES} (cut them into named steps):\n" + "\n".join(bad)


def test_allowlists_are_not_stale():
    stale = []
    for rule, allowed in ((private_imports, ALLOW_PRIVATE), (forwarded_names, ALLOW_FORWARDED),
                          (long_units, ALLOW_LONG)):
        found = violations(rule)
        stale += [f"{f}: {x}" for f, xs in allowed.items() for x in xs
                  if x not in found.get(f, [])]
    assert not stale, "fixed debt still listed (strike it off):\n" + "\n".join(stale)


def _print_tables() -> None:
    for title, rule in (("ALLOW_PRIVATE", private_imports), ("ALLOW_FORWARDED", forwarded_names),
                        ("ALLOW_LONG", long_units)):
        found = violations(rule)
        print(f"{title}  # {sum(map(len, found.values()))} in {len(found)} files")
        for f, xs in sorted(found.items()):
            print(f"    {f!r}: {xs!r},")


if __name__ == "__main__":
    sys.exit(_print_tables())
