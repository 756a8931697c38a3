"""The fixed-slot ("constant bitrate") mode of our LMCache serdes
(third_party/lmcache/slot.py): ``slot_ratio`` sizes the slot, ``fallback`` codes a
frame too big for it at a coarser level, ``fill`` at the finest level that still fits.

- the slot is never exceeded (the frame and the padding end at the slot, the bytes of
  ``dst`` after it are untouched), and LMCache's fs adapter stores exactly the slot;
- an object too big for the coarsest level is refused with ValueError, and through
  LMCache's own ``SerdeL2AdapterWrapper`` + ``FSL2Adapter`` it is not stored and loads as a miss;
- fill picks a finer level when its frame fits, fallback a coarser one when it must;
- the KV that comes back is bit for bit what our codec decodes at the level chosen.
Run: .venv-lmcache/bin/python -m pytest tests/lmcache_serde -q
"""
from __future__ import annotations

import math
import os
import select
from pathlib import Path

import pytest
import torch

pytest.importorskip("lmcache", reason="lmcache not installed: bash scripts/setup.sh lmcache")

import codec  # noqa: E402
from bench.codec.contexts import synthetic_kv  # noqa: E402
from codec import kvtc  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig  # noqa: E402
from lmcache.v1.distributed.l1_manager import L1Manager  # noqa: E402
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import (  # noqa: E402
    FSL2Adapter, FSL2AdapterConfig)
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from third_party import lmcache as plugin  # noqa: E402
from third_party.lmcache import serde as S  # noqa: E402
from third_party.lmcache.frame import parse_frame  # noqa: E402
from third_party.lmcache.settings import parse_settings  # noqa: E402
from third_party.lmcache.slot import FILL_SLACK, level_step, pick_level  # noqa: E402

L, T, H, D = 2, 64, 2, 16
FILLER = 0xAB


def _obj(t: torch.Tensor) -> TensorMemoryObj:
    raw = t.contiguous().view(-1)
    return TensorMemoryObj(raw_data=raw, metadata=MemoryObjMetadata(
        shape=t.shape, dtype=t.dtype, address=-1, phy_size=raw.numel() * t.element_size(),
        ref_count=1, shapes=[t.shape], dtypes=[t.dtype]), parent_allocator=None)


def _key(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name="smollm2", kv_rank=0)


def _planes(k, v):
    return torch.stack([k.reshape(*k.shape[:2], -1), v.reshape(*v.shape[:2], -1)])


@pytest.fixture(scope="module", autouse=True)
def registered():
    plugin.register()


@pytest.fixture(scope="module")
def kv():
    k, v = synthetic_kv(L, T, H, D, seed=3)
    return k, v, _planes(k, v)


@pytest.fixture(scope="module")
def frame_sizes(kv):
    """Frame bytes of the test object at every cachegen level (no slot limit)."""
    _, _, x = kv
    big, _ = S.make_pair("cachegen", {"bits_per_element": 16.0, "num_kv_heads": H})
    return {lvl: len(big.encode_frame(_obj(x), _key(1), 1 << 30, lvl))
            for lvl in codec.levels("cachegen")}


def _fill_slot(sizes: dict, start: int, lvl: int, settings=None) -> int:
    """Bytes of a slot that level ``lvl``'s frame fits and that fill from ``start`` tries
    it for (each step's prediction fits too: slot.FILL_SLACK)."""
    s = settings or parse_settings("cachegen", {})
    return max([sizes[lvl]] + [math.ceil(sizes[j - 1] * level_step(s, T, j - 1, j) * FILL_SLACK)
                               for j in range(start + 1, lvl + 1)])


def _ratio_for(x, nbytes: int) -> float:
    """A slot_ratio whose slot for ``x`` is at least ``nbytes`` (and at most 2 bytes more)."""
    return x.numel() * x.element_size() / (nbytes + 1)


def _serialize(x, kw: dict, key: int = 1, extra: int = 4096):
    """Serialize ``x`` into a buffer ``extra`` bytes longer than the slot (filled with
    FILLER). Returns (serializer, deserializer, buffer tensor, slot, stored length)."""
    ser, de = S.make_pair("cachegen", {"num_kv_heads": H, **kw})
    slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    buf = torch.full((slot + extra,), FILLER, dtype=torch.uint8)
    n = ser.serialize(_obj(x), _obj(buf), _key(key))
    return ser, de, buf, slot, n


