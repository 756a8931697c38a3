"""No undefined memory reaches a result: every scratch buffer of the codec comes
from ``codec.scratch``, whose test mode fills it with NaN (floats) or all bits set
(integers). A correct codec writes every element it later reads, so for every registered
codec and level, in float16, bfloat16 and float32, the bytes and the decoded values under
the poison mode equal those of the zero-fill mode. kvtc runs with three small calibrations
fitted here (per-layer bases with RoPE, centroid offsets, a grouped joint basis) and a
tail tier; its bf16 decode is the case that returned NaN on an AMX Xeon (a column slice of
an uninitialised buffer as a GEMM operand, codec/scratch.py).

Run: .venv/bin/python -m pytest tests/codec/test_codec_scratch.py -q
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

import codec
from codec import kvtc, scratch
from tests.helpers.kv import correlated_kv

L, H, D, T = 4, 2, 8, 40
TARGETS = {0: 0.55, 1: 0.7, 2: 0.85, 3: 0.95, 4: 1.1, 5: 1.85}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _kv(T_, seed):
    """float32 [L, T_, H, D] with correlated channels, the mixing drawn from ``seed`` too."""
    return correlated_kv(L, T_, H, D, seed, mix_seed=None)


@pytest.fixture(scope="module")
def kvtc_configs():
    n = 384
    k, v = _kv(n, 1), _kv(n, 2)
    rk = dict(positions=torch.arange(n), rope_theta=10000.0, level_targets=TARGETS)
    plain = kvtc.fit_calibration(k, v, **rk)
    cent = kvtc.fit_calibration(k, v, centroid=True, rounding=0.3, **rk)
    grouped = kvtc.fit_calibration(kvtc.apply_rope(k, torch.arange(n), 10000.0), v,
                                   group_layers=2, **rk)
    assert cent.shrink is not None and grouped.group_layers == 2
    return {"plain": kvtc.KvtcConfig(calibration=plain),
            "centroid": kvtc.KvtcConfig(calibration=cent),
            "grouped": kvtc.KvtcConfig(calibration=grouped),
            "tiers": kvtc.KvtcConfig(calibration=plain, tiers=((8, 5),))}


def _cases(kvtc_configs):
    for name in sorted(codec.CODECS):
        obj = codec.CODECS[name]
        lv = list(codec.levels(name)) if obj.uses_level else [None]
        cfgs = list(kvtc_configs.items()) if name == "kvtc" else [(None, None)]
        for tag, cfg in cfgs:
            for level in lv:
                yield name, tag, level, cfg


def _digests(k, v, cases) -> dict:
    out = {}
    for name, tag, level, cfg in cases:
        data = codec.encode_kv(k, v, codec=name, level=level, config=cfg)
        k2, v2 = codec.decode_kv(data)
        assert k2.dtype == k.dtype and k2.shape == k.shape
        vals = k2.contiguous().view(torch.uint8).numpy().tobytes() + \
            v2.contiguous().view(torch.uint8).numpy().tobytes()
        out[(name, tag, level)] = (hashlib.sha256(data).hexdigest(),
                                   hashlib.sha256(vals).hexdigest(),
                                   bool(torch.isfinite(k2).all() and torch.isfinite(v2).all()))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_poisoned_scratch_gives_the_zero_fill_bytes_and_values(dtype, kvtc_configs):
    k, v = _kv(T, 7).to(dtype), _kv(T, 8).to(dtype)
    cases = list(_cases(kvtc_configs))
    assert {c[0] for c in cases} == set(codec.CODECS)
    with scratch.poisoned("zero"):
        zero = _digests(k, v, cases)
    with scratch.poisoned("nan"):
        nan = _digests(k, v, cases)
    assert all(f for _, _, f in zero.values())
    differ = sorted(str(key) for key in zero if zero[key] != nan[key])
    assert not differ, f"poisoned scratch changed {differ}"


def test_poisoned_scratch_chunks_with_offsets(kvtc_configs):
    # chunked encodes (token offsets, chunks without sinks, a tail tier in the last chunk)
    k, v = _kv(T, 9).to(torch.bfloat16), _kv(T, 10).to(torch.bfloat16)
    runs = {}
    for m in ("zero", "nan"):
        with scratch.poisoned(m):
            got = []
            for name, cfg in (("kvtc", kvtc_configs["tiers"]), ("kvtc", kvtc_configs["grouped"]),
                              ("cachegen", None), ("kivi2", None)):
                chunks = codec.encode_chunks(k, v, codec=name, config=cfg, chunk_tokens=16)
                k2, v2 = codec.decode_chunks(chunks)
                got.append(([hashlib.sha256(c).hexdigest() for c in chunks],
                            k2.view(torch.int16).sum().item(), torch.equal(k2, k2),
                            hashlib.sha256(k2.view(torch.uint8).numpy().tobytes()
                                           + v2.view(torch.uint8).numpy().tobytes()).hexdigest()))
            runs[m] = got
    assert runs["zero"] == runs["nan"]
    assert all(g[2] for g in runs["nan"])     # no NaN in a decoded chunk (NaN != NaN)


def test_scratch_modes_fill_what_they_say():
    with scratch.poisoned("nan"):
        assert torch.isnan(scratch.empty((3, 2), torch.bfloat16)).all()
        assert torch.isnan(scratch.empty((4,))).all() and scratch.empty((4,)).dtype == torch.float32
        assert (scratch.empty((5,), torch.int16) == -1).all()
        assert (scratch.empty((5,), torch.uint8) == 255).all()
        assert np.isnan(scratch.np_empty((2, 2), np.float64)).all()
        assert (scratch.np_empty(3, np.uint16) == 0xFFFF).all()
        assert (scratch.np_empty(3, np.int64) == -1).all()
        assert scratch.current_mode() == "nan"
        with scratch.poisoned("zero"):
            assert not scratch.empty((3,), torch.float16).any()
            assert not scratch.np_empty((3,), np.uint8).any()
        assert scratch.current_mode() == "nan"
    with pytest.raises(ValueError, match="scratch mode"):
        scratch.mode("garbage")


def test_scratch_mode_from_the_environment(monkeypatch):
    prev = scratch.mode(None)
    try:
        monkeypatch.setattr(scratch, "_SET", False)
        monkeypatch.setenv("CACHEGEN_SCRATCH", "nan")
        assert scratch.current_mode() == "nan" and torch.isnan(scratch.empty((2,))).all()
        monkeypatch.setenv("CACHEGEN_SCRATCH", "bogus")
        with pytest.raises(ValueError, match="scratch mode"):
            scratch.current_mode()
        monkeypatch.delenv("CACHEGEN_SCRATCH")
        assert scratch.current_mode() is None
    finally:
        scratch.mode(prev)


def test_kvtc_gemm_operand_is_contiguous():
    # the decode's coefficient operand is the front of a flat buffer viewed [rows, cols]:
    # contiguous, leading dimension = cols (never a column slice of a wider buffer)
    flat = torch.arange(24, dtype=torch.float32)
    q = kvtc.workers.rows_view(flat, 4, 5)
    assert q.shape == (4, 5) and q.is_contiguous() and q.stride() == (5, 1)
    assert q.data_ptr() == flat.data_ptr()
