"""Triton codec kernels vs the CPU backend: identical bytes, decoding both ways.

Runs on the CPU under TRITON_INTERPRET=1 (set here when no CUDA device is present) on
small irregular shapes; on a GPU machine (scripts/gpu_check.sh) the same tests run on CUDA.
Run: TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/codec/test_codec_triton.py -q
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from codec.entropy import codebook_codes as cc  # noqa: E402
from codec.entropy import models as prob  # noqa: E402
from codec.entropy import rans_spec  # noqa: E402
from codec.quant import reference as Q  # noqa: E402
from codec.entropy import rans_cpu  # noqa: E402
from codec.entropy import rans_ref  # noqa: E402
from codec.triton import kernels as tj  # noqa: E402
from codec.triton import ops as tk  # noqa: E402
from codec.errors import CodecError  # noqa: E402

pytestmark = pytest.mark.skipif(not tj.available(), reason="Triton not usable here")
DEV = "cpu" if tj.interpreting() else "cuda"


def _laplace_symbols(rng, L, T, C, nbins, scale=1.5):
    """uint8 [L, T, C], per-layer alphabet nbins[l], two-sided geometric around the middle."""
    out = np.empty((L, T, C), np.uint8)
    for layer in range(L):
        nb = nbins[layer]
        p = np.exp(-np.abs(np.arange(nb) - nb // 2) / scale)
        p /= p.sum()
        out[layer] = rng.choice(nb, size=(T, C), p=p)
    return out


def _chunk(seed, L, T, C, nbk, nbv, scale=1.5):
    rng = np.random.default_rng(seed)
    sk = _laplace_symbols(rng, L, T, C, nbk, scale)
    sv = _laplace_symbols(rng, L, T, C, nbv, scale)
    ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), nbk, nbv)
    return sk, sv, ms


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


# ------------------------------------------------------------------------------ rANS
@pytest.mark.parametrize("L,T,C,G,B", [
    (2, 13, 7, 4, 5),      # C % G != 0, T % B != 0
    (1, 21, 5, 1, 21),     # one lane per channel, whole chunk per stream
    (2, 9, 6, 3, 100),     # B > T
    (1, 4, 3, 8, 1),       # G > C, one token per stream
])
def test_rans_bytes_equal_cpu_and_decode_both_ways(L, T, C, G, B):
    sk, sv, ms = _chunk(L * 100 + T, L, T, C, [32, 16][:L], [16, 8][:L])
    pay_c, len_c = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    pay_t, len_t = tk.rans_encode_triton(_t(sk), _t(sv), ms.cum, ms.model_index, G, B)
    assert np.array_equal(len_t.cpu().numpy(), len_c)
    assert pay_t.cpu().numpy().tobytes() == pay_c.tobytes()
    # CPU bytes -> Triton decoder, both symbol lookups (binary search / register scan)
    for lookup in ("search", "scan"):
        dk, dv = tk.rans_decode_triton(pay_c.tobytes(), len_c, ms.cum, ms.model_index,
                                       L, T, C, G, B, device=DEV, lookup=lookup)
        assert np.array_equal(dk.cpu().numpy(), sk) and np.array_equal(dv.cpu().numpy(), sv)
    # Triton bytes -> CPU decoder
    ck, cv = rans_cpu.decode_streams(pay_t.cpu().numpy().tobytes(), len_t.cpu().numpy(),
                                     ms.cum, ms.model_index, L, T, C, G, B)
    assert np.array_equal(ck, sk) and np.array_equal(cv, sv)


def test_rans_matches_pure_python_reference():
    L, T, C, G, B = 1, 6, 3, 2, 4
    sk, sv, ms = _chunk(7, L, T, C, [8], [4])
    ref_pay, ref_len = rans_ref.encode_streams_ref(sk, sv, ms.cum, ms.model_index, G, B)
    pay, lens = tk.rans_encode_triton(_t(sk), _t(sv), ms.cum, ms.model_index, G, B)
    assert pay.cpu().numpy().tobytes() == ref_pay
    assert lens.cpu().tolist() == ref_len.tolist()


def test_rans_long_stream_of_rare_symbols_no_fixed_buffer():
    """Peers give each stream 256 bytes unchecked; a stream of rare symbols needs more."""
    L, T, C, G, B = 1, 160, 2, 1, 160
    nb = 256
    freq = np.ones(nb, np.int64)
    freq[0] = rans_spec.PROB_SCALE - (nb - 1)                  # symbol 0 common, the rest rare
    cum = np.zeros((1, 257), np.uint32)
    cum[0, 1:] = np.cumsum(freq)
    mi = np.zeros((2, L, C), np.uint16)
    rng = np.random.default_rng(3)
    sk = rng.integers(1, nb, size=(L, T, C), dtype=np.uint8)   # all rare: 16 bits each
    sv = np.zeros((L, T, C), np.uint8)                          # all common: ~0 bits
    sv[0, 0, 0] = 255
    pay_t, len_t = tk.rans_encode_triton(_t(sk), _t(sv), cum, mi, G, B)
    pay_c, len_c = rans_cpu.encode_streams(sk, sv, cum, mi, G, B)
    assert pay_t.cpu().numpy().tobytes() == pay_c.tobytes()
    lens = len_t.cpu().numpy()
    assert lens[:2].min() > 256 and lens.sum() == pay_t.numel()
    dk, dv = tk.rans_decode_triton(pay_t, len_t, cum, mi, L, T, C, G, B)
    assert torch.equal(dk.cpu(), torch.from_numpy(sk)) and torch.equal(dv.cpu(), torch.from_numpy(sv))


def test_rans_256_bins_and_degenerate_model():
    """nbins = 256 (8 search steps) next to a 2-symbol model with freq 65535 / 1."""
    L, T, C, G, B = 1, 10, 4, 2, 10
    rng = np.random.default_rng(5)
    f256 = cc.normalize_freqs(rng.integers(0, 50, size=(1, 256)))
    f2 = np.array([[65535, 1]])
    cum = np.full((2, 257), 65536, np.uint32)
    cum[:, 0] = 0
    cum[0, 1:] = np.cumsum(f256[0])
    cum[1, 1:3] = np.cumsum(f2[0])
    mi = np.zeros((2, L, C), np.uint16)
    mi[1] = 1
    sk = rng.integers(0, 256, size=(L, T, C), dtype=np.uint8)
    sv = np.zeros((L, T, C), np.uint8)
    sv[0, 3, 1] = 1
    pay_t, len_t = tk.rans_encode_triton(_t(sk), _t(sv), cum, mi, G, B)
    pay_c, len_c = rans_cpu.encode_streams(sk, sv, cum, mi, G, B)
    assert pay_t.cpu().numpy().tobytes() == pay_c.tobytes()
    dk, dv = tk.rans_decode_triton(pay_c.tobytes(), len_c, cum, mi, L, T, C, G, B, device=DEV)
    assert np.array_equal(dk.cpu().numpy(), sk) and np.array_equal(dv.cpu().numpy(), sv)


def _small_encoded():
    L, T, C, G, B = 1, 8, 4, 2, 8
    sk, sv, ms = _chunk(11, L, T, C, [16], [16])
    pay, lens = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, B)
    return (L, T, C, G, B), ms, bytearray(pay.tobytes()), lens.copy()


def test_rans_decode_rejects_bad_input_like_cpu():
    shape, ms, pay, lens = _small_encoded()

    def both_raise(p, ln):
        with pytest.raises(CodecError):
            rans_cpu.decode_streams(bytes(p), ln, ms.cum, ms.model_index, *shape)
        with pytest.raises(CodecError):
            tk.rans_decode_triton(bytes(p), ln, ms.cum, ms.model_index, *shape, device=DEV)

    # truncated payload (lengths no longer add up)
    both_raise(pay[:-2], lens)
    # stream 0 shortened by one word, the next one lengthened: renormalisation reads run out
    # in stream 0 or leave leftovers / a wrong final state in stream 1
    ln = lens.copy()
    ln[0] -= 2
    ln[1] += 2
    both_raise(pay, ln)
    # initial state below L
    p = bytearray(pay)
    p[0:4] = b"\x00\x00\x00\x00"
    both_raise(p, lens)
    # odd and too-short lengths
    ln = lens.copy()
    ln[0] -= 1
    ln[1] += 1
    both_raise(pay, ln)
    ln = lens.copy()
    ln[1] += ln[0] - 2
    ln[0] = 2
    both_raise(pay, ln)
    # every single-byte corruption of the payload is caught or decodes to the same answer
    # as the CPU decoder (rANS has no redundancy; the container's CRC32 catches the rest)
    for i in range(0, len(pay), max(1, len(pay) // 10)):
        q = bytearray(pay)
        q[i] ^= 0x5A
        try:
            ck, cv = rans_cpu.decode_streams(bytes(q), lens, ms.cum, ms.model_index, *shape)
        except CodecError:
            with pytest.raises(CodecError):
                tk.rans_decode_triton(bytes(q), lens, ms.cum, ms.model_index, *shape, device=DEV)
        else:
            tk_k, tk_v = tk.rans_decode_triton(bytes(q), lens, ms.cum, ms.model_index, *shape,
                                               device=DEV)
            assert np.array_equal(tk_k.cpu().numpy(), ck) and np.array_equal(tk_v.cpu().numpy(), cv)


def test_rans_decode_rejects_bad_tables_and_layout():
    shape, ms, pay, lens = _small_encoded()
    L, T, C, G, B = shape
    bad = ms.cum.copy()
    bad[0, 5] = bad[0, 4] - 1                                   # decreasing row
    with pytest.raises(CodecError):
        tk.rans_decode_triton(bytes(pay), lens, bad, ms.model_index, *shape, device=DEV)
    mi = ms.model_index.astype(np.int64) + ms.cum.shape[0]     # out of range
    with pytest.raises(CodecError):
        tk.rans_decode_triton(bytes(pay), lens, ms.cum, mi, *shape, device=DEV)
    with pytest.raises(CodecError):
        tk.rans_decode_triton(bytes(pay), lens[:-1], ms.cum, ms.model_index, *shape, device=DEV)
    with pytest.raises(CodecError):
        tk.rans_decode_triton(bytes(pay), lens, ms.cum, ms.model_index, L, T, C, 0, B, device=DEV)


def test_rans_encode_rejects_zero_frequency_symbol():
    cum = np.full((1, 257), 65536, np.uint32)
    cum[0, 0] = 0
    cum[0, 1] = 30000                                           # nbins = 2
    mi = np.zeros((2, 1, 3), np.uint16)
    sk = np.zeros((1, 4, 3), np.uint8)
    sk[0, 2, 1] = 2                                             # symbol 2 has frequency 0
    with pytest.raises(ValueError, match="zero frequency"):
        tk.rans_encode_triton(_t(sk), _t(np.zeros_like(sk)), cum, mi, 1, 4)


# ------------------------------------------------------------------------- histograms
@pytest.mark.parametrize("nbins_max", [256, 32])
def test_histogram_equals_cpu(nbins_max):
    rng = np.random.default_rng(1)
    sym = rng.integers(0, 32, size=(2, 70, 5), dtype=np.uint8)
    h = tk.histogram_triton(_t(sym), nbins_max=nbins_max)
    assert h.dtype == torch.int64
    assert np.array_equal(h.cpu().numpy(), prob.histograms(sym))
    assert torch.equal(h.cpu(), tk.histogram_ref(torch.from_numpy(sym)))


def test_histogram_rejects_symbols_over_bound():
    sym = torch.full((1, 3, 2), 40, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError):
        tk.histogram_triton(sym, nbins_max=32)


# ----------------------------------------------------------------------- quantization
def _kv(dtype, L=3, T=19, H=3, D=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, T, H, D, generator=g) * (torch.rand(1, 1, H, D, generator=g) * 4)
    x[1, 4] = 0.0                                               # all-zero token row
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_dequantize_equal_reference(dtype):
    x = _kv(dtype)
    L, T, H, D = x.shape
    m = Q.max_levels([32, 16, 8])
    cases = [
        (x.reshape(L, T, H * D), Q.row_scales(x.reshape(L, T, H * D))),            # per token
        (x, Q.row_scales(x)),                                                      # per head
        (x.reshape(L, T, H * D), Q.row_scales(x.reshape(L, T, H * D), dim=1)),     # per channel
        (x, Q.row_scales(x) * 1.0625),                                             # log8-like
    ]
    for xx, sc in cases:
        ref = Q.quantize(xx, sc, m)
        got = tk.quantize_triton(xx.to(DEV), sc.to(DEV), m)
        assert torch.equal(got.cpu(), ref)
        deq_ref = Q.dequantize(ref, sc, m).to(dtype)
        deq = tk.dequantize_triton(ref.to(DEV), sc.to(DEV), m, out_dtype=dtype)
        assert deq.dtype == dtype and torch.equal(deq.cpu(), deq_ref)


def test_quantize_rounds_half_to_even_and_clamps():
    x = torch.tensor([[[0.5, 1.5, 2.5, -0.5, -2.5, 3.0, -3.0, 0.0, 7.0, -7.0]]])
    sc = torch.tensor([[[3.0]]])
    m = torch.tensor([3.0])
    got = tk.quantize_triton(x.to(DEV), sc.to(DEV), m).cpu()
    assert got.tolist() == Q.quantize(x, sc, m).tolist() == [[[3, 5, 5, 3, 1, 6, 0, 3, 6, 0]]]


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError):
        tk.quantize_triton(torch.zeros(2, 3, dtype=torch.int32, device=DEV),
                           torch.ones(2, 1, device=DEV), torch.ones(2))
    with pytest.raises(ValueError):
        tk.quantize_triton(torch.zeros(2, 3, device=DEV), torch.ones(2, 2, device=DEV),
                           torch.ones(2))
    with pytest.raises(ValueError):
        tk.quantize_triton(torch.zeros(2, 3, device=DEV), torch.ones(2, 1, device=DEV),
                           torch.ones(3))


# -------------------------------------------------------------------- entropy API
def test_encode_symbols_triton_identical_and_cross_decodes():
    from codec import entropy

    L, T, C = 2, 12, 6
    nbk, nbv = [32, 16], [16, 8]
    sk, sv, _ = _chunk(21, L, T, C, nbk, nbv)
    ref = entropy.encode_symbols(sk, sv, nbk, nbv, channels_per_stream=2, tokens_per_stream=5)
    got = tk.encode_symbols_triton(_t(sk), _t(sv), nbk, nbv, channels_per_stream=2,
                                   tokens_per_stream=5)
    assert got.header == ref.header and got.payload == ref.payload
    assert set(got.arrays) == set(ref.arrays)
    for k in ref.arrays:
        assert got.arrays[k].dtype == ref.arrays[k].dtype
        assert np.array_equal(got.arrays[k], ref.arrays[k])
    assert got.total_bytes == ref.total_bytes
    dk, dv = tk.decode_symbols_triton(ref.header, ref.arrays, ref.payload, L, T, C, nbk, nbv,
                                      device=DEV)
    assert np.array_equal(dk.cpu().numpy(), sk) and np.array_equal(dv.cpu().numpy(), sv)
    ck, cv = entropy.decode_symbols(got.header, got.arrays, got.payload, L, T, C, nbk, nbv)
    assert np.array_equal(ck, sk) and np.array_equal(cv, sv)
    with pytest.raises(CodecError):
        tk.decode_symbols_triton(ref.header, ref.arrays, ref.payload[:-2], L, T, C, nbk, nbv,
                                 device=DEV)


def test_available_under_interpreter_or_cuda():
    assert tj.available() is True


_COMPILE_SCRIPT = r"""
import json, sys
from codec.triton import kernels as tj
from codec.triton import ops as tk
try:
    ptx = tj.compile_for_target(90)