def _level_of(buf: torch.Tensor, slot: int) -> int:
    _, views = parse_frame(memoryview(buf[:slot].numpy()))
    return codec.peek_header(bytes(views[0]))["level"]


def _decoded(de, buf, slot, x, key: int = 1):
    out = _obj(torch.zeros_like(x))
    de.deserialize(_obj(buf[:slot].clone()), out, _key(key))        # what L2 holds
    return out.tensor


def test_options_resolve_and_bad_ones_are_refused():
    s = parse_settings("cachegen", {})
    assert s.pad and s.slot_ratio == 8.0 and s.fill              # the default with 0.5.6
    s = parse_settings("cachegen", {"bits_per_element": 3.0})
    assert s.slot_ratio is None and not s.fill                   # the explicit bound wins
    s = parse_settings("cachegen", {"pad": False})
    assert s.slot_ratio is None and not s.fill                   # sizes reported: no slot
    s = parse_settings("cachegen", {"slot_ratio": False})
    assert s.slot_ratio is None and not s.fill                   # the max-bound table
    s = parse_settings("cachegen", {"slot_ratio": 5, "fill": False})
    assert s.slot_ratio == 5.0 and not s.fill
    assert parse_settings("cachegen", {"slot_ratio": 5}).identity() != \
        parse_settings("cachegen", {"slot_ratio": 6}).identity()
    for kw, match in [({"slot_ratio": 0.5}, "slot_ratio"), ({"slot_ratio": "8"}, "slot_ratio"),
                      ({"slot_ratio": True}, "slot_ratio"), ({"slot_ratio": math.inf}, "slot_ratio"),
                      ({"slot_ratio": 8, "bits_per_element": 2.0}, "give one"),
                      ({"fill": "yes"}, "'fill' must be")]:
        with pytest.raises(ValueError, match=match):
            create_serde_processor(SerdeConfig(type="cachegen", kwargs=kw))


def test_slot_is_kv_bytes_over_ratio(kv):
    _, _, x = kv
    raw = x.numel() * x.element_size()
    lay = MemoryLayoutDesc([x.shape], [x.dtype])
    for r in (1.0, 3.0, 7.7, 20.0):
        ser, _ = S.make_pair("cachegen", {"slot_ratio": r, "always_fit": False})
        assert ser.estimate_serialized_size(lay) == math.floor(raw / r)
        # always_fit (cachegen's default): never below what floor-4 needs for any values
        ser, _ = S.make_pair("cachegen", {"slot_ratio": r})
        assert ser.estimate_serialized_size(lay) == max(math.floor(raw / r), _floor_slot(ser, x))
    assert _floor_slot(ser, x) > raw / 20                # this tiny object: 20x is below it


@pytest.mark.parametrize("at", [0, 1, 2, 3, 4, 5])
def test_slot_never_exceeded(kv, frame_sizes, at):
    """Slots at and just above each level's frame: frame + zero padding end exactly at the
    slot; the buffer after it is untouched."""
    _, _, x = kv
    ser, de, buf, slot, n = _serialize(x, {"slot_ratio": _ratio_for(x, frame_sizes[at] + at)})
    assert n == slot and ser.stats["bytes"] <= slot == ser.stats["slot_bytes"]
    assert bool((buf[ser.stats["bytes"]:slot] == 0).all())
    assert bool((buf[slot:] == FILLER).all())
    assert ser.stats["encodes"] >= 1 and ser.stats["objects"] == 1


