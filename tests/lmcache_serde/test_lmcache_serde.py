"""Our serdes ``cachegen`` and ``kvtc`` inside the real LMCache (lmcache 0.5.6).

Needs the optional environment (``bash scripts/setup.sh lmcache`` -> .venv-lmcache, which
CI runs this file with); in the main .venv (no lmcache) the module is skipped.
- the contract through LMCache's ``AsyncSerdeProcessor`` (its eventfds, its
  ``set_used_size``), for every KV layout and dtype LMCache hands a serde: the bytes
  decode to exactly what our codec's own path gives for the same K/V;
- LMCache's own fs L2 adapter wrapped by its ``SerdeL2AdapterWrapper`` (with its
  ``L1Manager`` for the temp buffers) storing and loading KV through our serdes, and its
  RESP adapter against a real redis-server the test starts;
- a corrupted object, one written for another key or another serde config, and one that
  does not fit its slot: a failed task / a miss, never an exception into LMCache.
Run: .venv-lmcache/bin/python -m pytest tests/lmcache_serde/test_lmcache_serde.py -q
"""
from __future__ import annotations

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
from lmcache.v1.distributed.serde import (  # noqa: E402
    AsyncSerdeProcessor, SerdeConfig, create_serde_processor, get_registered_serde_types)
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from third_party import lmcache as plugin  # noqa: E402
from third_party.lmcache import serde as S  # noqa: E402
from third_party.lmcache.frame import FRAME_MAGIC, parse_frame  # noqa: E402
from tests.helpers.kv import lmcache_planes, make_kv  # noqa: E402

L, T, H, D = 2, 64, 2, 16
LOOSE = 16.0        # bits/element slot for synthetic KV (the default table is for real KV)
SLOT = 6.0          # a slot smaller than bf16 for the adapter tests (cachegen-l1: ~3 here)


def _obj(t: torch.Tensor, shapes=None, dtypes=None) -> TensorMemoryObj:
    raw = t.contiguous().view(-1)
    return TensorMemoryObj(raw_data=raw, metadata=MemoryObjMetadata(
        shape=t.shape, dtype=t.dtype, address=-1, phy_size=raw.numel() * t.element_size(),
        ref_count=1, shapes=shapes or [t.shape], dtypes=dtypes or [t.dtype]),
        parent_allocator=None)


def _buf(n: int) -> TensorMemoryObj:
    return _obj(torch.full((n,), 0xAB, dtype=torch.uint8))


def _key(i: int, model: str = "smollm2") -> ObjectKey:
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name=model, kv_rank=0)


def _wait(fd: int) -> None:
    """Block on LMCache's completion eventfd (no polling sleeps)."""
    r, _, _ = select.select([fd], [], [], 120)
    assert r, "serde task did not signal its eventfd"
    os.read(fd, 8)


def _run(proc, kind: str, src, dst, keys):
    tid = getattr(proc, f"submit_{kind}")(src, dst, keys)
    while True:
        res = getattr(proc, f"query_{kind}_result")(tid)
        if res is not None:
            return res
        _wait(getattr(proc, f"get_{kind}_event_fd")())


def _planes(k, v):
    """LMCache MP layout [2, L, T, H*D] from our [L, T, H, D] K and V."""
    return torch.stack([k.reshape(*k.shape[:2], -1), v.reshape(*v.shape[:2], -1)])


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert set(plugin.register()) == {"cachegen", "kvtc"}
    assert plugin.register() == ["cachegen", "kvtc"]       # idempotent


@pytest.fixture(scope="module")
def cal_hash():
    k, v = synthetic_kv(L, 512, H, D, seed=99)
    cal = kvtc.fit_calibration(k.float(), v.float(), positions=torch.arange(512),
                               rope_theta=10000.0,
                               level_targets={0: 0.55, 1: 0.7, 2: 0.85, 3: 0.95, 4: 1.1,
                                              5: 1.85})
    return kvtc.register_calibration(cal)


