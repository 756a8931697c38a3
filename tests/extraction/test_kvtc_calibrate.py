"""Tests of the model-facing KVTC calibration (kv_extraction_hf/calibrate/__init__.py): the batched
sensitivity probe gives the same values whatever the batch, and the first calibration
window's KV is reused for it. Run: .venv/bin/python -m pytest tests/extraction/test_kvtc_calibrate.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

from kv_extraction_hf.errors import ExtractionError


@pytest.mark.slow
def test_sensitivity_does_not_depend_on_batch(default_bundle, fixtures_dir):
    from kv_extraction_hf.calibrate import measure_sensitivity
    from kv_extraction_hf.extract import prefill_kv

    text = (fixtures_dir / "wikitext2" / "wiki.test.raw").read_text()
    ids = default_bundle.tokenizer(text[:3000], add_special_tokens=False)["input_ids"][:80]
    k, v = prefill_kv(default_bundle, ids)
    one = measure_sensitivity(default_bundle, k, v, ids, continuation=8, batch=1,
                              log=lambda m: None)
    many = measure_sensitivity(default_bundle, k, v, ids, continuation=8, batch=7,
                               log=lambda m: None)
    assert one.shape == many.shape == (2, k.shape[0])
    assert (one > 0).all() and np.isfinite(many).all()
    # same noise draws; only the float32 rounding of a batched forward pass differs. A
    # probe's KL is ~ the square of its logit shift d, and the rounding shift r of another
    # kernel moves it by ~2 r / d relative: float32 (2^-24) measured 3.2e-3 at most on an
    # AMX Xeon (bf16 activations, 2^-8: up to 119%), hence 1e-2. A real fault (noise
    # drawn in another order, a probe written to the wrong (K/V, layer)) moves it by O(1).
    np.testing.assert_allclose(many, one, rtol=1e-2)
    with pytest.raises(ExtractionError, match="batch"):
        measure_sensitivity(default_bundle, k, v, ids, continuation=8, batch=0)


@pytest.mark.slow
def test_first_window_kv_is_kept_for_the_probe(default_bundle, fixtures_dir):
    from kv_extraction_hf.calibrate import calibration_samples
    from kv_extraction_hf.extract import prefill_kv

    text = (fixtures_dir / "wikitext2" / "wiki.test.raw").read_text()
    first: dict = {}
    k, v, pos = calibration_samples(default_bundle, text, 2, 96, 4, log=lambda s: None,
                                    first=first)
    assert k.shape[1] == 2 * 92 and pos.tolist()[:2] == [4, 5]
    assert len(first["ids"]) == 96 and first["k"].shape[1] == 96
    assert (first["k"][:, 4:] == k[:, :92]).all()
    # causal attention: the KV of a prefix equals the prefill of that prefix
    k0, _ = prefill_kv(default_bundle, first["ids"][:48])
    assert (first["k"][:, :48].float() - k0.float()).abs().max() < 0.1
