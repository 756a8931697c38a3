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
    'codec/codecs.py': [
        'codec.registry._build_registry'
    ],
    'codec/config.py': [
        'codec.schedules._scaled', 'codec.schedules._specs'
    ],
    'codec/dequant_cpu.py': [
        'codec.dequant_kernels._copy_finite_par', 'codec.dequant_kernels._copy_finite_ser',
        'codec.dequant_kernels._dequant_direct_par', 'codec.dequant_kernels._dequant_direct_ser',
        'codec.dequant_kernels._gather_par', 'codec.dequant_kernels._gather_ser',
        'codec.dequant_kernels._kivi_par', 'codec.dequant_kernels._kivi_ser',
        'codec.dequant_kernels._lut8_par', 'codec.dequant_kernels._lut8_ser',
        'codec.dequant_kernels._nonfinite_par', 'codec.dequant_kernels._nonfinite_ser'
    ],
    'codec/dequant_kernels.py': [
        'codec.rans_kernels._dual'
    ],
    'codec/fused.py': [
        'codec.rans_cpu._num_workers', 'codec.rans_kernels._dual'
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
    'codec/prob_codebook.py': [
        'codec.prob_tables._range_bits', 'codec.prob_tables._ranged_deltas',
        'codec.prob_tables._ranged_read', 'codec.prob_tables._ranged_write', 'codec.prob_tables._rice_read',
        'codec.prob_tables._rice_read_plain', 'codec.prob_tables._rice_write_plain'
    ],
    'codec/probability.py': [
        'codec.prob_codebook._assemble', 'codec.prob_codebook._cum_from_freqs',
        'codec.prob_codebook._deserialize_models_v2', 'codec.prob_codebook._layer_nbins',
        'codec.prob_codebook._ms_nb_layer', 'codec.prob_tables._bits_read',
        'codec.prob_tables._fixed_write', 'codec.prob_tables._normalize_rows',
        'codec.prob_tables._normalize_rows_py', 'codec.prob_tables._range_bits',
        'codec.prob_tables._ranged_deltas', 'codec.prob_tables._ranged_read',
        'codec.prob_tables._ranged_write', 'codec.prob_tables._rice_one', 'codec.prob_tables._rice_read',
        'codec.prob_tables._rice_read_plain', 'codec.prob_tables._rice_write',
        'codec.prob_tables._rice_write_plain', 'codec.prob_tables._zigzag_deltas'
    ],
    'codec/rans_cpu.py': [
        'codec.rans_kernels._compact_par', 'codec.rans_kernels._compact_ser',
        'codec.rans_kernels._decode_par', 'codec.rans_kernels._decode_ser', 'codec.rans_kernels._dual',
        'codec.rans_kernels._encode_par', 'codec.rans_kernels._encode_ser', 'codec.rans_kernels._lut_par',
        'codec.rans_kernels._lut_ser', 'codec.rans_ref._iter_stream_positions'
    ],
    'codec/triton_kernels.py': [
        'codec.triton_jit._constexpr', 'codec.triton_jit._dequantize_kernel',
        'codec.triton_jit._histogram_kernel', 'codec.triton_jit._jit', 'codec.triton_jit._kernel',
        'codec.triton_jit._launch_opts', 'codec.triton_jit._on', 'codec.triton_jit._quantize_kernel',
        'codec.triton_jit._rans_decode_kernel', 'codec.triton_jit._rans_encode_kernel',
        'codec.triton_jit._require'
    ],
    'codec/window.py': [
        'codec.api._check_kv', 'codec.api._check_level', 'codec.api._device', 'codec.api._encode_one',
        'codec.api._resolve_backend', 'codec.api._unpack_kind', 'codec.window_rules._window_list'
    ],
    'scripts/kvtc_tune.py': [
        'codec.api._encode_one'
    ],
    'third_party/vllm/source_local.py': [
        'streaming.store.kv._calibration_bytes', 'third_party.vllm.source_base._identity_miss',
        'third_party.vllm.source_base._matched_tokens'
    ],
    'third_party/vllm/source_store.py': [
        'third_party.vllm.source_base._identity_miss', 'third_party.vllm.source_base._matched_tokens'
    ],
    'third_party/vllm/sources.py': [
        'third_party.vllm.source_base._identity_miss', 'third_party.vllm.source_base._matched_tokens',
        'third_party.vllm.source_base._prefix_match', 'third_party.vllm.source_base._save_config'
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
    'codec/codecs.py': [
        'CODECS', 'CacheGenCodec', 'Codec', 'CodecConfig', 'CodecError', 'DTYPES', 'DTYPE_BYTES',
        'DTYPE_NAMES', 'EncodedChunk', 'Fp8Codec', 'KIVI_GROUP', 'KIVI_RESIDUAL', 'KiviCodec', 'RawCodec',
        '_build_registry', 'from_bits', 'get_codec', 'need_array', 'need_int', 'pack_bits', 'resolve_level',
        'to_bits', 'unpack_bits'
    ],
    'codec/config.py': [
        'HARNESS_LEVELS', 'LEVELS', '_scaled', '_specs'
    ],
    'codec/probability.py': [
        'PROB_SCALE', 'RICE_MAX_K', 'TABLE_Q', 'TABLE_QMAX', '_bits_read', '_cum_from_freqs',
        '_deserialize_models_v2', '_fixed_write', '_ms_nb_layer', '_normalize_rows_py', '_range_bits',
        '_ranged_deltas', '_ranged_read', '_ranged_write', '_rice_one', '_rice_read', '_rice_read_plain',
        '_rice_write', '_rice_write_plain', '_zigzag_deltas', 'deserialize_models', 'rice_cost',
        'serialize_models'
    ],
    'codec/quantize.py': [
        'CHANNEL_GAP', 'CHANNEL_MAX', 'CHANNEL_MAX_EXP', 'CHANNEL_MEDIAN_GAP', 'FP8_MAX', 'OUTLIER_RATIO',
        'OUTLIER_SAMPLE', 'fp8_dequantize', 'fp8_quantize', 'kivi_dequantize', 'kivi_quantize',
        'outlier_channels', 'outlier_thresholds'
    ],
    'codec/rans_cpu.py': [
        'ERR_FINAL', 'ERR_LEFTOVER', 'ERR_OK', 'ERR_SHORT', 'ERR_STATE', 'ERR_SYMBOL', 'ERR_TRUNCATED',
        'HAVE_NUMBA', 'LUT_SHIFT', 'PARALLEL_MIN_SYMBOLS', 'PROB_BITS', 'RANS_L', '_MASK16', '_dual',
        '_iter_stream_positions', 'count_nonfinite', 'decode_streams_ref', 'dequant_direct_into',
        'encode_streams_ref', 'gather_into', 'kivi_into', 'lut8_into', 'rans_decode_ref', 'rans_encode_ref'
    ],
    'codec/triton_kernels.py': [
        'ERR_FINAL', 'ERR_INTERNAL', 'ERR_LEFTOVER', 'ERR_OK', 'ERR_STATE', 'ERR_SYMBOL', 'ERR_TRUNCATED',
        'HAVE_TRITON', 'K_ERR_FINAL', 'K_ERR_INTERNAL', 'K_ERR_LEFTOVER', 'K_ERR_OK', 'K_ERR_STATE',
        'K_ERR_SYMBOL', 'K_ERR_TRUNCATED', 'K_PROB_SCALE', 'K_RANS_L', 'PROB_BITS', 'RANS_L',
        'RANS_WARPS_GPU', '_constexpr', '_dequantize_kernel', '_histogram_kernel', '_jit',
        '_quantize_kernel', '_rans_decode_kernel', '_rans_encode_kernel', 'available', 'compile_for_target',
        'resolve_backend', 'tl'
    ],
    'codec/window.py': [
        'layout_tag', 'min_load_tokens', 'parse_layout_tag', 'stored_fraction'
    ],
    'third_party/lmcache/serde.py': [
        'BITS_PER_ELEMENT', 'CONTAINER_SLACK', 'DEFAULT_SLOT_RATIO', 'DTYPES', 'FRAME_MAGIC',
        'FRAME_VERSION', 'MAX_CONTAINERS', 'MAX_IDENT', 'estimate_bytes', 'frame_overhead', 'kv_views',
        'parse_frame', 'serializer_stats'
    ],
    'third_party/vllm/sources.py': [
        'CAL_DIR', 'ChunkSink', 'DecodeFn', 'LOCAL_FORMAT', 'LoadStats', 'Lookup', 'MANIFEST',
        'SourceError', 'SourceMiss', '_identity_miss', '_matched_tokens', '_prefix_match', '_save_config',
        'calibration_of', 'default_decode_fn', 'default_stored_level', 'encode_for_save', 'engine_identity',
        'expected_identity', 'local_save_steps', 'logger', 'prefix_namespace', 'request_partition',
        'save_local_context'
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
