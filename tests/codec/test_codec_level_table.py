"""codec.level_table: the torch-free level vocabulary agrees with the codec registry, and
importing it (or codec.config) does not import torch.

Run: .venv/bin/python -m pytest tests/codec/test_codec_level_table.py -q
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import codec
from codec import kvtc, level_table as LT

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["codec.level_table", "codec.config", "codec.errors"])
def test_import_is_torch_free(module):
    code = f"import {module}, sys; assert 'torch' not in sys.modules, sorted(sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_table_is_the_registry():
    assert list(LT.CODEC_LEVELS) == list(codec.CODECS)
    for name, c in codec.CODECS.items():
        assert tuple(c.levels) == LT.levels(name) == codec.levels(name)
        assert c.default_level == LT.default_level(name) == codec.default_level(name)
        assert (LT.default_level(name) is None) == (LT.levels(name) == ())
        if LT.levels(name):
            assert LT.default_level(name) in LT.levels(name)


def test_known_values():
    assert LT.levels("cachegen") == (0, 1, 2, 3, 4, 5) and LT.default_level("cachegen") == 1
    assert LT.levels("cachegen-ref") == (0, 1, 2, 3) and LT.default_level("cachegen-ref") == 0
    assert LT.levels("kvtc") == tuple(sorted(kvtc.DEFAULT_LEVEL_TARGETS))
    assert LT.default_level("kvtc") == kvtc.DEFAULT_LEVEL == 4
    assert LT.levels("raw") == () and LT.default_level("quant8") is None


def test_label_and_errors():
    assert LT.label("cachegen", 1) == "cachegen 1"
    assert LT.label("raw", None) == "raw"
    for bad in ("nope", None, 3):
        with pytest.raises(ValueError, match="unknown codec"):
            LT.levels(bad)
        with pytest.raises(ValueError, match="unknown codec"):
            LT.default_level(bad)


def test_mode_order_lists_every_codec_once():
    assert len(set(LT.MODE_ORDER)) == len(LT.MODE_ORDER)
    assert set(codec.CODECS) <= set(LT.MODE_ORDER)


def test_lazy_package_attributes():
    """codec/__init__ is lazy (PEP 562): its public names and submodules still resolve."""
    r = subprocess.run([sys.executable, "-c",
                        "import codec, sys; assert 'torch' not in sys.modules; "
                        "assert callable(codec.encode_kv) and 'torch' in sys.modules; "
                        "assert codec.kvtc.KvtcCodec and codec.levels('kvtc'); "
                        "import codec.level_table; assert callable(codec.levels)"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    with pytest.raises(AttributeError):
        codec.no_such_name