except (FileNotFoundError, ImportError, TypeError) as e:  # no ptxas / other Triton API
    print(json.dumps({"skip": f"{type(e).__name__}: {e}"})); sys.exit(0)
print(json.dumps({
    "n": len(ptx),
    "entries": all(".entry" in p for p in ptx.values()),
    "fma": [k for k in ("quantize_fp32", "quantize_bf16", "dequantize_fp16", "dequantize_i16")
            if "fma" in ptx[k]],
    "div_u32": "div.u32" in ptx["rans_encode_write1"],
    "div64": [k for k in ("rans_encode_write1", "rans_decode_steps8")
              if "div.u64" in ptx[k] or "div.s64" in ptx[k]],
    "barriers": [k for k in ptx if k.startswith("rans_") and "bar.sync" in ptx[k]],
}))
"""


def test_kernels_compile_for_h100_class_gpu_without_a_gpu():
    """AOT-compile every kernel variant for sm_90 (the interpreter accepts code that the
    compiler rejects, e.g. non-constexpr globals); check the arithmetic the bytes depend on.
    Runs in a fresh process: the interpreter leaves triton.language patched in this one."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in res:  # pragma: no cover - a triton wheel without ptxas
        pytest.skip(res["skip"])
    assert res["n"] == 13 and res["entries"]
    assert res["fma"] == []                 # x * inv rounded before rint, no contraction
    assert res["div_u32"]                   # unsigned 32-bit x // f in the encoder
    assert res["div64"] == []               # no 64-bit division in the rANS hot loops
    assert res["barriers"] == []            # no shared-memory layout shuffles in the rANS loops


def test_resolve_backend():
    assert tj.resolve_backend("cpu") == "cpu"
    assert tj.resolve_backend("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError):
        tj.resolve_backend("cpu", "gpu")
    if DEV == "cuda":
        assert tj.resolve_backend("cuda") == "triton"
        assert tj.resolve_backend("cuda", "cpu") == "cpu"


def test_encode_symbols_triton_rejects_like_cpu():
    from codec import entropy

    sk = np.zeros((1, 4, 3), np.uint8)
    sk[0, 1, 2] = 9                                             # >= nbins = 8
    sv = np.zeros_like(sk)
    for fn, a, b in ((entropy.encode_symbols, sk, sv),
                     (tk.encode_symbols_triton, _t(sk), _t(sv))):
        with pytest.raises(ValueError, match="symbol 9 >= nbins=8"):
            fn(a, b, [8], [8])
        with pytest.raises(ValueError):
            fn(a, b, [8], [8], channels_per_stream=0)
