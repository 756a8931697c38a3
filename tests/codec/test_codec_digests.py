"""Same bytes: every codec and level encodes a fixed KV to bytes whose sha256 is checked in.

The KV is made of small integers times powers of two (numpy PCG64 integers, no float
generator, no transcendental function), so it is exact in float16 and bfloat16 on every
CPU. kvtc encodes with calibrations built here from fixed numbers (signed permutation
bases, power-of-two steps, means on a 1/16 grid, keys post-RoPE): each coefficient is one
exact product, so its bytes do not depend on a matmul kernel's summation order or rounding
(a fitted calibration's bases would: PCA through BLAS/oneDNN differs across CPUs). Not
covered for that reason: kvtc pre-RoPE keys (cos/sin tables) and fitted bases.

A failing case means a codec's bitstream changed. If the change is intended (a new format
version), regenerate and commit the digests with a note saying why:

    .venv/bin/python tests/codec/test_codec_digests.py --write

``tests/data/codec_digests.json`` was first written at commit 98e1f6b's API with this
file's generator; the bytes of today's code equal it.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if __name__ == "__main__":          # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import codec  # noqa: E402
from codec import kvtc  # noqa: E402

DIGESTS = Path(__file__).parents[1] / "data" / "codec_digests.json"
L, T, H, D = 2, 192, 2, 64      # T = 192: KIVI quantizes the tokens before its last 128
CHUNK = 64                      # three chunks: offsets, sinks and the last chunk's tail
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def fixed_kv(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [L, T, H, D] of ``dtype``: integers in [-127, 127] times 2^e per channel (e in
    -6..0, a few channels 2^2: outliers) plus a slow per-channel drift; exact in bf16."""
    rng = np.random.default_rng(20261202)
    q = rng.integers(-127, 128, size=(L, 2, T, H, D)).astype(np.float32)
    e = rng.integers(-6, 1, size=(L, 2, 1, H, D)).astype(np.float32)
    e[:, :, :, :, ::29] = 2.0
    drift = np.cumsum(rng.integers(-1, 2, size=(L, 2, T, H, D)), axis=2).astype(np.float32)
    x = np.clip(q + 4 * drift, -255, 255) * np.exp2(e - 7)     # |x| <= 255 * 2^-5 ... 2^-5
    x = np.round(x * 2**12) / 2**12                             # keep 8 significant bits
    t = torch.from_numpy(np.ascontiguousarray(x))
    assert torch.equal(t.to(dtype).to(torch.float32), t), "fixed KV is not exact"
    return t[:, 0].to(dtype).contiguous(), t[:, 1].to(dtype).contiguous()


def fixed_calibration(group_layers: int = 0, rounding: float = 0.5) -> "kvtc.KvtcCalibration":
    """A kvtc calibration from fixed numbers (no fit): orthonormal signed-permutation bases,
    power-of-two steps dropping a suffix, levels 0-5 with the default targets."""
    rng = np.random.default_rng(7)
    C = H * D
    levels = tuple(sorted(kvtc.DEFAULT_LEVEL_TARGETS))
    keep = [12, 20, 28, 40, 56, 100]
    if group_layers:
        NG, Cg = -(-L // group_layers), 2 * group_layers * C
        lead = (NG,)
        width = Cg
    else:
        lead = (2, L)
        width = C
    n_mats = int(np.prod(lead))
    basis = np.zeros((n_mats, width, width), np.float32)
    for m in range(n_mats):
        perm = rng.permutation(width)
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=width)
        basis[m, perm, np.arange(width)] = sign
    basis = basis.reshape(*lead, width, width)
    mean = (rng.integers(-8, 9, size=(*lead, width)) / 16).astype(np.float32)
    var = np.broadcast_to(np.exp2(-np.arange(width) / 16.0).astype(np.float32),
                          (*lead, width)).copy()
    step = np.zeros((len(levels), *lead, width), np.float32)
    for i, n in enumerate(keep[:len(levels)]):
        n = min(n * (2 if group_layers else 1), width)
        step[i, ..., :n] = np.exp2(-9 - i + np.floor(np.arange(n) / 16)).astype(np.float32)
    cal = kvtc.KvtcCalibration(
        num_layers=L, num_heads=H, head_dim=D, mean=mean, basis=basis, var=var, step=step,
        levels=levels, targets=tuple(float(kvtc.DEFAULT_LEVEL_TARGETS[x]) for x in levels),
        default_level=4, key_space="post_rope", rope_theta=0.0, per_head=False,
        # the label the digests were made with (the file's path then): part of the
        # calibration's hash, so of every kvtc container; a new path must not change it
        meta={"made_by": "tests/test_codec_digests.py"}, rounding=rounding,
        group_layers=group_layers)
    cal.hash = cal.content_hash()
    return cal


