"""Pieces the kvtc tests share (their KV comes from ``tests.helpers.kv.correlated_kv``): the
relative error, a round trip at every level of a calibration and the fuzz loop's counter."""
from __future__ import annotations

import torch

import codec
from codec.errors import CodecError


def relerr(a, b):
    """Relative squared error of ``a`` against ``b`` (mean over all values)."""
    return float(((a.float() - b.float()) ** 2).mean() / (b.float() ** 2).mean())


def round_trip_levels(cal, k, v, config, sinks=4):
    """Encode + decode k, v [L, T, H, D] with kvtc at every level of ``cal``: checks the
    dtype and shapes, the exact sink tokens and the size bounds (below the raw dtype size,
    above the exact sinks alone) and that sizes grow with the level. Returns (containers,
    relative errors K + V) per level."""
    datas, errs = [], []
    L, _, H, D = k.shape
    for lv in cal.levels:
        data = codec.encode_kv(k, v, codec="kvtc", level=lv, config=config)
        k2, v2 = codec.decode_kv(data)
        assert k2.dtype == k.dtype and k2.shape == k.shape and v2.shape == v.shape
        assert torch.equal(k2[:, :sinks], k[:, :sinks]) and torch.equal(v2[:, :sinks], v[:, :sinks])
        errs.append(relerr(k2, k) + relerr(v2, v))
        raw = 2 * k.numel() * k.element_size()
        assert 2 * L * sinks * H * D * k.element_size() < len(data) < raw
        datas.append(data)
    sizes = [len(d) for d in datas]
    assert sizes == sorted(sizes)                 # more bits at higher levels
    return datas, errs


def undetected(mutations, shape) -> int:
    """Decode every mutated container: each raises CodecError or decodes to finite KV of
    ``shape``; returns how many decoded (mutations the checks did not catch)."""
    ok = 0
    for bad in mutations:
        try:
            k2, v2 = codec.decode_kv(bad)
        except CodecError:
            continue
        assert k2.shape == v2.shape == shape and bool(torch.isfinite(k2.float()).all())
        ok += 1
    return ok
