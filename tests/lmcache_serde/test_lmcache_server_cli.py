"""The LMCache server launcher (third_party/lmcache/server.py): a bad option of our serde in
an ``--l2-adapter`` JSON is one line on stderr and exit status 2, before LMCache starts
(the trial found it as the last line of LMCache's 69-line traceback). Needs lmcache."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache", reason="lmcache not installed: bash scripts/setup.sh lmcache")

from third_party.lmcache import server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _adapter(serde: dict) -> str:
    return json.dumps({"type": "fs", "base_path": "/tmp/never-written", "serde": serde})


@pytest.mark.parametrize("serde,needle", [
    ({"type": "cachegen", "level": 9}, "level"),
    ({"type": "cachegen", "level": "1"}, "level"),
    ({"type": "cachegen", "chunk_tokens": 100}, "chunk_tokens"),
    ({"type": "cachegen", "levle": 1}, "unknown"),
    ({"type": "cachegen", "slot_ratio": -3}, "slot_ratio"),
    ({"type": "cachegen", "calibration": "0" * 64}, "calibration"),
    ({"type": "kvtc"}, "calibration"),
    ({"type": "kvtc", "calibration": "f" * 64}, "not available"),
])
def test_bad_serde_option_is_one_line(serde, needle, capsys):
    for form in (["--l2-adapter", _adapter(serde)], [f"--l2-adapter={_adapter(serde)}"]):
        assert server.main(["--port", "1", *form]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --l2-adapter 'fs' serde ") and needle in err
        assert "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("value,needle", [("{not json", "not JSON"), ("[1, 2]", "JSON object")])
def test_adapter_value_not_an_object(value, needle, capsys):
    assert server.main(["--l2-adapter", value]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


def test_good_and_foreign_serdes_pass_the_check():
    server.check_adapters(["--l2-adapter", _adapter({"type": "cachegen", "level": 2, "num_kv_heads": 3}),
                           "--l2-adapter", _adapter({"type": "fp8"}),
                           "--l2-adapter", json.dumps({"type": "fs", "base_path": "/tmp/x"})])


def test_subprocess_exit_status_and_single_line():
    p = subprocess.run([sys.executable, "-m", "third_party.lmcache.server", "--l2-adapter",
                        _adapter({"type": "cachegen", "pad": "sometimes"})],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: ") and "pad" in lines[-1]
    assert not any("Traceback" in ln for ln in lines)