def test_registered_next_to_lmcache_own():
    types = get_registered_serde_types()
    assert {"cachegen", "kvtc", "fp8"} <= set(types)
    proc = create_serde_processor(SerdeConfig(type="cachegen", kwargs={"level": 2}))
    assert isinstance(proc, AsyncSerdeProcessor)
    proc.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"levle": 1}, "unknown cachegen serde option"),
    ({"level": 9}, "level must be one of"),
    ({"chunk_tokens": 100}, "multiple of 16"),
    ({"pad": "yes"}, "'pad' must be"),
    ({"bits_per_element": 0}, "bits_per_element"),
    ({"calibration": "ab"}, "takes no calibration"),
    ({"sinks": "first"}, "'sinks' must be one of"),
    ({"sinks": True}, "'sinks' must be one of"),
])
def test_bad_cachegen_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_serde_processor(SerdeConfig(type="cachegen", kwargs=kwargs))


def test_kvtc_config_needs_a_reachable_calibration():
    with pytest.raises(ValueError, match="needs \"calibration\""):
        create_serde_processor(SerdeConfig(type="kvtc", kwargs={}))
    with pytest.raises(ValueError, match="not available"):
        create_serde_processor(SerdeConfig(type="kvtc", kwargs={"calibration": "0" * 64}))


