"""The hand-made kvtc fixture of tests/fixtures/kvtc_padded: its folder, its generator
module (``make_fixture.py``: the exact calibration and KV) and the digests of the decoded
K and V bits of its level 0/1 containers (every float32 operation exact, so the decoded
bits depend only on the format). The fixture ``exact`` (tests/codec/conftest.py)
registers its calibration."""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import torch

FIX = Path(__file__).parents[1] / "fixtures" / "kvtc_padded"
# sha256 of the decoded K and V bits of tests/fixtures/kvtc_padded/kvtc_l{level}.kvcg, as
# the padded-layout writer's decoder (git 644ee2c) gave them
PADDED_FIXTURES = {
    0: "cc32991adf904abbaa7088d99709b36659559702047abc3d08f615d8599c9e27",
    1: "471d4bd7f665728aa7ee129f48c6e6a93a4367d7b0d2ad523d98daa892e3de6a",
}


def maker():
    """tests/fixtures/kvtc_padded/make_fixture.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location("kvtc_padded_make", FIX / "make_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bits_digest(k, v) -> str:
    """sha256 hex of the 16-bit K then V values' bytes."""
    return hashlib.sha256(k.view(torch.uint16).numpy().tobytes()
                          + v.view(torch.uint16).numpy().tobytes()).hexdigest()