KVTC_CALIBRATIONS = {"kvtc": {}, "kvtc-deadzone": {"rounding": 0.375},
                     "kvtc-grouped": {"group_layers": 2}}


def cases() -> list[tuple[str, str, object, str]]:
    """(case id, codec name, level, dtype key) for every registered codec and level."""
    out = []
    for name in sorted(codec.CODECS):
        if name == "kvtc":
            continue
        for lvl in (codec.levels(name) or (None,)):
            for dt in DTYPES:
                out.append((f"{name}/{lvl}/{dt}", name, lvl, dt))
    for cname in KVTC_CALIBRATIONS:
        for lvl in sorted(kvtc.DEFAULT_LEVEL_TARGETS):
            for dt in DTYPES:
                out.append((f"{cname}/{lvl}/{dt}", cname, lvl, dt))
    return out


_CAL_CACHE: dict = {}


def encode_digest(name: str, level, dt: str) -> str:
    """sha256 hex of the concatenated chunk containers of the fixed KV (chunks of 64)."""
    k, v = fixed_kv(DTYPES[dt])
    if name.startswith("kvtc"):
        if name not in _CAL_CACHE:
            _CAL_CACHE[name] = fixed_calibration(**KVTC_CALIBRATIONS[name])
        cfg = kvtc.KvtcConfig(calibration=_CAL_CACHE[name])
        blobs = codec.encode_chunks(k, v, codec="kvtc", level=level, config=cfg,
                                    chunk_tokens=CHUNK)
    else:
        blobs = codec.encode_chunks(k, v, codec=name, level=level, chunk_tokens=CHUNK)
    h = hashlib.sha256()
    for b in blobs:
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _load() -> dict:
    return json.loads(DIGESTS.read_text())["digests"]


def test_every_codec_and_level_has_a_digest():
    want = {c[0] for c in cases()}
    have = set(_load())
    assert want == have, f"missing: {sorted(want - have)}; stale: {sorted(have - want)}"


@pytest.mark.parametrize("case,name,level,dt", cases(), ids=[c[0] for c in cases()])
def test_bytes_equal_checked_in_digest(case, name, level, dt):
    assert encode_digest(name, level, dt) == _load()[case]


def test_fixed_inputs_are_what_the_digests_were_made_from():
    """The generator itself is pinned: a change to the fixed KV or calibration would move
    every digest at once (and is then not a codec change)."""
    k, v = fixed_kv(torch.float16)
    h = hashlib.sha256(k.numpy().tobytes() + v.numpy().tobytes()).hexdigest()
    meta = json.loads(DIGESTS.read_text())
    assert h == meta["fixed_kv_fp16_sha256"]
    assert fixed_calibration().hash == meta["kvtc_calibration_hash"]


def main(argv: list[str]) -> int:
    k, v = fixed_kv(torch.float16)
    out = {"note": "sha256 of codec.encode_chunks(fixed KV, chunk_tokens=64) per codec/level/"
                   "dtype; generator: tests/codec/test_codec_digests.py",
           "fixed_kv_fp16_sha256": hashlib.sha256(k.numpy().tobytes()
                                                  + v.numpy().tobytes()).hexdigest(),
           "kvtc_calibration_hash": fixed_calibration().hash,
           "digests": {c[0]: encode_digest(*c[1:]) for c in cases()}}
    text = json.dumps(out, indent=1, sort_keys=True) + "\n"
    if "--write" in argv:
        DIGESTS.parent.mkdir(parents=True, exist_ok=True)
        DIGESTS.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