def _layout_case(case: str):
    k, v = synthetic_kv(L, T, H, D, seed=3)
    if case == "2LTC-bf16":
        return _planes(k, v), k, v
    if case == "2LTC-fp16":
        k, v = k.half(), v.half()
        return _planes(k, v), k, v
    if case == "2LTC-fp32":
        k, v = k.float(), v.float()
        return _planes(k, v), k, v
    if case == "2LTHD":
        return torch.stack([k, v]), k, v
    if case == "MLA":     # one plane [L, T, C]: halves coded as K and V
        plane = k.reshape(L, T, H * D)
        return plane, plane[..., : H * D // 2].unsqueeze(2), plane[..., H * D // 2:].unsqueeze(2)
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["2LTC-bf16", "2LTC-fp16", "2LTC-fp32", "2LTHD", "MLA"])
def test_contract_through_async_processor(case):
    """serialize -> bytes -> deserialize through LMCache's AsyncSerdeProcessor: the KV
    comes back exactly as our codec decodes its own bitstream of the same K/V; the stored
    length (set_used_size) is the slot; padding leaves no stale bytes."""
    x, k, v = _layout_case(case)
    kw = {"level": 2, "bits_per_element": LOOSE, "pad": True}
    if case.startswith("2LTC"):
        kw["num_kv_heads"] = H
    ser, de = S.make_pair("cachegen", kw)
    proc = AsyncSerdeProcessor(ser, de)
    try:
        layout = MemoryLayoutDesc(shapes=[x.shape], dtypes=[x.dtype])
        slot = proc.estimate_serialized_size(layout)
        src, tmp = _obj(x.clone()), _buf(slot)
        assert _run(proc, "serialize", [src], [tmp], [_key(1)]) is True
        assert tmp.get_size() == slot                         # padded to the slot
        n = ser.stats["bytes"]
        assert 0 < n <= slot and bool((tmp.tensor[n:] == 0).all())
        out = _obj(torch.zeros_like(x))
        assert _run(proc, "deserialize", [tmp], [out], [_key(1)]) is True
        k2, v2 = codec.decode_kv(codec.encode_kv(k.contiguous(), v.contiguous(),
                                                 codec="cachegen", level=2))
        got = out.tensor
        if case == "MLA":
            assert torch.equal(got[..., : H * D // 2], k2.squeeze(2))
            assert torch.equal(got[..., H * D // 2:], v2.squeeze(2))
        elif case == "2LTHD":
            assert torch.equal(got[0], k2) and torch.equal(got[1], v2)
        else:
            assert torch.equal(got, _planes(k2, v2))
        assert got.dtype == x.dtype and not torch.equal(got, torch.zeros_like(x))
    finally:
        proc.close()


def test_unpadded_mode_stores_the_actual_length():
    x, k, v = _layout_case("2LTC-bf16")
    ser, de = S.make_pair("cachegen", {"bits_per_element": LOOSE, "pad": False,
                                       "chunk_tokens": 32})
    proc = AsyncSerdeProcessor(ser, de)
    try:
        slot = proc.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
        tmp = _buf(slot)
        assert _run(proc, "serialize", [_obj(x)], [tmp], [_key(2)]) is True
        assert tmp.get_size() == ser.stats["bytes"] < slot    # narrowed by LMCache
        out = _obj(torch.zeros_like(x))
        assert _run(proc, "deserialize", [tmp], [out], [_key(2)]) is True
        # no num_kv_heads: the serde codes each plane as one head of H*D channels
        k1, v1 = k.reshape(L, T, 1, H * D), v.reshape(L, T, 1, H * D)
        k2, v2 = codec.decode_chunks(codec.encode_chunks(k1, v1, codec="cachegen",
                                                         chunk_tokens=32))
        assert torch.equal(out.tensor, _planes(k2, v2))
    finally:
        proc.close()


def test_multi_group_object():
    """An object with two kernel groups (two shapes in one MemoryObj)."""
    k, v = synthetic_kv(L, T, H, D, seed=4)
    a, b = _planes(k, v), _planes(k[:, :32], v[:, :32]).half()
    raw = torch.cat([a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)])
    src = TensorMemoryObj(raw_data=raw, metadata=MemoryObjMetadata(
        shape=torch.Size([raw.numel()]), dtype=torch.uint8, address=-1, phy_size=raw.numel(),
        ref_count=1, shapes=[a.shape, b.shape], dtypes=[a.dtype, b.dtype]),
        parent_allocator=None)
    ser, de = S.make_pair("cachegen", {"bits_per_element": LOOSE})
    slot = ser.estimate_serialized_size(MemoryLayoutDesc([a.shape, b.shape], [a.dtype, b.dtype]))
    tmp = _buf(slot)
    ser.serialize(src, tmp, _key(3))
    raw2 = torch.zeros_like(raw)
    dst = TensorMemoryObj(raw_data=raw2, metadata=src.meta.__class__(
        shape=src.meta.shape, dtype=torch.uint8, address=-1, phy_size=raw.numel(),
        ref_count=1, shapes=[a.shape, b.shape], dtypes=[a.dtype, b.dtype]),
        parent_allocator=None)
    de.deserialize(tmp, dst, _key(3))
    ka, va = codec.decode_kv(codec.encode_kv(k.reshape(L, T, 1, -1), v.reshape(L, T, 1, -1)))
    assert torch.equal(dst.get_tensor(0), _planes(ka, va))
    kb, vb = codec.decode_kv(codec.encode_kv(b[0].unsqueeze(2), b[1].unsqueeze(2)))
    assert torch.equal(dst.get_tensor(1), torch.stack([kb.squeeze(2), vb.squeeze(2)]))


def test_kvtc_round_trip_is_our_codec(cal_hash):
    k, v = synthetic_kv(L, T, H, D, seed=5)
    x = _planes(k, v)
    proc = create_serde_processor(SerdeConfig(type="kvtc", kwargs={
        "calibration": cal_hash, "level": 3, "bits_per_element": LOOSE}))
    try:
        slot = proc.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
        tmp, out = _buf(slot), _obj(torch.zeros_like(x))
        assert _run(proc, "serialize", [_obj(x)], [tmp], [_key(4)]) is True
        assert _run(proc, "deserialize", [tmp], [out], [_key(4)]) is True
        cfg = kvtc.KvtcConfig(calibration=cal_hash, level=3)
        k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="kvtc", config=cfg))
        assert torch.equal(out.tensor, _planes(k2, v2))
        # a layout the calibration does not describe: stored verbatim (its exact size)
        y = lmcache_planes(*make_kv(L + 1, T, H, D))
        slot = proc.estimate_serialized_size(MemoryLayoutDesc([y.shape], [y.dtype]))
        assert y.numel() * 2 < slot < y.numel() * 2 + 1024
        tmp, out = _buf(slot), _obj(torch.zeros_like(y))
        assert _run(proc, "serialize", [_obj(y)], [tmp], [_key(5)]) is True
        assert _run(proc, "deserialize", [tmp], [out], [_key(5)]) is True
        assert torch.equal(out.tensor, y)
    finally:
        proc.close()


def _stored(level=2, bpe=LOOSE, key=1):
    x, _, _ = _layout_case("2LTC-bf16")
    ser, de = S.make_pair("cachegen", {"level": level, "bits_per_element": bpe})
    slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    tmp = _buf(slot)
    ser.serialize(_obj(x), tmp, _key(key))
    return x, ser, de, tmp


def test_corrupt_other_key_other_config_are_failed_tasks():
    x, ser, de, tmp = _stored()
    proc = AsyncSerdeProcessor(ser, de)
    try:
        out = _obj(torch.zeros_like(x))
        assert _run(proc, "deserialize", [tmp], [out], [_key(2)]) is False       # other key
        other = AsyncSerdeProcessor(*S.make_pair("cachegen", {"level": 3,
                                                             "bits_per_element": LOOSE}))
        assert _run(other, "deserialize", [tmp], [out], [_key(1)]) is False      # other config
        other.close()
        for pos in (2, 40, ser.stats["bytes"] // 2, ser.stats["bytes"] - 3):
            bad = _obj(tmp.tensor.clone())
            bad.tensor[pos] ^= 0x10
            assert _run(proc, "deserialize", [bad], [out], [_key(1)]) is False
        assert _run(proc, "deserialize", [_obj(tmp.tensor[:100].clone())], [out],
                    [_key(1)]) is False                                          # truncated
        assert _run(proc, "deserialize", [tmp], [out], [_key(1)]) is True
    finally:
        proc.close()


def test_slot_too_small_falls_back_then_fails():
    x, _, _ = _layout_case("2LTC-bf16")
    ser, _ = S.make_pair("cachegen", {"level": 5, "bits_per_element": LOOSE})
    need = ser.stats
    ser.serialize(_obj(x), _buf(1 << 20), _key(1))
    bpe_l5 = 8 * need["bytes"] / x.numel()
    ser2, de2 = S.make_pair("cachegen", {"level": 5, "bits_per_element": bpe_l5 * 0.8})
    slot = ser2.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    tmp = _buf(slot)
    assert ser2.serialize(_obj(x), tmp, _key(1)) == slot
    assert ser2.stats["fallbacks"] == 1 and ser2.stats["bytes"] <= slot
    out = _obj(torch.zeros_like(x))
    de2.deserialize(tmp, out, _key(1))
    assert codec.peek_header(bytes(parse_frame(memoryview(tmp.tensor.numpy()))[1][0]))[
        "level"] < 5
    # a bound no level fits: with always_fit off, refused (a failed task, counted)
    ser3, de3 = S.make_pair("cachegen", {"bits_per_element": 0.01, "always_fit": False})
    proc = AsyncSerdeProcessor(ser3, de3)
    slot = proc.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    assert _run(proc, "serialize", [_obj(x)], [_buf(slot)], [_key(1)]) is False
    assert ser3.stats["refused"] == 1 and ser3.stats["objects"] == 0
    proc.close()
    # cachegen's default (always_fit): the slot grows to what a floor step needs; stored
    ser4, de4 = S.make_pair("cachegen", {"bits_per_element": 0.01})
    proc = AsyncSerdeProcessor(ser4, de4)
    slot = proc.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    tmp, out = _buf(slot), _obj(torch.zeros_like(x))
    assert _run(proc, "serialize", [_obj(x)], [tmp], [_key(1)]) is True
    assert _run(proc, "deserialize", [tmp], [out], [_key(1)]) is True
    assert ser4.stats["floor"] + ser4.stats["raw"] == 1 == ser4.stats["coarser"]
    assert ser4.stats["refused"] == 0 and slot < x.numel() * x.element_size()
    assert S.serializer_stats() and any(st["floor"] + st["raw"] >= 1 for st in S.serializer_stats())
    proc.close()


def test_estimate_never_raises():
    ser, _ = S.make_pair("cachegen", {})
    for layout in (MemoryLayoutDesc([torch.Size([7])], [torch.uint8]),
                   MemoryLayoutDesc([torch.Size([2, 3, 4, 5, 6, 7])], [torch.bfloat16]),
                   MemoryLayoutDesc([], [])):
        assert ser.estimate_serialized_size(layout) >= 1


# ------------------------------------------------------------------------ L2 adapters
def _l1() -> L1Manager:
    return L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(
        size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=64 << 20)))


