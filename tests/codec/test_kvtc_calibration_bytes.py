"""The kvtc calibration has one form from the fit to the decode: ``KvtcCalibration``
(immutable, hash set at construction), its bytes (``to_bytes`` / ``from_bytes``, the same
bytes as its file) and the codec-generic artifacts interface the KV store uses
(``codec.artifacts``).
Run: .venv/bin/python -m pytest tests/codec/test_kvtc_calibration_bytes.py -q
"""
from __future__ import annotations

import pytest
import torch

from codec import artifacts, kvtc
from codec.errors import CodecError


@pytest.fixture(scope="module")
def cal():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 300, 2, 8, generator=g), torch.randn(2, 300, 2, 8, generator=g)
    return kvtc.fit_calibration(k, v)


def test_bytes_round_trip_and_file(cal, tmp_path):
    data = cal.to_bytes()
    back = kvtc.KvtcCalibration.from_bytes(data)
    assert back.hash == cal.hash == cal.content_hash()
    # (safetensors may order the metadata keys differently from call to call: the hash,
    # not the bytes, names a calibration)
    assert kvtc.KvtcCalibration.from_bytes(back.to_bytes()).hash == cal.hash
    assert len(cal.save(tmp_path).read_bytes()) == len(data)
    assert kvtc.load_calibration(tmp_path / f"{cal.hash}.safetensors").hash == cal.hash


def test_immutable(cal):
    with pytest.raises(AttributeError, match="immutable"):
        cal.step = cal.step * 2
    with pytest.raises(AttributeError, match="immutable"):
        cal.hash = "0" * 64
    cal.hash = cal.content_hash()          # the value it has: allowed


@pytest.mark.parametrize("cut", [0, 7, 100, -5])
def test_damaged_bytes_refused(cal, cut):
    data = cal.to_bytes()
    with pytest.raises(CodecError):
        kvtc.KvtcCalibration.from_bytes(data[:cut])
    with pytest.raises(CodecError):
        kvtc.KvtcCalibration.from_bytes(b"x" * 8 + data[8:])


def test_artifacts_interface(cal, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kvtc.registry, "_CALIBRATIONS", {})
    assert not artifacts.has_artifact(cal.hash)
    with pytest.raises(CodecError):
        artifacts.artifact_bytes(cal.hash)
    with pytest.raises(CodecError):
        artifacts.load_artifact(cal.to_bytes(), "f" * 64)       # not the hash it carries
    artifacts.load_artifact(cal.to_bytes(), cal.hash)
    assert artifacts.has_artifact(cal.hash)
    assert kvtc.KvtcCalibration.from_bytes(artifacts.artifact_bytes(cal.hash)).hash == cal.hash
    assert (tmp_path / "kvtc" / f"{cal.hash}.safetensors").is_file()