def test_fill_picks_the_finest_level_that_fits(kv, frame_sizes):
    """Slot just above level 3's frame, configured level 1: coded at 3 (finer), and the KV
    that comes back is our codec's decode at level 3."""
    k, v, x = kv
    assert frame_sizes[3] < frame_sizes[4]
    ratio = _ratio_for(x, _fill_slot(frame_sizes, 1, 3))
    ser, de, buf, slot, _ = _serialize(x, {"level": 1, "slot_ratio": ratio})
    assert frame_sizes[3] <= slot < frame_sizes[4]
    assert _level_of(buf, slot) == 3
    assert ser.stats["finer"] == 1 and ser.stats["coarser"] == 0 and ser.stats["levels"] == {3: 1}
    assert ser.stats["bytes"] == frame_sizes[3]
    k3, v3 = codec.decode_kv(codec.encode_kv(k, v, codec="cachegen", level=3))
    assert torch.equal(_decoded(de, buf, slot, x), _planes(k3, v3))
    # without fill: the configured level, the rest of the slot padding
    ser, de, buf, slot, _ = _serialize(x, {"level": 1, "fill": False, "slot_ratio": ratio})
    assert _level_of(buf, slot) == 1 and ser.stats["finer"] == 0 and ser.stats["encodes"] == 1
    k1, v1 = codec.decode_kv(codec.encode_kv(k, v, codec="cachegen", level=1))
    assert torch.equal(_decoded(de, buf, slot, x), _planes(k1, v1))


def test_fallback_picks_a_coarser_level(kv, frame_sizes):
    """Slot between level 0's and level 2's frames, configured level 2: coded at the
    finest level below 2 that fits; the decode is our codec's at that level."""
    k, v, x = kv
    ser, de, buf, slot, _ = _serialize(x, {"level": 2, "slot_ratio": _ratio_for(x, frame_sizes[0])})
    lvl = _level_of(buf, slot)
    assert lvl == max(x for x in (0, 1) if frame_sizes[x] <= slot)
    assert ser.stats["coarser"] == ser.stats["fallbacks"] == 1 and ser.stats["finer"] == 0
    k0, v0 = codec.decode_kv(codec.encode_kv(k, v, codec="cachegen", level=lvl))
    assert torch.equal(_decoded(de, buf, slot, x), _planes(k0, v0))
    with pytest.raises(ValueError, match="does not fit the slot"):
        _serialize(x, {"level": 2, "fallback": False,
                       "slot_ratio": _ratio_for(x, frame_sizes[0])})


def _floor_slot(ser, x) -> int:
    """The always_fit bound for ``x``'s layout: min(raw frame, frame + floor-4's worst case)."""
    from third_party.lmcache.layout import frame_overhead, raw_frame_bytes
    from third_party.lmcache.slot import worst_floor_bytes

    s, h = ser.settings, ser.ident_hash
    return min(raw_frame_bytes(s, h, [x.shape], [x.dtype]),
               frame_overhead(s, h, [x.shape], [x.dtype]) + worst_floor_bytes(s, x.shape, x.dtype))


def test_too_big_for_the_coarsest_level_is_refused(kv, frame_sizes):
    _, _, x = kv
    r = _ratio_for(x, frame_sizes[0] - 64)
    ser, _ = S.make_pair("cachegen", {"num_kv_heads": H, "slot_ratio": r * 40,
                                      "always_fit": False})
    slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    buf = torch.full((slot + 64,), FILLER, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit the slot"):
        ser.serialize(_obj(x), _obj(buf), _key(1))
    assert bool((buf == FILLER).all())                          # nothing written
    assert ser.stats["refused"] == 1 and ser.stats["objects"] == 0


def _wait(fd: int) -> None:
    r, _, _ = select.select([fd], [], [], 120)
    assert r, "LMCache task did not signal its eventfd"
    os.read(fd, 8)


def _fs_store_load(base: Path, x: torch.Tensor, kw: dict):
    """Store x through LMCache's SerdeL2AdapterWrapper on its FSL2Adapter with our serde,
    then load it back: (store succeeded, load hit, loaded tensor)."""
    l1 = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(
        size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=64 << 20)))
    proc = create_serde_processor(SerdeConfig(type="cachegen", kwargs={"num_kv_heads": H, **kw}))
    w = SerdeL2AdapterWrapper(FSL2Adapter(FSL2AdapterConfig(base_path=str(base))), proc, l1)
    lay = MemoryLayoutDesc([x.shape], [x.dtype])
    try:
        src = l1.reserve_write([_key(900)], [False], lay)[_key(900)][1]
        src.tensor.copy_(x)
        tid = w.submit_store_task([_key(7)], [src])
        while tid not in (done := w.pop_completed_store_tasks()):
            _wait(w.get_store_event_fd())
        stored = done[tid].is_successful()
        out = l1.reserve_write([_key(901)], [False], lay)[_key(901)][1]
        out.tensor.zero_()
        tid = w.submit_load_task([_key(7)], [out])
        while (bits := w.query_load_result(tid)) is None:
            _wait(w.get_load_event_fd())
        return stored, bits.test(0), out.tensor.clone()
    finally:
        w.close()