def _reserve(l1: L1Manager, key: ObjectKey, x: torch.Tensor):
    from lmcache.v1.distributed.error import L1Error

    res = l1.reserve_write([key], [False], MemoryLayoutDesc([x.shape], [x.dtype]))
    err, obj = res[key]
    assert err == L1Error.SUCCESS
    return obj


def _store_load(adapter, x: torch.Tensor, keys, corrupt=None):
    """Store ``x`` under keys[0] through the wrapper, optionally corrupt it in the
    backend, then load keys into fresh L1 objects: (load bitmap bits, loaded tensors)."""
    l1 = _l1()
    proc = create_serde_processor(SerdeConfig(type="cachegen", kwargs={
        "level": 1, "bits_per_element": SLOT, "num_kv_heads": H}))
    w = SerdeL2AdapterWrapper(adapter, proc, l1)
    try:
        src = _reserve(l1, _key(900), x)
        src.tensor.copy_(x)
        tid = w.submit_store_task([keys[0]], [src])
        while tid not in (done := w.pop_completed_store_tasks()):
            _wait(w.get_store_event_fd())
        assert done[tid].is_successful()
        if corrupt:
            corrupt()
        outs = [_reserve(l1, _key(901 + i), x) for i in range(len(keys))]
        for o in outs:
            o.tensor.zero_()
        tid = w.submit_load_task(list(keys), outs)
        while (bits := w.query_load_result(tid)) is None:
            _wait(w.get_load_event_fd())
        return [bits.test(i) for i in range(len(keys))], [o.tensor.clone() for o in outs]
    finally:
        w.close()


