"""KIVI on chunks shorter than its group: every token before the context's
last KIVI_RESIDUAL tokens is quantized whatever the chunking (a short last key group with
its own lo/step, container format 5), sizes and errors stay near the one-shot encode."""
import pytest
import torch

from codec import bitstream
from codec.api import encode_one, decode_kv, encode_kv
from codec.base import KIVI_GROUP, KIVI_RESIDUAL
from codec.errors import CodecError
from tests.helpers.kv import make_kv

L, T, H, D = 2, 420, 2, 64
# per chunk: container header/array directory (< 1 KiB measured: ~470 B) and, per key
# group more than the one-shot has, its lo + step (2 x 2 bytes per (layer, head, channel))
CHUNK_OVERHEAD = 1024
GROUP_META = 2 * 2 * L * H * D


def _chunked(k, v, name, sizes):
    b = [0]
    for s in sizes:
        b.append(b[-1] + s)
    datas = [encode_one(k[:, b[i]:b[i + 1]], v[:, b[i]:b[i + 1]], name, None, None, b[i], T,
                         i, len(sizes), backend="cpu")[0] for i in range(len(sizes))]
    outs = [decode_kv(d) for d in datas]
    return datas, torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)


def _key_groups(sizes):
    n, off = 0, 0
    for s in sizes:
        q = max(0, min(s, T - KIVI_RESIDUAL - off))
        n += -(-q // KIVI_GROUP)
        off += s
    return n


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


CHUNKINGS = {
    "16": [16] * (T // 16) + [T % 16],
    "1": [1] * T,
    "15": [15] * (T // 15),
    "17": [17] * (T // 17) + [T % 17],
    "33": [33] * (T // 33) + [T % 33],
    "100": [100] * 4 + [20],
    # boundaries straddling the residual start (T - 128 = 292)
    "straddle": [280, 20, 120],
    "straddle2": [291, 2, 127],
}


@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
def test_short_chunks_are_quantized_like_one_shot(name, chunking):
    sizes = [s for s in CHUNKINGS[chunking] if s]
    assert sum(sizes) == T
    k, v = make_kv(L, T, H, D, k_scale=2.0, k_shift=0.5)
    one = encode_kv(k, v, name)
    k1, v1 = decode_kv(one)
    datas, kc, vc = _chunked(k, v, name, sizes)
    n = sum(map(len, datas))
    extra = (_key_groups(sizes) - _key_groups([T])) * GROUP_META
    assert n <= len(one) + len(sizes) * CHUNK_OVERHEAD + extra, (n, len(one))
    # unquantized tokens would make the stream ~4x (kivi4) - 8x (kivi2) larger per token
    nq = T - KIVI_RESIDUAL
    full = 2 * L * nq * H * D * 2
    assert n < len(one) + len(sizes) * CHUNK_OVERHEAD + extra + full / 4
    # errors like the one-shot (shorter groups can only be finer): quantized, not exact
    for x, x1, xc in ((k, k1, kc), (v, v1, vc)):
        assert _rel(xc, x) <= _rel(x1, x) * 1.02 + 1e-6
    assert torch.equal(kc[:, nq:], k[:, nq:]) and torch.equal(vc[:, nq:], v[:, nq:])
    # values are per token: every value token before the residual is quantized
    same = (vc[:, :nq] == v[:, :nq]).float().mean().item()
    assert same < 0.5, same
    assert _rel(vc[:, :nq], v[:, :nq]) >= 0.5 * _rel(v1[:, :nq], v[:, :nq])


def test_sixteen_token_chunks_near_one_shot_size():
    """The issue's case: 16-token chunks were 1.74x the one-shot bytes (not quantized)."""
    k, v = make_kv(L, T, H, D, k_scale=2.0, k_shift=0.5)
    sizes = CHUNKINGS["16"]
    one = encode_kv(k, v, "kivi2")
    datas, _, _ = _chunked(k, v, "kivi2", sizes)
    assert sum(map(len, datas)) < 1.25 * len(one)


def test_short_group_fused_equals_reference_and_format_version():
    from codec import get_codec

    k, v = make_kv(L, T, H, D, dtype=torch.float16, seed=3, k_scale=2.0, k_shift=0.5)
    c = get_codec("kivi4")
    for off, t in ((0, 17), (32, 15), (280, 20), (0, 292)):
        enc = c.encode(k[:, off:off + t], v[:, off:off + t], level=None, config=None,
                       token_offset=off, total_tokens=T)
        shape = (L, t, H, D)
        a = c.decode(enc.header, enc.arrays, b"", shape, "float16", fused=True)
        r = c.decode(enc.header, enc.arrays, b"", shape, "float16", fused=False)
        assert torch.equal(a[0], r[0]) and torch.equal(a[1], r[1])
        nt = (min(t, T - KIVI_RESIDUAL - off)) % KIVI_GROUP
        assert enc.header.get("nt", 0) == nt
        assert enc.format_version == (5 if nt else 4)
    # containers: every chunk is written as version 6 (xxh3-64 trailer); the oldest
    # reader that can read it (EncodedChunk.format_version, above) is 5 only when a short
    # group is used; resealed as version 5 such a chunk decodes the same
    d5 = encode_one(k[:, :17], v[:, :17], "kivi2", None, None, 0, T, 0, 2, backend="cpu")[0]
    d4 = encode_one(k[:, :32], v[:, :32], "kivi2", None, None, 0, T, 0, 2, backend="cpu")[0]
    assert d5[4:6] == d4[4:6] == (6).to_bytes(2, "little")
    assert 5 in bitstream.READ_VERSIONS and 6 in bitstream.READ_VERSIONS
    a, b = decode_kv(d5), decode_kv(bitstream.reseal(d5, 5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("bad", [0, 32, 16, 18, -1, "3"])
def test_bad_tail_count_is_refused(bad):
    from codec import get_codec

    k, v = make_kv(L, T, H, D, k_scale=2.0, k_shift=0.5)
    c = get_codec("kivi2")
    enc = c.encode(k[:, :17], v[:, :17], level=None, config=None, token_offset=0,
                   total_tokens=T)
    hdr = dict(enc.header, nt=bad)
    for fused in (True, False):
        with pytest.raises(CodecError):
            c.decode(hdr, enc.arrays, b"", (L, 17, H, D), "bfloat16", fused=fused)
    # a reader that ignores nt (old layout) is refused by the array shapes, never misreads
    hdr = {"nq": 0}
    for fused in (True, False):
        with pytest.raises(CodecError):
            c.decode(hdr, enc.arrays, b"", (L, 17, H, D), "bfloat16", fused=fused)
