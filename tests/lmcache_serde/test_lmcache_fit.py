"""Every object fits a step of the ladder (third_party/lmcache/slot.py) with
``always_fit``, whatever its layout, size or values: the kind of LMCache objects that were
never stored (tiny ones, incompressible ones, generic layouts, several kernel groups),
checked with shapes and value distributions beyond the ones of the e2e flow.

For each object: serialize does not raise, writes exactly the slot, and deserialize gives
back what the step it was coded at decodes to (a verbatim group: the input bit for bit;
a coded one: finite, the right shape and dtype, and the codec's own decode of the
container); the counters add up. Objects with NaN/inf are refused with a one-line
reason. Run: .venv-lmcache/bin/python -m pytest tests/lmcache_serde/test_lmcache_fit.py -q
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("lmcache", reason="lmcache not installed: bash scripts/setup.sh lmcache")

import codec  # noqa: E402
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from third_party.lmcache import serde as S  # noqa: E402
from third_party.lmcache.frame import is_raw, parse_frame  # noqa: E402
from third_party.lmcache.layout import kv_views  # noqa: E402
from tests.helpers.kv import lmcache_planes, make_kv  # noqa: E402

KEY = ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(42), model_name="fit", kv_rank=0)


def _obj(groups: list[torch.Tensor]) -> TensorMemoryObj:
    if len(groups) == 1:
        t = groups[0].contiguous()
        return TensorMemoryObj(raw_data=t.view(-1), metadata=MemoryObjMetadata(
            shape=t.shape, dtype=t.dtype, address=-1, phy_size=t.numel() * t.element_size(),
            ref_count=1, shapes=[t.shape], dtypes=[t.dtype]), parent_allocator=None)
    raw = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in groups])
    return TensorMemoryObj(raw_data=raw, metadata=MemoryObjMetadata(
        shape=torch.Size([raw.numel()]), dtype=torch.uint8, address=-1, phy_size=raw.numel(),
        ref_count=1, shapes=[t.shape for t in groups], dtypes=[t.dtype for t in groups]),
        parent_allocator=None)


def _values(kind: str, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tuple(shape), generator=g)
    if kind == "gauss":
        pass
    elif kind == "uniform-wide":
        x = (torch.rand(tuple(shape), generator=g) - 0.5) * 2e4
    elif kind == "sparse-outliers":     # mostly zero, a few huge: every value an outlier
        x = torch.zeros(tuple(shape))
        x.view(-1)[::5] = 3000.0 * torch.sign(torch.randn(x.view(-1)[::5].shape, generator=g))
    elif kind == "heavy-tail":
        x = x ** 5
    elif kind == "zeros":
        x = torch.zeros(tuple(shape))
    elif kind == "tiny":
        x = x * 1e-6
    else:
        raise AssertionError(kind)
    return x.to(dtype)


SHAPES = [
    [(2, 3, 1, 64)], [(2, 3, 2, 64)], [(2, 5, 17, 96)], [(2, 2, 255, 32)],
    [(2, 2, 3, 4, 8)], [(1, 3, 9, 40)], [(6, 3, 10)], [(3, 5, 7)],
    [(2, 3, 16, 64), (2, 3, 16, 64)], [(2, 2, 33, 48), (6,), (3, 4)], [(11,)], [(2, 2)],
]
KINDS = ["gauss", "uniform-wide", "sparse-outliers", "heavy-tail", "zeros", "tiny"]


@pytest.mark.parametrize("ratio", [8.0, 16.0])
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "+".join("x".join(map(str, t)) for t in s))
def test_always_fit_stores_every_object(shapes, ratio, caplog):
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    ser, de = S.make_pair("cachegen", {"slot_ratio": ratio})
    for j, kind in enumerate(KINDS):
        groups = [_values(kind, sh, dtypes[(g + j) % 3], 31 * j + g) for g, sh in enumerate(shapes)]
        lay = MemoryLayoutDesc([t.shape for t in groups], [t.dtype for t in groups])
        slot = ser.estimate_serialized_size(lay)
        buf = torch.full((slot + 16,), 0xCD, dtype=torch.uint8)
        with caplog.at_level(logging.WARNING, logger="third_party.lmcache.serde"):
            n = ser.serialize(_obj(groups), _obj([buf]), KEY)
        assert n == slot and bool((buf[slot:] == 0xCD).all()), (kind, shapes)
        out = _obj([torch.zeros_like(t) for t in groups])
        de.deserialize(_obj([buf[:slot].clone()]), out, KEY)
        _, views = parse_frame(memoryview(buf[:slot].numpy()))
        it = iter(views)
        for g, t in enumerate(groups):
            got = out.get_tensor(g) if len(groups) > 1 else out.tensor
            first = next(it)
            if is_raw(first):
                assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), (kind, g)
                continue
            k, v = codec.decode_kv(bytes(first))
            gk, gv = kv_views(got, ser.settings)
            assert torch.equal(gk, k) and torch.equal(gv, v), (kind, g)
            assert bool(torch.isfinite(got.float()).all()) and got.dtype == t.dtype
    st = ser.stats
    assert st["objects"] == len(KINDS) and st["refused"] == 0
    assert sum(st["levels"].values()) == len(KINDS)
    assert st["slot_bytes"] >= st["bytes"]


def test_non_finite_kv_is_refused_with_its_reason():
    ser, _ = S.make_pair("cachegen", {})
    x = lmcache_planes(*make_kv(2, 32, 1, 64))
    x[1, 0, 3, 5] = float("nan")
    slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    with pytest.raises(ValueError, match="NaN or inf") as e:
        ser.serialize(_obj([x]), _obj([torch.zeros(slot, dtype=torch.uint8)]), KEY)
    assert "\n" not in str(e.value) and "slot_ratio" not in str(e.value)
    assert ser.stats["refused"] == 1 and ser.stats["objects"] == 0


def test_without_always_fit_refuses_what_fits_no_step(caplog):
    """always_fit off (kvtc's default): an object no step fits is refused, counted, and
    logged in one line naming its layout."""
    ser, _ = S.make_pair("cachegen", {"slot_ratio": 1e6, "always_fit": False})
    x = lmcache_planes(*make_kv(2, 64, 1, 64))
    slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    with caplog.at_level(logging.WARNING, logger="third_party.lmcache.serde"):
        with pytest.raises(ValueError, match="does not fit the slot"):
            ser.serialize(_obj([x]), _obj([torch.zeros(slot + 64, dtype=torch.uint8)]), KEY)
    assert ser.stats["refused"] == 1
    assert any("not stored" in m and "[2, 2, 64, 64]" in m for m in caplog.messages)


def test_configuration_says_what_is_stored(caplog):
    """When LMCache creates the serde, one line says which layouts are coded, that the
    rest is stored verbatim, and whether every object is stored."""
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    from third_party import lmcache as plugin

    plugin.register()
    with caplog.at_level(logging.INFO, logger="third_party.lmcache.serde"):
        create_serde_processor(SerdeConfig(type="cachegen", kwargs={})).close()
        create_serde_processor(SerdeConfig(type="cachegen", kwargs={"always_fit": False})).close()
    lines = [m for m in caplog.messages if m.startswith("cachegen serde: level 1")]
    assert len(lines) == 2 and all("\n" not in m and "verbatim" in m for m in lines)
    assert "every object is stored" in lines[0] and "refused" in lines[1]


@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 3}, {"head_dim": 64}])
def test_fused_plane_is_coded_as_its_k_and_v(kw):
    """A fused one-plane object (each head's K then V) is coded exactly as the same K and
    V in [2, L, T, H, D]: the same containers, so the same KV back (not mixed halves)."""
    from bench.codec.contexts import synthetic_kv

    with torch.random.fork_rng():
        torch.manual_seed(3)
        k, v = synthetic_kv(3, 48, 3, 64, seed=3)
    fused = torch.cat([k, v], -1).reshape(1, 3, 48, 3 * 128).contiguous()
    heads5 = torch.stack([k, v]).contiguous()
    ser, de = S.make_pair("cachegen", {"slot_ratio": 4.0, **kw})
    frames = []
    for x in (fused, heads5, fused[0].contiguous()):
        slot = ser.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
        buf = torch.zeros(slot, dtype=torch.uint8)
        ser.serialize(_obj([x]), _obj([buf]), KEY)
        frames.append([bytes(c) for c in parse_frame(memoryview(buf.numpy()))[1]])
        out = _obj([torch.zeros_like(x)])
        de.deserialize(_obj([buf]), out, KEY)
        if x.dim() == 5:
            k2, v2 = out.tensor[0], out.tensor[1]
        else:
            y = out.tensor.reshape(3, 48, 3, 128)
            k2, v2 = y[..., :64], y[..., 64:]
        kd, vd = codec.decode_kv(frames[-1][0])
        assert torch.equal(k2, kd) and torch.equal(v2, vd)
    assert frames[0] == frames[1] == frames[2]