def test_fs_adapter_stores_the_slot_and_refuses_what_fits_no_level(kv, frame_sizes, tmp_path):
    k, v, x = kv
    r = _ratio_for(x, _fill_slot(frame_sizes, 1, 2))
    stored, hit, got = _fs_store_load(tmp_path / "ok", x, {"level": 1, "slot_ratio": r})
    assert stored and hit
    files = list((tmp_path / "ok").glob("*.data"))
    slot = math.floor(x.numel() * x.element_size() / r)
    assert len(files) == 1 and files[0].stat().st_size == slot      # written ratio = r
    lvl = max(x for x in codec.levels("cachegen") if frame_sizes[x] <= slot)
    assert lvl == 2                                                  # filled: 1 -> 2
    k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="cachegen", level=lvl))
    assert torch.equal(got, _planes(k2, v2))
    # a slot below every step (always_fit off): the serializer raises, LMCache stores
    # nothing: a miss
    stored, hit, got = _fs_store_load(tmp_path / "no", x, {"slot_ratio": _ratio_for(
        x, frame_sizes[0] - 64) * 40, "always_fit": False})
    assert not hit and not list((tmp_path / "no").glob("*.data"))
    assert not bool(got.any())


def test_kvtc_slot_mode_decodes_as_our_codec_at_the_chosen_level():
    k, v = synthetic_kv(L, 512, H, D, seed=99)
    cal = kvtc.register_calibration(kvtc.fit_calibration(
        k.float(), v.float(), positions=torch.arange(512), rope_theta=10000.0,
        level_targets={0: 0.55, 1: 0.7, 2: 0.85, 3: 0.95, 4: 1.1, 5: 1.85}))
    k, v = k[:, :T].contiguous(), v[:, :T].contiguous()
    x = _planes(k, v)
    big, _ = S.make_pair("kvtc", {"calibration": cal, "bits_per_element": 16.0})
    sizes = {lvl: len(big.encode_frame(_obj(x), _key(1), 1 << 30, lvl)) for lvl in range(6)}
    want = _fill_slot(sizes, 3, 4, big.settings)
    assert want < sizes[5], sizes
    ser, de = S.make_pair("kvtc", {"calibration": cal, "level": 3,
                                   "slot_ratio": _ratio_for(x, want)})
    slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    buf = torch.zeros(slot, dtype=torch.uint8)
    assert ser.serialize(_obj(x), _obj(buf), _key(1)) == slot
    lvl = _level_of(buf, slot)
    assert lvl == 4 == max(x for x in sizes if sizes[x] <= slot) and ser.stats["finer"] == 1
    k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc",
                                             config=kvtc.KvtcConfig(calibration=cal, level=lvl)))
    assert torch.equal(_decoded(de, buf, slot, x), _planes(k2, v2))


def test_pick_level_bounds_its_encodes():
    """Unit test of the search with fake frame sizes per level (levels 0-5)."""
    size = {0: 100, 1: 120, 2: 140, 3: 170, 4: 210, 5: 400}
    calls = []

    def enc(lvl):
        calls.append(lvl)
        return b"x" * size[lvl]

    step = lambda lo, hi: size[hi] / size[lo]       # an exact predictor
    assert pick_level(enc, 1, range(6), 175, True, True, step)[1:] == (3, {"encodes": 3, "fill_misses": 0})
    assert calls == [1, 2, 3]                        # 4 predicted 20% past the slot: not tried
    calls.clear()
    assert pick_level(enc, 1, range(6), 207, True, True, step)[1:] == (3, {"encodes": 4, "fill_misses": 1})
    assert calls == [1, 2, 3, 4]                     # 4 predicted 1.5% past: tried (FILL_SLACK)
    calls.clear()
    assert pick_level(enc, 1, range(6), 175, True, True, lambda lo, hi: 1.0)[1:] == \
        (3, {"encodes": 4, "fill_misses": 1})       # an optimistic predictor: one miss
    calls.clear()
    assert pick_level(enc, 4, range(6), 130, True, True, step)[1] == 1 and calls == [4, 3, 2, 1]
    assert pick_level(enc, 1, range(6), 175, True, False, step)[1] == 1
    with pytest.raises(ValueError, match="level 0"):
        pick_level(enc, 2, range(6), 99, True, True, step)
    with pytest.raises(ValueError, match="level 2"):
        pick_level(enc, 2, range(6), 130, False, True, step)


