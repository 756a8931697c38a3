"""LMCache's end-to-end serde flow through its own StorageManager, with our serdes (on CPU).

Modelled on LMCache's e2e serde tests: objects written into L1, stored to L2 through the
serde (serialize), L1 cleared, prefetched back (deserialize), read, released, and L1 back
to 0 bytes; the layouts are LMCache's generic ones plus the MP server's KV layouts
(bench/lmcache_e2e.py lists them). Every object is stored and prefetched: KV layouts are
coded, with a fallback ladder below the configured level (floor steps, then raw) that is
counted and logged; other layouts are stored verbatim. What comes back is bit for bit what
our serde's own serialize -> deserialize gives for the same object, and a verbatim group
is the input itself. Also: a gap in L2 trims the prefix, repeated cycles leak no L1, a
prefetch of nothing is 0 hits, and the kvtc serde.
Run: .venv-lmcache/bin/python -m pytest tests/lmcache_serde/test_lmcache_e2e.py -q
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("lmcache", reason="lmcache not installed: bash scripts/setup.sh lmcache")

from bench import lmcache_e2e as E  # noqa: E402
from bench.codec.contexts import synthetic_kv  # noqa: E402
from codec import kvtc  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from third_party.lmcache import serde as S  # noqa: E402

L = 4
CASES = E.cases(L=L)
VERBATIM = {"large [256,4,2,2048]", "one element [1]", "odd [7,13,3]"}


def _multi_obj(tensors: list[torch.Tensor]) -> TensorMemoryObj:
    """One MemoryObj over the groups' bytes, one kernel group per tensor (as LMCache's
    L1 makes them: one group, its own shape and dtype; several, a byte buffer)."""
    if len(tensors) == 1:
        t = tensors[0].contiguous()
        return TensorMemoryObj(raw_data=t.view(-1), metadata=MemoryObjMetadata(
            shape=t.shape, dtype=t.dtype, address=-1, phy_size=t.numel() * t.element_size(),
            ref_count=1, shapes=[t.shape], dtypes=[t.dtype]), parent_allocator=None)
    raw = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
    return TensorMemoryObj(raw_data=raw, metadata=MemoryObjMetadata(
        shape=torch.Size([raw.numel()]), dtype=torch.uint8, address=-1, phy_size=raw.numel(),
        ref_count=1, shapes=[t.shape for t in tensors], dtypes=[t.dtype for t in tensors]),
        parent_allocator=None)


def _direct(case: E.Case, i: int, name: str = "cachegen", kw=None) -> list[torch.Tensor]:
    """Our serde's own serialize -> deserialize of key i's object (no LMCache around)."""
    ser, de = S.make_pair(name, kw or {})
    groups = [case.fill(i, g, sh, dt) for g, (sh, dt) in enumerate(zip(case.shapes, case.dtypes))]
    slot = ser.estimate_serialized_size(case.layout())
    buf = TensorMemoryObj(raw_data=torch.zeros(slot, dtype=torch.uint8), metadata=MemoryObjMetadata(
        shape=torch.Size([slot]), dtype=torch.uint8, address=-1, phy_size=slot, ref_count=1,
        shapes=[torch.Size([slot])], dtypes=[torch.uint8]), parent_allocator=None)
    key = E.keys_for([i])[0]
    assert ser.serialize(_multi_obj(groups), buf, key) == slot
    out = _multi_obj([torch.zeros_like(t) for t in groups])
    de.deserialize(buf, out, key)
    return [out.get_tensor(g).clone() for g in range(len(groups))]


@pytest.mark.parametrize("name", list(CASES))
def test_every_layout_is_stored_and_prefetched(name, caplog):
    case = CASES[name]
    with caplog.at_level(logging.WARNING, logger="third_party.lmcache.serde"):
        r = E.round_trip(case, "cachegen", {}, detail=True)
    assert r["stored"] == case.keys and r["hits"] == case.keys, r
    assert r["refused"] == 0 and r["objects"] == case.keys
    assert r["l1_drained"] and r["l1_bytes_left"] == 0            # no temp buffer leaked
    for i, got in enumerate(r["got"]):
        want = _direct(case, i)
        for g, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert torch.equal(a, b), (name, i, g)
        if name in VERBATIM:
            assert all(torch.equal(a, b) for a, b in zip(got, E.expected(case, [i])[0]))
    if name in VERBATIM or name.startswith("three groups"):
        assert any("stored verbatim" in m for m in caplog.messages)
    below = r["floor"] + r["raw"] + r["coarser"]
    if below:       # every fallback below the configured level is logged
        assert any("did not fit its slot" in m for m in caplog.messages)
    assert r["ratio"] > 0 and r["rel_l2"] < 1.0


def test_fallbacks_are_counted_and_logged(caplog):
    """Gaussian KV does not fit the 8x slot at any level: it is stored at a floor step,
    counted (stats ``floor``, ``coarser``) and logged once; 1-token objects too."""
    with caplog.at_level(logging.WARNING, logger="third_party.lmcache.serde"):
        r = E.round_trip(CASES["gaussian [2,L,T,C]"])
        one = E.round_trip(CASES["1 token"])
    assert r["hits"] == 3 and r["floor"] == 3 and r["coarser"] == 3 and r["ratio"] >= 7.99
    assert set(r["levels"]) <= {"floor-8", "floor-6", "floor-4"}
    assert one["hits"] == 3 and one["floor"] + one["raw"] == 3
    fits = [m for m in caplog.messages if "did not fit its slot" in m]
    assert len([m for m in fits if "[2, 4, 256, 192]" in m]) == 1      # once per layout, step
    assert any("[2, 4, 1, 192]" in m for m in fits)


def test_fixed_slot_of_real_layouts_is_unchanged():
    """The slot guarantee does not grow the 8x slot of a normal KV object."""
    ser, _ = S.make_pair("cachegen", {})
    for T in (256, 1024):
        lay = MemoryLayoutDesc([torch.Size([2, 30, T, 192])], [torch.bfloat16])
        assert ser.estimate_serialized_size(lay) == 2 * 30 * T * 192 * 2 // 8


def test_partial_prefix():
    """L2 holds keys 0, 1, 3, 4 but not 2: a prefetch of 0-4 hits the prefix 0, 1."""
    case = CASES["kv [2,L,T,C] bf16"]
    sm = E.storage_manager(SerdeConfig(type="cachegen"))
    try:
        assert E.write(sm, case, [0, 1, 3, 4]) == 4
        assert E.clear_l1(sm)
        assert E.prefetch(sm, case, range(5)) == 2
        got = E.read(sm, case, [0, 1])
        assert all(torch.equal(got[i][0], _direct(case, i)[0]) for i in (0, 1))
        assert E.wait_until(lambda: E.l1_bytes(sm) == 0)
    finally:
        sm.close()


def test_repeated_cycles_and_no_hits():
    case = CASES["fused [1,L,T,2C]"]
    sm = E.storage_manager(SerdeConfig(type="cachegen"))
    try:
        assert E.prefetch(sm, case, [100, 101]) == 0                # nothing in L2
        assert E.wait_until(lambda: E.l1_bytes(sm) == 0)
        for cycle in range(3):
            ids = [10 * cycle + j for j in range(3)]
            assert E.write(sm, case, ids) == 3
            assert E.clear_l1(sm)
            assert E.prefetch(sm, case, ids) == 3
            assert E.read(sm, case, ids) is not None
            assert E.wait_until(lambda: E.l1_bytes(sm) == 0), f"cycle {cycle}: L1 leak"
    finally:
        sm.close()


@pytest.fixture(scope="module")
def cal_hash():
    with torch.random.fork_rng():
        torch.manual_seed(7)
        k, v = synthetic_kv(L, 512, 3, 64, seed=7)
    cal = kvtc.fit_calibration(k.float(), v.float(), positions=torch.arange(512),
                               rope_theta=10000.0,
                               level_targets={0: 0.55, 1: 0.7, 2: 0.85, 3: 0.95, 4: 1.1,
                                              5: 1.85})
    return kvtc.register_calibration(cal)


@pytest.mark.parametrize("name", ["kv [2,L,T,C] bf16", "two groups bf16+fp16",
                                  "generic-bf16 [100,2,512]", "three groups [1,2,4,8]+[4,4]+[8]"])
def test_kvtc_serde_flow(name, cal_hash):
    """kvtc codes the layouts its calibration describes; the rest (one plane, generic) are
    stored verbatim at their exact size: every object stored and prefetched."""
    case = CASES[name]
    kw = {"calibration": cal_hash}
    r = E.round_trip(case, "kvtc", kw, detail=True)
    assert r["stored"] == r["hits"] == case.keys and r["l1_bytes_left"] == 0, r
    for i, got in enumerate(r["got"]):
        assert all(torch.equal(a, b) for a, b in zip(got, _direct(case, i, "kvtc", kw)))
    if name.startswith("generic") or name.startswith("three"):
        assert r["verbatim_groups"] >= case.keys and r["rel_l2"] == 0.0
    else:
        assert r["verbatim_groups"] == 0 and r["ratio"] > 8
