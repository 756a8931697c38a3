"""kvtc calibrations per layer group (kv_extraction_hf.calibrate.groups) for sliding-window
storage, on a tiny random Gemma 3 (layers 0-4 sliding, window 8; layer 5 full)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from codec import kvtc, window
from kv_extraction_hf import calibrate as cal_mod
from kv_extraction_hf.calibrate import groups as cg
from kv_extraction_hf.inject import continuation_logits
from kv_extraction_hf.inject_window import model_windows
from kv_extraction_hf.extract import prefill_kv
from tests.helpers.kv import make_kv


class _CharTokenizer:
    """One token per character (mod the tiny vocabulary)."""
    eos_token_id = None
    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 96 for c in text]}


@pytest.fixture
def bundle(tiny_gemma3, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGEN_CACHE", str(tmp_path / "cache"))
    # small calibration: 2 windows x 96 tokens, probe on 64 tokens
    for k, v in (("windows", 2), ("window_tokens", 96), ("sensitivity_tokens", 64), ("sensitivity_batch", 4)):
        monkeypatch.setitem(cal_mod.DEFAULT_SETTINGS, k, v)
    return dataclasses.replace(tiny_gemma3, tokenizer=_CharTokenizer())


def _text(tmp_path, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = ["".join(chr(97 + int(x)) for x in torch.randint(0, 26, (5,), generator=g)) for _ in range(200)]
    p = tmp_path / f"cal{seed}.txt"
    p.write_text(" ".join(words))
    return p


def test_one_calibration_per_group_fitted_once_then_cached(bundle, tmp_path, monkeypatch):
    ws = model_windows(bundle)
    assert ws == [8, 8, 8, 8, 8, None]
    path = _text(tmp_path)
    hashes = cg.group_calibrations(bundle, ws, str(path), log=lambda m: None)
    assert set(hashes) == {(0, 1, 2, 3, 4), (5,)}
    for g, h in hashes.items():
        c = kvtc.get_calibration(h)
        assert c.num_layers == len(g) and c.meta["layers"] == list(g)
    assert len(set(hashes.values())) == 2
    index = list((tmp_path / "cache" / "kvtc").glob("groups-*.json"))
    assert len(index) == 1 and len(json.loads(index[0].read_text())["groups"]) == 2

    def boom(*a, **k):
        raise AssertionError("refitted although cached")

    monkeypatch.setattr(cal_mod, "calibrate", boom)
    assert cg.group_calibrations(bundle, ws, str(path), log=lambda m: None) == hashes
    # another text is another calibration: not served from this one's cache
    with pytest.raises(AssertionError, match="refitted"):
        cg.group_calibrations(bundle, ws, str(_text(tmp_path, seed=1)), log=lambda m: None)


def test_a_damaged_cache_entry_is_refitted_not_served(bundle, tmp_path):
    ws = model_windows(bundle)
    path = _text(tmp_path)
    h1 = cg.group_calibrations(bundle, ws, str(path), log=lambda m: None)
    folder = tmp_path / "cache" / "kvtc"
    art = folder / f"{h1[(5,)]}.safetensors"
    art.write_bytes(art.read_bytes()[:100])                   # truncated artifact
    h2 = cg.group_calibrations(bundle, ws, str(path), log=lambda m: None)
    assert h2 == h1                                          # same data, same fit, same hashes
    assert kvtc.load_calibration(art).hash == h1[(5,)]         # the artifact was rewritten


def test_windowed_kvtc_round_trip_with_group_configs(bundle, tmp_path):
    ws = model_windows(bundle)
    cfg = cg.group_configs(bundle, ws, str(_text(tmp_path)), log=lambda m: None)
    ids = [int(x) for x in torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))]
    k, v = prefill_kv(bundle, ids)
    data, st = window.encode_with_stats(k, v, ws, codec="kvtc", config=cfg)
    assert st["stored_elements"] == 2 * (5 * 8 + 40) * 32
    k2, v2 = window.decode_dense(data)
    assert k2.shape == k.shape
    assert torch.all(k2[:5, :32] == 0)            # before each sliding layer's window: nothing
    # the kept tokens: each group's calibration codes its layers about as well as one
    # calibration of the whole model codes the full layout (same text, same level)
    (h,) = cg.group_calibrations(bundle, [None] * 6, str(tmp_path / "cal0.txt"), log=lambda m: None).values()
    import codec as codec_api
    kf, vf = codec_api.decode_kv(codec_api.encode_kv(k, v, codec="kvtc", config=kvtc.KvtcConfig(calibration=h)))
    kept = [(i, slice(32, 40) if i < 5 else slice(0, 40)) for i in range(6)]

    def err(a, b):
        return sum((a[i, s] - b[i, s]).float().pow(2).sum() for i, s in kept) / sum(
            b[i, s].float().pow(2).sum() for i, s in kept)

    assert err(k2, k) + err(v2, v) < 1.5 * (err(kf, k) + err(vf, v))
    logits = continuation_logits(bundle, k2, v2, ids, [1, 2, 3])
    assert torch.isfinite(logits).all()


def test_whole_model_calibration_is_refused_by_window_storage(bundle, tmp_path):
    ws = model_windows(bundle)
    (h,) = cg.group_calibrations(bundle, [None] * 6, str(_text(tmp_path)), log=lambda m: None).values()
    k, _ = make_kv(6, 20, 1, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="layer group"):
        window.encode_windowed(k, k.clone(), ws, codec="kvtc", config=kvtc.KvtcConfig(calibration=h))


def test_windows_of_the_wrong_length_are_a_clear_error(bundle, tmp_path):
    with pytest.raises(ValueError, match="6 layers"):
        cg.group_calibrations(bundle, [8, None], str(_text(tmp_path)), log=lambda m: None)
