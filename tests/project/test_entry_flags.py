"""Entry points alike (cachegen_common.flags, cachegen_common.units, cachegen_common.header; configs/).

- every command's ``--help`` parses and shows the shared spellings (``--bandwidth-mbps``,
  ``--link-method``, ``--out``, ``--data-path``, ``--repeats``, ``--context-tokens``, ...),
  and none of the old ones;
- an old spelling parses to the same namespace as the new one (hidden alias, same dest);
- each configs/ file of a command equals the code's defaults, and ``--config FILE`` loads
  YAML / TOML / JSON with a one-line error (exit 2) for a bad file or an unknown key;
- one Mbit/s <-> bytes/s conversion; the result header and atomic JSON write.

Nothing runs a command: ``argparse.ArgumentParser.parse_args`` is wrapped to stop right
after parsing.

Run: .venv/bin/python -m pytest tests/project/test_entry_flags.py -q
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from cachegen_common import config_file, files, flags  # noqa: E402
from cachegen_common import header  # noqa: E402
from cachegen_common.units import BYTES_PER_S_PER_MBPS, bytes_per_s_to_mbps, goodput_mbps, mbps_to_bytes_per_s  # noqa: E402

OLD = {  # an old spelling, as a pattern that does not match inside the new one
    "--rate-mbps": r"--rate-mbps", "--method": r"(?<![\w-])--method\b", "--json": r"--json\b",
    "--data": r"(?<![\w-])--data(?![\w-])", "--reps": r"--reps\b",
    "--context": r"(?<![\w-])--context(?![\w-])", "--tokens": r"(?<![\w-])--tokens(?![\w-])",
}

# (module, function, argv prefix, shared flags it must show, [(old argv, new argv)])
ENTRIES = [
    ("run_benchmarks", "main", [],
     {"--config", "--bandwidth-mbps", "--model", "--context-tokens", "--repeats", "--link-method",
      "--seed", "--out", "--data-path", "--quick", "--verbose"},
     [(["--rate-mbps", "5", "9", "--method", "userspace", "--json", "o.json", "--reps", "2",
        "--data", "d.jsonl"],
       ["--bandwidth-mbps", "5", "9", "--link-method", "userspace", "--out", "o.json",
        "--repeats", "2", "--data-path", "d.jsonl"])]),
    ("visualize_results", "main", [], {"--out"}, [(["--json", "figs"], ["--out", "figs"])]),
    ("streaming.link", "main", [], {"--bandwidth-mbps", "--link-method"},
     [(["--rate-mbps", "5", "--method", "userspace"],
       ["--bandwidth-mbps", "5", "--link-method", "userspace"])]),
    ("streaming.store.redis_server", "main", [], set(), []),
    ("streaming.store.redis_cluster_server", "main", [], set(), []),
    ("streaming.store", "main", ["serve"], set(), []),
    ("kv_extraction_hf.__main__", "main", [],
     {"--model", "--context-tokens", "--seed", "--out", "--data-path"},
     [(["--data", "d.jsonl"], ["--data-path", "d.jsonl"])]),
    ("kv_extraction_hf.calibrate", "main", [], {"--model", "--data-path", "--out"},
     [(["--data", "t.txt", "--json", "c.safetensors"], ["--data-path", "t.txt", "--out", "c.safetensors"])]),
    ("kv_extraction_hf.model", "main", [], set(), []),
    ("kv_extraction_hf.wikitext", "main", [], {"--data-path"}, [(["--data", "w"], ["--data-path", "w"])]),
    ("kv_extraction_hf.calibration_text", "main", [], set(), []),
    ("bench.warmup", "main", [], {"--repeats"}, [(["--reps", "3"], ["--repeats", "3"])]),
    ("bench.codec", "main", [], {"--quick", "--model", "--context-tokens", "--repeats", "--seed", "--out"},
     [(["--reps", "2", "--json", "o.json"], ["--repeats", "2", "--out", "o.json"])]),
    ("bench.context_sweep", "main", [],
     {"--model", "--context-tokens", "--bandwidth-mbps", "--repeats", "--link-method", "--seed", "--out"}, []),
    ("bench.linkcheck", "main", [], {"--bandwidth-mbps", "--link-method", "--repeats", "--out"},
     [(["--rate-mbps", "5", "7", "--method", "userspace", "--json", "o.json", "--reps", "1"],
       ["--bandwidth-mbps", "5", "7", "--link-method", "userspace", "--out", "o.json", "--repeats", "1"])]),
    ("bench.lmcache", "main", ["--kv", "x.safetensors"], {"--repeats", "--out"},
     [(["--reps", "2", "--json", "o.json"], ["--repeats", "2", "--out", "o.json"])]),
    ("bench.store_load", "main", [], {"--context-tokens", "--seed", "--quick", "--out"}, []),
    ("bench.serve_load", "main", [],
     {"--context-tokens", "--bandwidth-mbps", "--link-method", "--model", "--data-path", "--seed", "--quick",
      "--out"}, []),
    ("bench.redis", "main", [], {"--bandwidth-mbps", "--link-method", "--repeats"},
     [(["--rate-mbps", "5", "--method", "netns", "--reps", "1"],
       ["--bandwidth-mbps", "5", "--link-method", "netns", "--repeats", "1"])]),
    ("bench.redis_cluster", "main", [], {"--out"}, []),
    ("bench.operating_points", "main", [], {"--model", "--out"}, []),
    ("bench.coder", "rans_bench", [], {"--repeats"}, [(["--reps", "2"], ["--repeats", "2"])]),
    ("bench.coder", "entropy_bench", [], {"--repeats"}, [(["--reps", "2"], ["--repeats", "2"])]),
    ("bench.vllm_demo", "main", [], {"--model", "--context-tokens", "--bandwidth-mbps", "--repeats"},
     [(["--tokens", "500", "--rate-mbps", "10", "--reps", "1"],
       ["--context-tokens", "500", "--bandwidth-mbps", "10", "--repeats", "1"])]),
    ("bench.streaming", "main", ["pipeline"], {"--bandwidth-mbps", "--repeats", "--link-method", "--out"},
     [(["--rate-mbps", "5", "--method", "userspace", "--json", "o.json"],
       ["--bandwidth-mbps", "5", "--link-method", "userspace", "--out", "o.json"])]),
    ("bench.streaming", "main", ["adapt"], {"--link-method", "--out"},
     [(["--method", "userspace", "--json", "o.json"], ["--link-method", "userspace", "--out", "o.json"])]),
    ("bench.answer_suite", "main", [], {"--model", "--quick", "--seed", "--out", "--data-path"},
     [(["--data", "w", "--json", "o.json"], ["--data-path", "w", "--out", "o.json"])]),
    ("bench.taskcheck", "main", [], {"--context-tokens", "--seed", "--model", "--data-path", "--verbose"},
     [(["--data", "d.jsonl"], ["--data-path", "d.jsonl"])]),
    ("bench.triton", "main", [], {"--context-tokens", "--repeats", "--out"},
     [(["--tokens", "64", "--reps", "2", "--json", "o.json"],
       ["--context-tokens", "64", "--repeats", "2", "--out", "o.json"])]),
    ("bench.adapt", "main", [], {"--config", "--out", "--context-tokens", "--link-method", "--quick"},
     [(["--method", "userspace", "--json", "a.json"], ["--link-method", "userspace", "--out", "a.json"])]),
    ("bench.quality", "main", [], {"--quick", "--context-tokens", "--seed", "--data-path", "--model", "--out"},
     [(["--context", "256", "--data", "wt"], ["--context-tokens", "256", "--data-path", "wt"])]),
    ("adapt_tune", "main", [], {"--out"}, [(["--json", "t.json"], ["--out", "t.json"])]),
    ("readme_tables", "main", [], set(), []),
    ("kvtc_tune", "main", [], {"--context-tokens", "--out"},
     [(["--context", "512"], ["--context-tokens", "512"])]),
    ("gpu_check", "main", [], {"--quick", "--repeats", "--out"},
     [(["--reps", "2", "--json", "g.json"], ["--repeats", "2", "--out", "g.json"])]),
]
IDS = [f"{m}:{f}:{' '.join(p)}".rstrip(": ") for m, f, p, *_ in ENTRIES]


class _Parsed(Exception):
    def __init__(self, ns: argparse.Namespace):
        self.ns = ns


@pytest.fixture
def stop_after_parse(monkeypatch):
    """parse_args parses, then stops the command (raises _Parsed with the namespace)."""
    orig = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(orig(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)


def _parse(module: str, func: str, argv: list[str]) -> dict:
    fn = getattr(importlib.import_module(module), func)
    with pytest.raises(_Parsed) as got:
        fn(argv)
    return vars(got.value.ns)


@pytest.mark.parametrize("module, func, prefix, shared, aliases", ENTRIES, ids=IDS)
def test_help_shows_the_shared_spellings(module, func, prefix, shared, aliases, capsys):
    fn = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as ex:
        fn([*prefix, "--help"])
    assert ex.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:")
    for flag in shared:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{flag} not in {module} --help"
    # the old spellings of the shared ideas are gone (--context / --tokens only where they
    # meant the context size: bench.coder's --tokens is a chunk's, wikitext's a switch)
    olds = {"--rate-mbps", "--method", "--json", "--data", "--reps"}
    olds |= {a for old, _ in aliases for a in old if a in OLD}
    for old in olds:
        assert not re.search(OLD[old], text), f"{module} --help still shows {old}"


@pytest.mark.parametrize("module, func, prefix, shared, aliases",
                         [e for e in ENTRIES if e[4]], ids=[i for i, e in zip(IDS, ENTRIES) if e[4]])
def test_old_spellings_parse_to_the_same_dest(module, func, prefix, shared, aliases, stop_after_parse):
    for old, new in aliases:
        got_old = _parse(module, func, [*prefix, *old])
        got_new = _parse(module, func, [*prefix, *new])
        assert got_old == got_new
        # and the new spelling really set something (not both defaults)
        assert got_new != _parse(module, func, list(prefix))


def test_shared_flags_one_dest_hidden_aliases_and_units():
    p = argparse.ArgumentParser(prog="x")
    flags.add_bandwidth(p, nargs="+", default=[100.0])
    flags.add_link_method(p)
    flags.add_out(p)
    flags.add_data_path(p)
    flags.add_repeats(p, default=3)
    flags.add_context_tokens(p, default=1024, aliases=("--tokens",))
    flags.add_model(p)
    flags.add_seed(p)
    flags.add_quick(p)
    flags.add_verbose(p)
    ns = p.parse_args([])
    assert (ns.bandwidth_mbps, ns.link_method, ns.out, ns.data_path, ns.repeats, ns.context_tokens,
            ns.model, ns.seed, ns.quick, ns.verbose) == ([100.0], "auto", None, None, 3, 1024,
                                                         None, 0, False, False)
    old = p.parse_args(["--rate-mbps", "5", "--method", "netns", "--json", "o", "--data", "d",
                        "--reps", "7", "--tokens", "64"])
    new = p.parse_args(["--bandwidth-mbps", "5", "--link-method", "netns", "--out", "o",
                        "--data-path", "d", "--repeats", "7", "--context-tokens", "64"])
    assert vars(old) == vars(new) and new.bandwidth_mbps == [5.0] and new.context_tokens == 64
    text = p.format_help()
    assert "Mbit/s" in text and "tokens" in text
    for old_flag in ("--rate-mbps", "--json", "--reps", "--tokens"):
        assert old_flag not in text
    assert not re.search(OLD["--method"], text) and not re.search(OLD["--data"], text)
    with pytest.raises(SystemExit):   # an alias keeps the new flag's choices / type
        p.parse_args(["--method", "carrier-pigeon"])


def _norm(v):
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    if isinstance(v, Path):
        return str(v)
    return v


def test_benchmark_yaml_equals_the_run_config_defaults():
    import dataclasses

    from harness.config import DEFAULT_CONFIG, RunConfig, resolve

    data = config_file.load_config(DEFAULT_CONFIG)
    fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert set(data) <= set(fields)
    bad = {k: (v, fields[k]) for k, v in data.items() if _norm(v) != _norm(fields[k])}
    assert not bad, f"configs/benchmark.yaml disagrees with RunConfig: {bad}"
    # the file is what a run gets, and RunConfig() is the same run
    assert resolve(None, {}) == RunConfig()


def test_adaptation_yaml_equals_the_parser_defaults():
    from bench import adapt

    p = adapt.build_parser()
    data = config_file.load_config(config_file.CONFIGS / "adaptation.yaml")
    assert data and set(data) <= config_file.parser_dests(p)
    bad = {k: (v, p.get_default(k)) for k, v in data.items() if _norm(v) != _norm(p.get_default(k))}
    assert not bad, f"configs/adaptation.yaml disagrees with bench.adapt's defaults: {bad}"


def test_every_configs_file_is_checked():
    # command defaults are checked above; the codec files are CodecConfig presets
    from codec.config import CodecConfig

    commands = {"benchmark.yaml", "adaptation.yaml"}
    for path in sorted(config_file.CONFIGS.iterdir()):
        if path.name in commands:
            continue
        data = config_file.load_config(path)
        assert "codec" in data, f"{path.name}: neither a command's defaults nor a codec config"
        cfg = CodecConfig.from_yaml(path, 30)   # loads (unknown keys are refused there)
        assert cfg.chunk_tokens == data.get("chunk_tokens", cfg.chunk_tokens)


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "context_tokens: 512\nslo_s: [1.0]\n"),
    (".toml", "context_tokens = 512\nslo_s = [1.0]\n"),
    (".json", '{"context_tokens": 512, "slo_s": [1.0]}'),
])
def test_config_file_sets_defaults_and_flags_win(tmp_path, suffix, text, stop_after_parse):
    from bench import adapt

    f = tmp_path / f"c{suffix}"
    f.write_text(text)
    with pytest.raises(_Parsed) as got:
        config_file.parse_with_config(adapt.build_parser(), ["--config", str(f)])
    assert got.value.ns.context_tokens == 512 and got.value.ns.slo_s == [1.0]
    assert got.value.ns.chunk_tokens == 416              # not in the file: the code's default
    with pytest.raises(_Parsed) as got:
        config_file.parse_with_config(adapt.build_parser(), ["--config", str(f), "--context-tokens", "64"])
    assert got.value.ns.context_tokens == 64


@pytest.mark.parametrize("name, text, msg", [
    ("bad.yaml", "context_tokens: [1\n", "not valid yaml"),
    ("bad.toml", "context_tokens = \n", "not valid toml"),
    ("list.json", "[1, 2]", "must be a mapping"),
    ("unknown.yaml", "no_such_flag: 1\n", "unknown key(s) ['no_such_flag']"),
    ("missing.yaml", None, "cannot read config"),
])
def test_bad_config_file_is_one_line_and_exit_2(tmp_path, capsys, name, text, msg):
    from bench import adapt

    f = tmp_path / name
    if text is not None:
        f.write_text(text)
    with pytest.raises(SystemExit) as ex:
        config_file.parse_with_config(adapt.build_parser(), ["--config", str(f)])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1] and "Traceback" not in "\n".join(err)


def test_one_mbps_conversion():
    assert BYTES_PER_S_PER_MBPS == 125_000.0
    assert mbps_to_bytes_per_s(1) == 125_000.0 and mbps_to_bytes_per_s(100.0) == 12_500_000.0
    assert bytes_per_s_to_mbps(125_000) == 1.0
    for r in (0.1, 3.7, 100.0, 1000.0, 99_999.0):
        # bit for bit what the inline forms it replaced computed
        assert mbps_to_bytes_per_s(r) == r * 1e6 / 8
        assert bytes_per_s_to_mbps(r) == r * 8 / 1e6
        assert goodput_mbps(r * 1e6, 2.0) == r * 1e6 * 8 / 2.0 / 1e6


def test_no_inline_mbps_conversion_left():
    pat = re.compile(r"1e6 ?/ ?8|8 ?/ ?1e6|125[_]?000\b|/ ?125e3|\* ?8 ?/ ?\w+ ?/ ?1e6")
    bad = []
    for pkg in ("streaming", "bench", "harness", "third_party", "scripts", "kv_extraction_hf",
                "evaluation"):
        for p in (ROOT / pkg).rglob("*.py"):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if pat.search(line):
                    bad.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    for p in (ROOT / "visualize_results.py", ROOT / "run_benchmarks.py"):
        bad += [f"{p.name}:{i}" for i, ln in enumerate(p.read_text().splitlines(), 1) if pat.search(ln)]
    assert not bad, "\n".join(bad)


def test_result_header_fields_and_atomic_write(tmp_path):
    env = header.environment(("python", "platform", "num_cpus", "packages", "link_method"),
                             packages=("pytest", "no-such-package-xyz"), link_method="userspace")
    assert list(env) == ["python", "platform", "num_cpus", "packages", "link_method"]
    assert env["link_method"] == "userspace" and set(env["packages"]) == {"pytest"}
    with pytest.raises(KeyError):
        header.environment(("no_such_field",))
    from harness.results import environment as results_env

    assert list(results_env("netns")) == ["python", "platform", "cpu", "num_cpus", "gpu", "packages",
                                          "link_method", "numerics"]
    out = tmp_path / "sub" / "r.json"
    files.atomic_write_json(out, {"a": 1, "p": Path("x")})
    assert json.loads(out.read_text()) == {"a": 1, "p": "x"}
    with pytest.raises(TypeError):
        files.atomic_write_json(out, {"bad": object()})
    assert json.loads(out.read_text()) == {"a": 1, "p": "x"}          # the old file stays whole
    assert sorted(x.name for x in out.parent.iterdir()) == ["r.json"]  # no temporary file left
    out.chmod(0o640)
    files.atomic_write_text(out, "new\n", keep_mode=True)
    assert out.read_text() == "new\n" and out.stat().st_mode & 0o777 == 0o640


def test_run_benchmarks_config_reads_toml_too(tmp_path):
    from harness.config import ConfigError, resolve

    f = tmp_path / "b.toml"
    f.write_text('bandwidth_mbps = [50]\nmodes = ["text", "raw"]\nlink_method = "userspace"\n')
    cfg = resolve(f, {"repeats": 4})
    assert (cfg.bandwidth_mbps, cfg.modes, cfg.link_method, cfg.repeats) == ((50.0,), ("text", "raw"),
                                                                             "userspace", 4)
    f.write_text("bandwidth_mbps = [50\n")
    with pytest.raises(ConfigError, match="not valid toml"):
        resolve(f, {})
