"""The public codec API with backend="triton" vs backend="cpu": identical bytes, identical
decoded tensors, both ways (a KV encoded on a GPU decodes on a CPU and the reverse).

Runs on the CPU under TRITON_INTERPRET=1 (set here when no CUDA device is present: the
Triton kernels then take CPU tensors) on small shapes, mostly with the GPU-style stream
layout (1 channel x 16 tokens per stream, many short streams: fast in the interpreter);
on a GPU machine the same tests run on CUDA tensors. Part of the default suite (~1 min).
Run: .venv/bin/python -m pytest tests/codec/test_codec_triton_api.py -q
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import codec  # noqa: E402
from codec.triton import kernels as tj  # noqa: E402
from codec.triton import ops as tk  # noqa: E402
from codec.config import CodecConfig  # noqa: E402

needs_triton = pytest.mark.skipif(not tj.available(), reason="Triton not usable here")
DEV = "cpu" if tj.interpreting() or not torch.cuda.is_available() else "cuda"
GPU_LAYOUT = dict(channels_per_stream=1, tokens_per_stream=16)
L, H, D = 3, 2, 8


def _kv(T: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, T, H, D]: Laplace-like per-channel scales, key outlier channels, and one
    all-zero token (scale 0: the inv = 0 path of the quantizer)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for kv in range(2):
        b = torch.exp(0.5 * torch.randn(L, 1, H, D, generator=g))
        if kv == 0:
            b[..., ::4] *= 8.0
        mag = -torch.log1p(-torch.rand(L, T, H, D, generator=g))      # Exp(1)
        sign = torch.where(torch.rand(L, T, H, D, generator=g) < 0.5, -1.0, 1.0)
        x = sign * mag * b
        x[1, T // 2] = 0.0
        out.append(x.to(dtype))
    return out[0], out[1]


class _Spy:
    """Counts calls of the Triton entry points, so a silent CPU fallback fails a test."""

    NAMES = ("quantize_triton", "dequantize_triton", "encode_symbols_triton",
             "decode_symbols_triton")

    def __init__(self, monkeypatch):
        self.calls = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            fn = getattr(tk, name)

            def wrapped(*a, _fn=fn, _name=name, **kw):
                self.calls[_name] += 1
                return _fn(*a, **kw)

            monkeypatch.setattr(tk, name, wrapped)


def _check_same(data_cpu: bytes, data_tri: bytes, k: torch.Tensor, v: torch.Tensor):
    assert data_tri == data_cpu
    kc, vc = codec.decode_kv(data_cpu, device="cpu", backend="cpu")
    kt, vt = codec.decode_kv(data_cpu, device=DEV, backend="triton")
    assert kt.device.type == torch.device(DEV).type
    assert kt.dtype == k.dtype and kt.shape == k.shape
    assert torch.equal(kt.cpu(), kc) and torch.equal(vt.cpu(), vc)


# ------------------------------------------------------------------ whole-KV round trips
@needs_triton
@pytest.mark.parametrize("dtype,name,level,extra", [
    (torch.bfloat16, "cachegen", 0, {}),
    (torch.float16, "cachegen", 1, {}),
    (torch.float32, "cachegen", 1, {}),
    (torch.bfloat16, "cachegen-ref", 0, {}),
    (torch.float32, "cachegen-ref", 0, {}),
    (torch.float16, "cachegen", 1, dict(scale_format="log8", scale_group="head")),
])
def test_encode_kv_same_bytes_and_decode_both_backends(dtype, name, level, extra,
                                                       monkeypatch):
    variant = "reference" if name == "cachegen-ref" else "harness"
    cfg = CodecConfig.for_model(L, level, variant=variant, **GPU_LAYOUT, **extra)
    k, v = _kv(37, dtype, seed=level)
    data_cpu = codec.encode_kv(k, v, codec=name, config=cfg, backend="cpu")
    spy = _Spy(monkeypatch)
    data_tri = codec.encode_kv(k.to(DEV), v.to(DEV), codec=name, config=cfg,
                               backend="triton")
    _check_same(data_cpu, data_tri, k, v)
    assert all(n > 0 for n in spy.calls.values()), spy.calls


@needs_triton
def test_default_layout_level_preset_and_blob():
    """No explicit config (the CPU default layout, G = 4, B = T) and encode_blob."""
    k, v = _kv(13, torch.bfloat16, seed=3)
    data_cpu = codec.encode_kv(k, v, codec="cachegen", level=1, backend="cpu")
    data_tri = codec.encode_blob(torch.stack([k, v], 1).to(DEV), codec="cachegen", level=1,
                                 backend="triton")
    _check_same(data_cpu, data_tri, k, v)
    _, st_cpu = codec.encode_with_stats(k, v, codec="cachegen", level=1, backend="cpu")
    _, st_tri = codec.encode_with_stats(k.to(DEV), v.to(DEV), codec="cachegen", level=1,
                                        backend="triton")
    assert st_tri == st_cpu


# ------------------------------------------------------------------------------ chunks
@needs_triton
def test_encode_chunks_same_bytes_and_decode_chunks_both_backends():
    cfg = CodecConfig.for_model(L, 1, **GPU_LAYOUT)          # 4 sink tokens in chunk 0
    k, v = _kv(70, torch.bfloat16, seed=5)
    ch_cpu = codec.encode_chunks(k, v, codec="cachegen", config=cfg, chunk_tokens=32,
                                 backend="cpu")
    ch_tri = codec.encode_chunks(k.to(DEV), v.to(DEV), codec="cachegen", config=cfg,
                                 chunk_tokens=32, backend="triton")
    assert len(ch_cpu) == 3 and ch_tri == ch_cpu
    kc, vc = codec.decode_chunks(ch_cpu, backend="cpu")
    kt, vt = codec.decode_chunks(ch_tri, device=DEV, backend="triton")
    assert torch.equal(kt.cpu(), kc) and torch.equal(vt.cpu(), vc)
    k1, _ = codec.decode_chunk(ch_cpu[1], device=DEV, backend="triton")
    assert torch.equal(k1.cpu(), kc[:, 32:64])


@needs_triton
def test_chunk_of_only_sink_tokens():
    """Chunk 0 holds only exact sink tokens (no symbols): handled on both backends."""
    cfg = CodecConfig.for_model(L, 0, sink_tokens=16, **GPU_LAYOUT)
    k, v = _kv(20, torch.float16, seed=7)
    ch_cpu = codec.encode_chunks(k, v, codec="cachegen", config=cfg, chunk_tokens=16,
                                 backend="cpu")
    ch_tri = codec.encode_chunks(k.to(DEV), v.to(DEV), codec="cachegen", config=cfg,
                                 chunk_tokens=16, backend="triton")
    assert ch_tri == ch_cpu
    kc, vc = codec.decode_chunks(ch_cpu, backend="cpu")
    kt, vt = codec.decode_chunks(ch_cpu, device=DEV, backend="triton")
    assert torch.equal(kt.cpu(), kc) and torch.equal(vt.cpu(), vc)
    assert torch.equal(kc[:, :16], k[:, :16])


# ------------------------------------------------------- baselines, dispatch and errors
@needs_triton
@pytest.mark.parametrize("name", ["raw", "fp8", "quant8", "kivi2"])
def test_codecs_without_triton_kernels_accept_backend_triton(name, monkeypatch):
    """raw/fp8/quant8/kivi run on CPU copies whatever the backend: same bytes, no kernel."""
    k, v = _kv(40, torch.bfloat16, seed=9)
    spy = _Spy(monkeypatch)
    data_cpu = codec.encode_kv(k, v, codec=name, backend="cpu")
    data_tri = codec.encode_kv(k.to(DEV), v.to(DEV), codec=name, backend="triton")
    _check_same(data_cpu, data_tri, k, v)
    assert sum(spy.calls.values()) == 0


def test_auto_backend_on_cpu_tensors_uses_the_cpu(monkeypatch):
    spy = _Spy(monkeypatch)
    k, v = _kv(20, torch.float16, seed=11)
    data = codec.encode_kv(k, v, codec="cachegen", level=0)
    k2, _ = codec.decode_kv(data, device="cpu")
    assert k2.device.type == "cpu" and sum(spy.calls.values()) == 0
    assert data == codec.encode_kv(k, v, codec="cachegen", level=0, backend="cpu")


@pytest.mark.parametrize("bad", ["gpu", "", None, "CPU"])
def test_unknown_backend_is_a_value_error_listing_the_options(bad):
    k, v = _kv(16, torch.float16)
    data = codec.encode_kv(k, v, codec="raw", backend="cpu")
    calls = [lambda: codec.encode_kv(k, v, backend=bad),
             lambda: codec.encode_with_stats(k, v, backend=bad),
             lambda: codec.encode_blob(torch.stack([k, v], 1), backend=bad),
             lambda: codec.encode_chunks(k, v, chunk_tokens=16, backend=bad),
             lambda: codec.decode_kv(data, backend=bad),
             lambda: codec.decode_chunk(data, backend=bad),
             lambda: codec.decode_chunks([data], backend=bad)]
    for call in calls:
        with pytest.raises(ValueError) as e:
            call()
        assert all(opt in str(e.value) for opt in ("'auto'", "'cpu'", "'triton'"))


@needs_triton
def test_corrupt_payload_and_lengths_same_outcome_on_both_decoders():
    """Damage behind a valid container (payload bytes, stream lengths): the Triton decoder
    raises CodecError exactly when the CPU one does, else returns the same tensors."""
    import random

    import numpy as np

    from codec import bitstream

    cfg = CodecConfig.for_model(L, 1, **GPU_LAYOUT)
    k, v = _kv(20, torch.bfloat16, seed=13)
    c = bitstream.unpack_container(codec.encode_kv(k, v, codec="cachegen", config=cfg))
    bf16 = [n for n, t in c.dtypes.items() if t == "bf16"]
    rng = random.Random(13)
    outcomes = {"ok": 0, "error": 0}
    for i in range(8):
        arrays = {n: np.array(a, copy=True) for n, a in c.arrays.items()}
        payload = bytearray(c.payload)
        if i % 2:
            lens = arrays["ent_stream_lengths"]
            j = rng.randrange(lens.size)
            lens[j] = max(0, int(lens[j]) + rng.choice([-2, 2, 1]))
        else:
            j = rng.randrange(len(payload))
            payload[j] ^= 1 << rng.randrange(8)
        bad = bitstream.pack(c.header, arrays, bytes(payload), bf16=bf16)
        res = []
        for backend in ("cpu", "triton"):
            try:
                res.append(codec.decode_kv(bad, device=DEV if backend == "triton" else "cpu",
                                           backend=backend))
            except codec.CodecError:
                res.append(None)
        if res[0] is None:
            assert res[1] is None
            outcomes["error"] += 1
        else:
            assert res[1] is not None
            assert torch.equal(res[1][0].cpu(), res[0][0])
            assert torch.equal(res[1][1].cpu(), res[0][1])
            outcomes["ok"] += 1
    assert outcomes["error"] >= 2, outcomes


# ------------------------------------------------------------- bench --device cuda
def test_bench_device_cuda_hands_over_to_triton_bench(monkeypatch, capsys):
    from bench import codec as bench
    from bench import triton as triton_bench

    seen = []
    monkeypatch.setattr(triton_bench, "main", lambda argv=None: seen.append(argv) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0] and not seen
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--device", "cuda", "--tokens", "1024", "--reps", "2"]) == 0
    assert seen == [["--device", "cuda", "--tokens", "1024", "--reps", "2"]]
    assert bench.main(["--device", "tpu0"]) == 2