def _expected(x):
    k, v = x[0].reshape(L, T, H, D), x[1].reshape(L, T, H, D)
    k2, v2 = codec.decode_kv(codec.encode_kv(k, v, codec="cachegen", level=1))
    return _planes(k2, v2)


def test_fs_adapter_through_serde_wrapper(tmp_path: Path):
    x, _, _ = _layout_case("2LTC-bf16")
    bits, outs = _store_load(FSL2Adapter(FSL2AdapterConfig(base_path=str(tmp_path))), x,
                             [_key(10), _key(11)])
    assert bits == [True, False]                       # stored key hit, unknown key miss
    assert torch.equal(outs[0], _expected(x))
    files = list(tmp_path.glob("*.data"))
    assert len(files) == 1
    ser, _ = S.make_pair("cachegen", {"level": 1, "bits_per_element": SLOT, "num_kv_heads": H})
    assert files[0].stat().st_size == ser.estimate_serialized_size(
        MemoryLayoutDesc([x.shape], [x.dtype])) < x.numel() * 2
    assert files[0].read_bytes()[:4] == FRAME_MAGIC


def test_fs_corrupted_object_is_a_miss(tmp_path: Path):
    x, _, _ = _layout_case("2LTC-bf16")

    def flip():
        f = next(tmp_path.glob("*.data"))
        b = bytearray(f.read_bytes())
        b[len(b) // 3] ^= 0x01
        f.write_bytes(bytes(b))

    bits, outs = _store_load(FSL2Adapter(FSL2AdapterConfig(base_path=str(tmp_path))), x,
                             [_key(12)], corrupt=flip)
    assert bits == [False]


@pytest.fixture(scope="module")
def redis_srv():
    from streaming.store.redis_server import RedisServer, find_redis_server

    if find_redis_server() is None:
        pytest.skip("redis-server not installed (bash scripts/setup.sh installs it)")
    with RedisServer() as srv:
        yield srv


def _resp(srv):
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import (
        RESPL2AdapterConfig, _create_resp_l2_adapter)

    return _create_resp_l2_adapter(RESPL2AdapterConfig(host=srv.host, port=srv.port,
                                                       num_workers=2))


def test_resp_adapter_against_real_redis(redis_srv):
    import redis

    r = redis.Redis(host=redis_srv.host, port=redis_srv.port)
    r.flushdb()
    x, _, _ = _layout_case("2LTC-bf16")
    # only stored keys are loaded (LMCache looks keys up first; 0.5.6's native RESP
    # client closes its connection on a GET of an absent key and the load never ends)
    bits, outs = _store_load(_resp(redis_srv), x, [_key(20)])
    assert bits == [True]
    assert torch.equal(outs[0], _expected(x))
    keys = r.keys("*")
    assert len(keys) == 1
    val = r.get(keys[0])
    assert FRAME_MAGIC in val[:64] and len(val) < x.numel() * 2


def test_resp_corrupted_object_is_a_miss(redis_srv):
    import redis

    r = redis.Redis(host=redis_srv.host, port=redis_srv.port)
    r.flushdb()
    x, _, _ = _layout_case("2LTC-bf16")

    def flip():
        (key,) = r.keys("*")
        b = bytearray(r.get(key))
        b[len(b) // 2] ^= 0x04
        r.set(key, bytes(b))

    bits, _ = _store_load(_resp(redis_srv), x, [_key(22)], corrupt=flip)
    assert bits == [False]


# ------------------------------------------- LMCache's own serde test properties, on ours
# The checks LMCache's tests/v1/distributed/serde/ make of its CPU serdes
# (test_async_processor.py: distinct fds, results True once then None, a failing task
# reports False and still signals, estimate delegated; test_fp8.py: duck-typed objects with
# only ``.tensor``, multi-group estimates, round-trip correlation > 0.99, a missing tensor
# is a ValueError), asserted here of our serdes (their files are not in the wheel).
class _Fake:
    def __init__(self, tensor):
        self.tensor = tensor


def test_processor_contract_as_lmcache_tests_it():
    ser, de = S.make_pair("cachegen", {"bits_per_element": LOOSE})
    proc = AsyncSerdeProcessor(ser, de)
    try:
        assert proc.get_serialize_event_fd() != proc.get_deserialize_event_fd()
        assert proc.query_serialize_result(42) is None and proc.query_deserialize_result(42) is None
        x, _, _ = _layout_case("2LTC-bf16")
        lay = MemoryLayoutDesc([x.shape], [x.dtype])
        assert proc.estimate_serialized_size(lay) == ser.estimate_serialized_size(lay)
        tmp = _Fake(torch.zeros(ser.estimate_serialized_size(lay), dtype=torch.uint8))
        tid = proc.submit_serialize([_Fake(x), _Fake(x)], [tmp, _Fake(tmp.tensor.clone())],
                                    [_key(1), _key(1)])
        _wait(proc.get_serialize_event_fd())
        assert proc.query_serialize_result(tid) is True
        assert proc.query_serialize_result(tid) is None            # not idempotent
        tid = proc.submit_deserialize([_Fake(torch.zeros(64, dtype=torch.uint8))],
                                      [_Fake(torch.zeros_like(x))], [_key(1)])
        _wait(proc.get_deserialize_event_fd())                     # failure still signals
        assert proc.query_deserialize_result(tid) is False
    finally:
        proc.close()


def test_duck_typed_round_trip_and_estimates():
    shape = torch.Size([2, 4, 64, 128])
    x = lmcache_planes(*make_kv(4, 64, 2, 64))
    ser, de = S.make_pair("cachegen", {"level": 5, "bits_per_element": LOOSE})
    one = ser.estimate_serialized_size(MemoryLayoutDesc([shape], [torch.bfloat16]))
    two = ser.estimate_serialized_size(MemoryLayoutDesc([shape, torch.Size([2, 4, 16, 128])],
                                                        [torch.bfloat16, torch.float16]))
    assert two > one > 0
    tmp = _Fake(torch.zeros(one, dtype=torch.uint8))
    assert ser.serialize(_Fake(x.clone()), tmp, _key(1)) == one
    got = _Fake(torch.zeros(shape, dtype=torch.bfloat16))
    de.deserialize(tmp, got, _key(1))
    corr = torch.corrcoef(torch.stack([got.tensor.float().flatten(), x.float().flatten()]))[0, 1]
    assert corr > 0.99
    with pytest.raises(ValueError):
        ser.serialize(_Fake(None), _Fake(torch.zeros(4, dtype=torch.uint8)), _key(1))
    with pytest.raises(ValueError):
        de.deserialize(_Fake(torch.zeros(4, dtype=torch.uint8)), _Fake(None), _key(1))


def test_lmcache_fp8_row_is_our_fp8():
    """The bench rows' fairness: LMCache's fp8 serde (bench/lmcache/peers.py) gives 2.00x
    and exactly the values our fp8 codec gives on in-range KV."""
    from bench.lmcache import peers as lmcache_peers

    k, v = synthetic_kv(L, T, H, D, seed=6)
    blob, st = lmcache_peers.encode_with_stats(k, v, "lmcache-fp8")
    assert st["dtype_bytes"] / st["bytes"] == 2.0
    k2, v2 = lmcache_peers.decode(blob)
    k3, v3 = codec.decode_kv(codec.encode_kv(k, v, codec="fp8"))
    assert torch.equal(k2, k3) and torch.equal(v2, v3)
    blob, st = lmcache_peers.encode_with_stats(k, v, "lmcache-asym_k16_v8")
    k4, v4 = lmcache_peers.decode(blob)
    assert torch.equal(k4, k) and not torch.equal(v4, v)        # K kept, V to fp8


# ---- exact sink tokens only in the object that starts a context (position) ----------
def _context_objects(k, v, n: int):
    """A context split into LMCache objects of n tokens, layout [2, L, n, H*D]."""
    return [_planes(k[:, a:a + n], v[:, a:a + n]) for a in range(0, k.shape[1], n)]


def _store_all(ser, de, xs):
    """Serialize then deserialize each object; returns (decoded objects, bytes written)."""
    outs, total = [], 0
    for i, x in enumerate(xs):
        slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
        tmp, out = _buf(slot), _obj(torch.zeros_like(x))
        n = ser.serialize(_obj(x), tmp, _key(100 + i))
        total += n
        de.deserialize(_obj(tmp.tensor[:n].clone()), out, _key(100 + i))   # what L2 holds
        outs.append(out.tensor.clone())
    return outs, total


@pytest.mark.parametrize("level", [1, 3])
def test_auto_sinks_give_our_store_paths_chunks(level):
    """A 256-token context (its first token's values short, as an attention sink's are) in
    4 objects of 64: only object 0 keeps exact sink tokens, and the KV LMCache gets back
    is bit for bit what our store path gives for the same 64-token chunks
    (codec.encode_chunks, sinks in chunk 0 only); "every_object" keeps them in all 4 and
    writes more bytes."""
    k, v = synthetic_kv(L, 256, H, D, seed=11)
    xs = _context_objects(k, v, 64)
    ser, de = S.make_pair("cachegen", {"level": level, "bits_per_element": LOOSE, "pad": False,
                                       "num_kv_heads": H})
    outs, auto_bytes = _store_all(ser, de, xs)
    assert (ser.stats["sink_groups"], ser.stats["no_sink_groups"]) == (1, 3)
    k2, v2 = codec.decode_chunks(codec.encode_chunks(k, v, codec="cachegen", level=level,
                                                     chunk_tokens=64))
    assert all(torch.equal(o, e) for o, e in zip(outs, _context_objects(k2, v2, 64)))
    ser2, de2 = S.make_pair("cachegen", {"level": level, "bits_per_element": LOOSE,
                                         "pad": False, "num_kv_heads": H,
                                         "sinks": "every_object"})
    outs2, every_bytes = _store_all(ser2, de2, xs)
    assert (ser2.stats["sink_groups"], ser2.stats["no_sink_groups"]) == (4, 0)
    assert torch.equal(outs2[0], outs[0]) and not torch.equal(outs2[1], outs[1])
    sink_bytes = 4 * 2 * L * H * D * 2                       # 4 exact bf16 tokens, K and V
    assert every_bytes - auto_bytes >= 3 * sink_bytes * 0.9
    assert ser.settings.identity() != ser2.settings.identity()   # readers must agree


def test_auto_sinks_kvtc_at_estimated_positions(cal_hash):
    """kvtc (pre-RoPE calibration): the objects after the first are coded without sinks at
    the position their keys' RoPE phase gives (position), so LMCache gets back bit for
    bit what our store path gives for the same 64-token chunks; with position_step 0 every
    object is coded at position 0 (more bytes); "every_object" keeps sinks everywhere."""
    k, v = synthetic_kv(L, 512, H, D, seed=99)     # the calibration's KV: its mean keys
    k, v = k[:, :256].contiguous(), v[:, :256].contiguous()
    xs = _context_objects(k, v, 64)
    kw = {"calibration": cal_hash, "level": 3, "bits_per_element": LOOSE, "pad": False,
          "position_step": 64, "max_tokens": 1024}
    ser, de = S.make_pair("kvtc", kw)
    outs, auto_bytes = _store_all(ser, de, xs)
    assert (ser.stats["sink_groups"], ser.stats["no_sink_groups"]) == (1, 3)
    assert ser.stats["offsets"] == {0: 1, 64: 1, 128: 1, 192: 1}
    cfg = kvtc.KvtcConfig(calibration=cal_hash, level=3)
    k2, v2 = codec.decode_chunks(codec.encode_chunks(k, v, codec="kvtc", config=cfg,
                                                     chunk_tokens=64))
    assert all(torch.equal(o, e) for o, e in zip(outs, _context_objects(k2, v2, 64)))
    ser0, de0 = S.make_pair("kvtc", dict(kw, position_step=0))
    outs0, zero_bytes = _store_all(ser0, de0, xs)
    assert ser0.stats["offsets"] == {0: 4} and ser0.stats["sink_groups"] == 1
    cfg0 = kvtc.KvtcConfig(calibration=cal_hash, level=3, sink_tokens=0)
    k1, v1 = codec.decode_kv(codec.encode_kv(k[:, 64:128], v[:, 64:128], codec="kvtc",
                                             config=cfg0))
    assert torch.equal(outs0[1], _planes(k1, v1))
    ser2, de2 = S.make_pair("kvtc", dict(kw, sinks="every_object"))
    outs2, every_bytes = _store_all(ser2, de2, xs)
    assert ser2.stats["sink_groups"] == 4 and ser2.stats["offsets"] == {0: 4}
    assert every_bytes > zero_bytes and torch.equal(outs[0], outs2[0])
    assert len({x.settings.identity() for x in (ser, ser0, ser2)}) == 3


def test_position_estimate_and_its_edges(cal_hash):
    from third_party.lmcache.position import estimate_offset

    cal = kvtc.get_calibration(cal_hash)
    k, _ = synthetic_kv(L, 512, H, D, seed=99)     # keys whose mean the calibration holds
    for a in (0, 128, 256, 384):
        assert estimate_offset(k[:, a:a + 128], cal, 128, 4096) == a
    assert estimate_offset(k[:, 256:384], cal, 128, 256) in (0, 128)   # 256 not a candidate
    with pytest.raises(ValueError, match="do not match the calibration"):
        estimate_offset(k[:, :64, :1], cal, 64, 1024)


@pytest.mark.parametrize("kwargs, match", [
    ({"position_step": 100}, "multiple of 16"),
    ({"position_step": -16}, "integer >= 0"),
    ({"max_tokens": 8}, "integer >= 16"),
])
def test_bad_position_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        create_serde_processor(SerdeConfig(type="cachegen", kwargs=kwargs))


def test_starts_context_rule_and_its_edges():
    from third_party.lmcache.position import MIN_TOKENS, starts_context

    v = make_kv(3, 64, 2, 16, dtype=torch.float32, k_shift=0.5)[0]      # one V-like tensor
    assert starts_context(v) is False
    v0 = v.clone()
    v0[:, 0] *= 0.3
    assert starts_context(v0) is True
    v1 = v.clone()
    v1[:, 0] *= 0.7                                      # short, but not a sink's 0.27-0.30
    assert starts_context(v1) is False
    assert starts_context(v[:, : MIN_TOKENS - 1]) is True          # too short to judge: keep
    assert starts_context(torch.zeros(3, 64, 2, 16)) is True       # no scale: keep
    assert starts_context(v.to(torch.bfloat16)) is False
    with pytest.raises(ValueError, match=r"\[L, T, H, D\]"):
        starts_context(v[0])


def test_starts_context_on_the_default_models_kv():
    """On a real 1024-token context of the default model, only the chunk at token 0 of the
    four 256-token chunks starts a context by the rule."""
    from third_party.lmcache.position import starts_context

    try:
        from kv_extraction_hf.extract import prefill_kv
        from kv_extraction_hf.model import load_model
        bundle = load_model(log=lambda m: None)
    except Exception as exc:                                   # noqa: BLE001
        pytest.skip(f"default model unavailable: {exc}")
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
    ids = bundle.tokenizer(text, return_tensors="pt").input_ids[:, :1024]
    assert ids.shape[1] == 1024
    _, v = prefill_kv(bundle, ids)
    assert [starts_context(v[:, a:a + 256]) for a in range(0, 1024, 256)] == \
        [True, False, False, False]
