"""Fixtures shared by the codec tests.

``exact``: the hand-made calibration of tests/fixtures/kvtc_padded, registered for the
module and taken out of the registry after it (see tests/helpers/kvtc_padded.py).
"""
from __future__ import annotations

import pytest

from codec import kvtc
from tests.helpers.kvtc_padded import FIX, maker


@pytest.fixture(scope="module")
def exact():
    """(the fixture's generator module, its registered calibration)."""
    mod = maker()
    h = kvtc.register_calibration(FIX / "calibration.safetensors")
    assert h == mod.exact_calibration().hash       # the artifact is the hand-made one
    yield mod, kvtc.get_calibration(h)
    # leave the registry as found: later tests of this [3, T, 2, 8] shape pick their own
    with kvtc.registry._LOCK:
        kvtc.registry._CALIBRATIONS.pop(h, None)
