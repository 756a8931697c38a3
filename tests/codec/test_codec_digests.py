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

The fixed KV, the calibrations and the case list are in ``tests/helpers/codec_digests.py``
(tests/codec/test_codec_bitstream_versions.py uses them too).

``tests/data/codec_digests.json`` was first written at commit 98e1f6b's API with this
file's generator; the bytes of today's code equal it.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

if __name__ == "__main__":          # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import codec  # noqa: E402
from codec import kvtc  # noqa: E402
from tests.helpers.codec_digests import (CHUNK, DTYPES, KVTC_CALIBRATIONS, cases,  # noqa: E402
                                         fixed_calibration, fixed_kv)

DIGESTS = Path(__file__).parents[1] / "data" / "codec_digests.json"

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
