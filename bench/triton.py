"""Benchmark of the Triton codec kernels against the CPU backend and the entropy bound.

Purpose: the Triton kernels' figures of docs/gpu.md. On a synthetic KV shaped like a 7B model (32 layers, 8 KV
heads, head dim 128, 4K tokens; Laplace-like values with per-channel scales, LMCache's
CacheGen bin schedule, one scale per (layer, token)) it times, with synchronized timers,
warm-up excluded and medians over repeats:
  encode: quantize (Triton) + histograms (Triton) + rANS encode, two passes (Triton);
          the host-side model build (codec.entropy.models.build_models) and the payload's
          device-to-host copy are timed separately and reported as "end to end";
  decode: rANS decode (Triton) + dequantize to fp16 (Triton), payload already on device
          (both symbol lookups of the decoder are timed: "auto"/scan and "search");
and the CPU backend (numba, codec/entropy/rans_cpu.py) on ONE layer (K and V), scaled by the layer
count (said so in the table). Throughput is GB/s of the fp16-equivalent KV
(2 tensors x L x T x H x D x 2 bytes) per second, and Msym/s. It also checks on the big
KV that the GPU decodes its own stream exactly, and that the GPU's bytes for layer 0 equal
the CPU backend's bytes for the same symbols and models.

Run (GPU):   python -m bench.triton --device cuda
Run (tiny, CPU interpreter, for testing the script):
             TRITON_INTERPRET=1 .venv/bin/python -m bench.triton --device cpu --tiny
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from codec.triton import kernels as tj
from codec.triton import ops as tk
from cachegen_common import flags
from cachegen_common.files import atomic_write_json
from cachegen_common.header import environment as header_environment

# LMCache/CacheGen default schedule for a 7B model (LMCache cachegen_basics.py)
LAYERS_7B, HEADS_7B, HEAD_DIM_7B, TOKENS_7B = 32, 8, 128, 4096


def lmcache_bins(L: int) -> tuple[list[int], list[int]]:
    """Keys: 32 bins on layers [0, 10), 16 after; values: 32 on [0, 2), 16 after
    (< 10 layers: 32 everywhere)."""
    if L < 10:
        return [32] * L, [32] * L
    return [32] * 10 + [16] * (L - 10), [32] * 2 + [16] * (L - 2)


def synthetic_kv(L: int, T: int, H: int, D: int, device, seed: int = 0,
                 dtype=torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, T, H, D]: Laplace(0, b_c) per channel c with log-normal scales b_c
    (keys get a few 8x outlier channels, as real keys do). Deterministic for a seed."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for kv in range(2):
        b = torch.exp(0.5 * torch.randn(L, 1, H, D, generator=g))
        if kv == 0:
            b[..., :: max(1, D // 4)] *= 8.0           # outlier channels in keys
        b = b.to(device)
        gd = torch.Generator(device=device).manual_seed(seed * 2 + kv + 1)
        u = torch.rand(L, T, H, D, generator=gd, device=device) - 0.5
        x = -torch.sign(u) * torch.log1p(-2.0 * u.abs().clamp(max=0.4999999)) * b
        out.append(x.to(dtype))
    return out[0], out[1]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, reps: int = 5, warmup: int = 1) -> tuple[float, object]:
    """Median wall seconds of fn() over reps (after warmup calls), synchronized."""
    res = None
    for _ in range(warmup):
        res = fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        res = fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), res


@dataclass
class Row:
    what: str
    seconds: float
    gbps: float
    msym: float
    note: str = ""


def run(device: str = "cuda", L: int = LAYERS_7B, T: int = TOKENS_7B, H: int = HEADS_7B,
        D: int = HEAD_DIM_7B, layouts=((4, None), (1, 1024), (1, 256)), reps: int = 5,
        extra_blocks=(), cpu_layers: int = 1, seed: int = 0, log=print) -> dict:
    """Run the benchmark; returns a dict with the rows, sizes and checks (JSON-able).

    layouts: (channels_per_stream G, tokens_per_stream B or None = T) to time.
    extra_blocks: further lanes-per-program values to time the rANS kernels with (the
      default block gets the full set of rows; these only rANS encode/decode rows).
    """
    from codec.entropy import models as prob

    dev = torch.device(device)
    C = H * D
    n_sym = 2 * L * T * C
    fp16_bytes = n_sym * 2
    bins_k, bins_v = lmcache_bins(L)
    nbk = [b - 1 for b in bins_k]            # symbols 0..2M: bins - 1 of them (codec.codecs)
    nbv = [b - 1 for b in bins_v]
    log(f"KV [L={L}, T={T}, H={H}, D={D}] x2, {n_sym / 1e6:.1f} Msym, fp16 {fp16_bytes / 1e6:.1f} MB, "
        f"device {device}")
    k, v = synthetic_kv(L, T, H, D, dev, seed)
    mk = torch.tensor([b // 2 - 1 for b in bins_k], dtype=torch.float32)
    mv = torch.tensor([b // 2 - 1 for b in bins_v], dtype=torch.float32)
    k3, v3 = k.reshape(L, T, C), v.reshape(L, T, C)                     # [L, T, C]

    def quant():
        sk_ = k3.float().abs().amax(dim=-1, keepdim=True)               # [L, T, 1] scales
        sv_ = v3.float().abs().amax(dim=-1, keepdim=True)
        return (tk.quantize_triton(k3, sk_, mk), tk.quantize_triton(v3, sv_, mv), sk_, sv_)

    t_q, (sym_k, sym_v, sc_k, sc_v) = timeit(quant, dev, reps)
    nbmax = max(nbk + nbv)
    t_h, (hk, hv) = timeit(lambda: (tk.histogram_triton(sym_k, nbmax),
                                    tk.histogram_triton(sym_v, nbmax)), dev, reps)
    t0 = time.perf_counter()
    hk_np, hv_np = hk.cpu().numpy(), hv.cpu().numpy()
    ms = prob.build_models(hk_np, hv_np, nbk, nbv)
    t_models = time.perf_counter() - t0
    checks = {}
    # the quantizer against the torch reference on a slice (exactness)
    from codec.quant import reference as Q
    ref = Q.quantize(k3[:2], sc_k[:2], mk[:2].to(dev))
    checks["quantize_equals_reference"] = bool(torch.equal(ref, sym_k[:2]))
    ideal_bits = float(ms.ideal_bits)
    rows: list[Row] = []
    gb = fp16_bytes / 1e9
    rows.append(Row("quantize K+V (Triton)", t_q, gb / t_q, n_sym / t_q / 1e6))
    rows.append(Row("histograms K+V (Triton)", t_h, gb / t_h, n_sym / t_h / 1e6))
    rows.append(Row("model build (host numpy)", t_models, gb / t_models, n_sym / t_models / 1e6,
                    f"{ms.cum.shape[0]} models"))
    sizes = {}
    for G, B in layouts:
        Bv = T if B is None else min(B, T)
        Gv = min(G, C)
        tag = f"G={Gv},B={Bv}"
        for blk in (None,) + tuple(extra_blocks):
            btag = tag + ("" if blk is None else f",blk={blk}")
            t_e, (pay, lens) = timeit(lambda: tk.rans_encode_triton(
                sym_k, sym_v, ms.cum, ms.model_index, Gv, Bv, block=blk), dev, reps)
            t_d, (dk, dv) = timeit(lambda: tk.rans_decode_triton(
                pay, lens, ms.cum, ms.model_index, L, T, C, Gv, Bv, block=blk), dev, reps)

            ok = bool(torch.equal(dk, sym_k) and torch.equal(dv, sym_v))
            checks[f"gpu_roundtrip_{btag}"] = ok
            if blk is not None:
                rows.append(Row(f"rANS encode [{btag}]", t_e, gb / t_e, n_sym / t_e / 1e6))
                rows.append(Row(f"rANS decode [{btag}]", t_d, gb / t_d, n_sym / t_d / 1e6))
                continue

            t_ds, (sk2, sv2) = timeit(lambda: tk.rans_decode_triton(
                pay, lens, ms.cum, ms.model_index, L, T, C, Gv, Bv, lookup="search"), dev, reps)
            checks[f"gpu_roundtrip_search_{tag}"] = bool(torch.equal(sk2, sym_k)
                                                         and torch.equal(sv2, sym_v))
            del sk2, sv2

            def dequant():
                return (tk.dequantize_triton(dk, sc_k, mk, torch.float16),
                        tk.dequantize_triton(dv, sc_v, mv, torch.float16))
            t_dq, _ = timeit(dequant, dev, reps)
            n_streams = int(lens.numel())
            pbytes = int(pay.numel())
            lbytes = n_streams * (2 if int(lens.max()) < 65536 else 4)
            sizes[tag] = dict(payload_bytes=pbytes, length_table_bytes=lbytes,
                              n_streams=n_streams, bits_per_sym=8 * pbytes / n_sym,
                              overhead_vs_entropy=8 * pbytes / ideal_bits - 1)
            enc = t_q + t_h + t_e
            dec = t_d + t_dq
            rows.append(Row(f"rANS encode [{btag}]", t_e, gb / t_e, n_sym / t_e / 1e6,
                            f"{n_streams} streams"))
            rows.append(Row(f"rANS decode [{btag}]", t_d, gb / t_d, n_sym / t_d / 1e6,
                            "lookup=auto (scan <= 32 symbols)"))
            rows.append(Row(f"rANS decode [{btag},search]", t_ds, gb / t_ds, n_sym / t_ds / 1e6,
                            "lookup=search"))
            rows.append(Row(f"ENCODE GPU kernels [{btag}]", enc, gb / enc, n_sym / enc / 1e6,
                            "quant+hist+rANS"))
            rows.append(Row(f"DECODE GPU [{btag}]", dec, gb / dec, n_sym / dec / 1e6,
                            "rANS+dequant fp16"))
            t_d2h, _ = timeit(lambda: pay.cpu(), dev, 3)
            e2e = enc + t_models + t_d2h
            rows.append(Row(f"encode end-to-end [{btag}]", e2e, gb / e2e, n_sym / e2e / 1e6,
                            "+models+D2H"))
        # CPU backend on `cpu_layers` layers of K and V, same models, same layout
        try:
            from codec.entropy import rans_cpu
            nl = min(cpu_layers, L)
            ck = sym_k[:nl].cpu().numpy()
            cv = sym_v[:nl].cpu().numpy()
            mi = np.ascontiguousarray(ms.model_index[:, :nl])
            wb = min(Bv, 8)                                    # JIT warm-up, both ways
            wp, wl = rans_cpu.encode_streams(ck[:, :8], cv[:, :8], ms.cum, mi, Gv, wb)
            rans_cpu.decode_streams(wp, wl, ms.cum, mi, nl, min(T, 8), C, Gv, wb)
            t_ce, (cpay, clen) = timeit(lambda: rans_cpu.encode_streams(ck, cv, ms.cum, mi, Gv, Bv),
                                        "cpu", 1, 0)
            t_cd, (rk, rv) = timeit(lambda: rans_cpu.decode_streams(cpay, clen, ms.cum, mi, nl, T,
                                                                    C, Gv, Bv), "cpu", 1, 0)
            scale = L / nl
            rows.append(Row(f"CPU rANS encode [{tag}]", t_ce * scale, gb / (t_ce * scale),
                            n_sym / (t_ce * scale) / 1e6,
                            f"{nl} layer(s) x{scale:g}, {os.cpu_count()} cores"))
            rows.append(Row(f"CPU rANS decode [{tag}]", t_cd * scale, gb / (t_cd * scale),
                            n_sym / (t_cd * scale) / 1e6,
                            f"{nl} layer(s) x{scale:g}, {os.cpu_count()} cores"))
            # bytes of the GPU encoder for the same layers (K streams of layers < nl, V ditto)
            ng, nb = -(-C // Gv), -(-T // Bv)
            per_layer = ng * nb
            l64 = lens.cpu().numpy()
            off = np.concatenate([[0], np.cumsum(l64)])
            pay_np = pay.cpu().numpy()
            parts = []
            for kv in range(2):
                s0 = kv * L * per_layer
                s1 = s0 + nl * per_layer
                parts.append(pay_np[off[s0]:off[s1]])
            same = np.array_equal(np.concatenate(parts), cpay) and np.array_equal(
                np.concatenate([l64[:nl * per_layer], l64[L * per_layer:(L + nl) * per_layer]]), clen)
            checks[f"gpu_bytes_equal_cpu_{tag}"] = bool(same)
            checks[f"cpu_roundtrip_{tag}"] = bool(np.array_equal(rk, ck) and np.array_equal(rv, cv))
        except ImportError as e:   # numba missing on a bare GPU image
            log(f"CPU backend unavailable ({e}); CPU rows skipped")
    return dict(rows=[r.__dict__ for r in rows], sizes=sizes, checks=checks,
                ideal_bits_per_sym=ideal_bits / n_sym,
                coded_bits_per_sym=float(ms.coded_bits) / n_sym,
                shape=dict(L=L, T=T, H=H, D=D), fp16_bytes=fp16_bytes, n_models=int(ms.cum.shape[0]))


def environment(device: str) -> dict:
    """Date, GPU, versions (for docs/gpu.md records; :func:`cachegen_common.header.environment`)."""
    env = header_environment(("date", "python", "torch", "triton", "numpy", "cpu_count",
                              "interpret", "numba"), interpret=tj.interpreting())
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def format_table(res: dict) -> str:
    """The results as a fixed-width text table (the last thing gpu_check prints)."""
    lines = [f"{'stage':46s} {'ms':>10s} {'GB/s fp16':>10s} {'Msym/s':>10s}  note",
             "-" * 96]
    for r in res["rows"]:
        lines.append(f"{r['what']:46s} {r['seconds'] * 1e3:10.2f} {r['gbps']:10.2f} "
                     f"{r['msym']:10.1f}  {r['note']}")
    lines.append("-" * 96)
    lines.append(f"entropy bound {res['ideal_bits_per_sym']:.3f} bits/sym (empirical, per "
                 f"(layer, channel)); coded models {res['coded_bits_per_sym']:.3f} bits/sym; "
                 f"{res['n_models']} models")
    for tag, s in res["sizes"].items():
        lines.append(f"  [{tag}] payload {s['bits_per_sym']:.3f} bits/sym "
                     f"({s['overhead_vs_entropy'] * 100:+.2f}% vs entropy bound), "
                     f"{s['n_streams']} streams, length table {s['length_table_bytes']} B")
    bad = [k for k, v in res["checks"].items() if not v]
    lines.append("checks: " + ("ALL OK" if not bad else "FAILED " + ", ".join(bad))
                 + f" ({len(res['checks'])} checks)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.triton", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python -m bench.triton --device cuda")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1")
    ap.add_argument("--tiny", action="store_true", help="tiny shape (interpreter smoke run)")
    flags.add_context_tokens(ap, default=TOKENS_7B, aliases=("--tokens",),
                             help="tokens of the 7B-shaped KV (default %(default)s)")
    ap.add_argument("--layers", type=int, default=LAYERS_7B)
    flags.add_repeats(ap, default=5)
    flags.add_out(ap, help="also write the results here (JSON, atomically)")
    a = ap.parse_args(argv)
    if not tj.available():
        print("Triton unavailable (needs triton + a CUDA device, or TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 2
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but no CUDA device", file=sys.stderr)
        return 2
    if a.tiny:
        res = run(a.device, L=2, T=24, H=2, D=4, layouts=((4, None), (1, 8)), reps=1)
    else:
        res = run(a.device, L=a.layers, T=a.context_tokens, reps=a.repeats)
    res["env"] = environment(a.device)
    if a.out:
        atomic_write_json(a.out, res, indent=1)
    print(json.dumps(res["env"]))
    print(format_table(res))
    return 0 if all(res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