def test_quality_rows_store_objects_through_the_serde():
    """bench.quality's rows lmcache-<codec>-<tokens>[-max|-r<ratio>] (bench/lmcache/rows.py):
    the bytes are the slots LMCache writes, the KV is the deserializer's, object by object."""
    from bench.lmcache import rows as lmcache_rows

    k, v = synthetic_kv(L, 2 * T + 16, H, D, seed=8)          # 3 objects: 64, 64, 16 tokens
    ratio = 2.0
    blob, st = lmcache_rows.encode_with_stats(k, v, f"lmcache-cachegen-{T}-r{ratio}")
    sizes = [math.floor(2 * L * n * H * D * 2 / ratio) for n in (T, T, 16)]
    assert [int(s.numel()) for s in blob.slots] == sizes and st["bytes"] == sum(sizes)
    assert st["frame_bytes"] <= st["bytes"] and sum(st["levels"].values()) == 3
    k2, v2 = lmcache_rows.decode(blob)
    for i, (a, b) in enumerate(blob.bounds):
        out = _obj(torch.zeros(2, L, b - a, H * D, dtype=k.dtype))
        blob.deserializer.deserialize(_obj(blob.slots[i]), out, lmcache_rows.object_key(i))
        assert torch.equal(out.tensor, _planes(k2[:, a:b], v2[:, a:b]))
    assert not torch.equal(k2, torch.zeros_like(k2))
    assert lmcache_rows.serde_options("lmcache-cachegen-256-max") == ("cachegen", 256,
                                                                      {"slot_ratio": False})
    assert lmcache_rows.serde_options("lmcache-cachegen-1024") == ("cachegen", 1024, {})
    assert lmcache_rows.is_row("lmcache-kvtc-256") and not lmcache_rows.is_row("lmcache-fp8")
    with pytest.raises(ValueError, match="no kvtc calibration"):
        lmcache_rows.encode_with_stats(k, v, "lmcache-kvtc-64")


@pytest.mark.parametrize("layout", ["-heads5", "-fused"])
def test_quality_rows_in_other_layouts(layout):
    """The rows' -heads5 / -fused objects are the layouts LMCache hands a serde; what the
    deserializer gives back, mapped back to K and V, is what comes out of decode."""
    from bench.lmcache import rows as lmcache_rows

    k, v = synthetic_kv(L, 2 * T, H, D, seed=9)
    x = lmcache_rows.to_layout(k, v, layout)
    assert x.shape == ((2, L, 2 * T, H, D) if layout == "-heads5" else (1, L, 2 * T, 2 * H * D))
    k0, v0 = lmcache_rows.from_layout(x, layout, H, D)
    assert torch.equal(k0, k) and torch.equal(v0, v)
    blob, st = lmcache_rows.encode_with_stats(k, v, f"lmcache-cachegen-{T}-r2{layout}")
    assert len(blob.slots) == 2 and st["bytes"] == sum(int(s.numel()) for s in blob.slots)
    k2, v2 = lmcache_rows.decode(blob)
    for i, (a, b) in enumerate(blob.bounds):
        obj = lmcache_rows.to_layout(k[:, a:b], v[:, a:b], layout)
        out = _obj(torch.zeros_like(obj))
        blob.deserializer.deserialize(_obj(blob.slots[i]), out, lmcache_rows.object_key(i))
        ko, vo = lmcache_rows.from_layout(out.tensor, layout, H, D)
        assert torch.equal(ko, k2[:, a:b]) and torch.equal(vo, v2[:, a:b])
    assert not torch.equal(k2, torch.zeros_like(k2))
    assert lmcache_rows.is_row(f"lmcache-cachegen-256{layout}")
    assert not lmcache_rows.is_row("lmcache-cachegen-256-fused-max")
