"""bench.codec's decode split and break-even bandwidth columns (bench/codec/rows.py,
bench/codec/metrics.py): present for every row, and derived from the measured seconds
by the documented formulas (values, not timings, are asserted).

Run: .venv/bin/python -m pytest tests/bench/test_bench_codec_rows.py -q
"""
from __future__ import annotations

import json

import pytest

from bench import codec as bench_codec


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("codec") / "bench.json"
    rc = bench_codec.main(["--quick", "--rows", "raw", "cachegen:1", "--repeats", "1",
                           "--out", str(out)])
    assert rc == 0
    return {r["label"]: r for r in json.loads(out.read_text())["rows"]}


def test_every_row_has_the_split_and_break_even(rows):
    for label, r in rows.items():
        for key in ("decode_parse_ms", "decode_checksum_ms", "decode_into_ms", "decode_alloc_ms",
                    "decode_other_ms", "break_even_mbps", "break_even_e2e_1thread_mbps",
                    "break_even_into_mbps", "break_even_into_1thread_mbps",
                    "decode_e2e_msym_s", "decode_e2e_1thread_msym_s", "decode_into_msym_s",
                    "decode_into_1thread_msym_s"):
            assert isinstance(r.get(key), float), (label, key)
        assert r["decode_parse_ms"] > 0 and r["decode_checksum_ms"] > 0
    assert "decode_coder_ms" in rows["cachegen-l1"] and "decode_coder_ms" not in rows["raw"]


def test_break_even_and_split_follow_their_formulas(rows):
    for r in rows.values():
        # the link rate at which moving one context's bytes takes its decode time
        assert r["break_even_mbps"] == pytest.approx(8 * r["bytes"] / r["decode_s"] / 1e6)
        into_s = r["decode_into_ms"] / 1e3
        assert r["break_even_into_mbps"] == pytest.approx(8 * r["bytes"] / into_s / 1e6)
        assert r["decode_alloc_ms"] == pytest.approx(1e3 * r["decode_s"] - r["decode_into_ms"])
        assert r["decode_other_ms"] == pytest.approx(
            r["decode_into_ms"] - r["decode_parse_ms"] - r.get("decode_coder_ms", 0.0))
        n_el = r["bytes"] * 8 / r["bits_per_element"]
        assert r["decode_into_msym_s"] == pytest.approx(n_el / into_s / 1e6)
