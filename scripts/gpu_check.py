"""GPU check of the Triton codec: correctness against the CPU backend, then speed.

Purpose: the Triton codec's single prepared check, run by scripts/gpu_check.sh on a GPU machine
that has only its image (PyTorch, Triton; numpy/numba installed by the .sh if possible).
Steps, each bounded:
  1. environment (GPU, versions);
  2. correctness on irregular small/medium shapes: Triton bytes == CPU backend bytes
     (numba; the pure-Python reference if numba is missing), decoding both ways, corrupt
     streams rejected, quantize/dequantize == the torch reference computed on the CPU;
  3. speed on a 7B-shaped KV (bench.triton), the table printed LAST.
Exit status: 0 when every check passed, 1 otherwise, 2 when no GPU/Triton.

Run (from the repository root): python -m scripts.gpu_check [--quick] [--out out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy as np
import torch

from cachegen_common import flags
from cachegen_common.files import atomic_write_json


def correctness(device: str, tiny: bool = False, log=print) -> dict:
    """Bytes / symbols equality against the CPU backend; returns {check: bool}."""
    from codec.entropy import models as prob
    from codec.quant import reference as Q
    from codec.entropy import rans_cpu, rans_ref
    from codec.triton import ops as tk
    from codec.errors import CodecError

    try:
        import numba  # noqa: F401
        have_numba = True
    except ImportError:
        have_numba = False
    checks = {}
    rng = np.random.default_rng(0)

    def syms(L, T, C, nbs):
        out = np.empty((L, T, C), np.uint8)
        for layer in range(L):
            nb = nbs[layer]
            p = np.exp(-np.abs(np.arange(nb) - nb // 2) / rng.uniform(0.7, 3.0))
            out[layer] = rng.choice(nb, size=(T, C), p=p / p.sum())
        return out

    shapes = [(3, 1000, 96, 4, None), (2, 777, 130, 1, 256), (4, 300, 257, 3, 100),
              (1, 4096, 64, 1, 4096)]
    if not have_numba or tiny:
        shapes = [(2, 20, 6, 4, None), (1, 9, 5, 1, 4)]
    if not have_numba:
        log("numba missing: comparing with the pure-Python reference on small shapes")
    for L, T, C, G, B in shapes:
        Bv = T if B is None else B
        nbk = [32, 16, 8, 256][:L]
        nbv = [16, 12, 32, 2][:L]
        sk, sv = syms(L, T, C, nbk), syms(L, T, C, nbv)
        ms = prob.build_models(prob.histograms(sk), prob.histograms(sv), nbk, nbv)
        tag = f"L{L}T{T}C{C}G{G}B{Bv}"
        if have_numba:
            cpay, clen = rans_cpu.encode_streams(sk, sv, ms.cum, ms.model_index, G, Bv)
            cpay = cpay.tobytes()
        else:
            cpay, clen = rans_ref.encode_streams_ref(sk, sv, ms.cum, ms.model_index, G, Bv)
        tsk, tsv = torch.from_numpy(sk).to(device), torch.from_numpy(sv).to(device)
        gpay, glen = tk.rans_encode_triton(tsk, tsv, ms.cum, ms.model_index, G, Bv)
        checks[f"bytes_equal_{tag}"] = (gpay.cpu().numpy().tobytes() == cpay
                                        and np.array_equal(glen.cpu().numpy(), clen))
        dk, dv = tk.rans_decode_triton(cpay, clen, ms.cum, ms.model_index, L, T, C, G, Bv,
                                       device=device)
        checks[f"gpu_decodes_cpu_{tag}"] = (np.array_equal(dk.cpu().numpy(), sk)
                                            and np.array_equal(dv.cpu().numpy(), sv))
        gb = gpay.cpu().numpy().tobytes()
        if have_numba:
            rk, rv = rans_cpu.decode_streams(gb, glen.cpu().numpy(), ms.cum, ms.model_index,
                                             L, T, C, G, Bv)
        else:
            rk, rv = rans_ref.decode_streams_ref(gb, glen.cpu().numpy(), ms.cum, ms.model_index,
                                                 L, T, C, G, Bv)
        checks[f"cpu_decodes_gpu_{tag}"] = np.array_equal(rk, sk) and np.array_equal(rv, sv)
        # corrupt: drop the last word of the payload, and shift a word between streams
        bad = []
        for p, ln in ((cpay[:-2], clen),
                      (cpay, np.concatenate([[clen[0] - 2, clen[1] + 2], clen[2:]]))):
            try:
                tk.rans_decode_triton(p, ln, ms.cum, ms.model_index, L, T, C, G, Bv,
                                      device=device)
                bad.append(False)
            except CodecError:
                bad.append(True)
        checks[f"corrupt_rejected_{tag}"] = all(bad)
        hk = tk.histogram_triton(tsk)
        checks[f"histogram_equal_{tag}"] = np.array_equal(hk.cpu().numpy(), prob.histograms(sk))
    # quantization: Triton on the GPU vs the torch reference on the CPU
    g = torch.Generator().manual_seed(1)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        T, H, D = (9, 2, 8) if tiny else (333, 4, 64)
        x = (torch.randn(3, T, H, D, generator=g) * 3).to(dt)
        x[0, 7] = 0
        m = Q.max_levels([32, 16, 10])
        x3 = x.reshape(3, T, H * D)
        for name, xx, sc in (("token", x3, Q.row_scales(x3)), ("head", x, Q.row_scales(x)),
                             ("channel", x3, Q.row_scales(x3, dim=1))):
            ref = Q.quantize(xx, sc, m)
            got = tk.quantize_triton(xx.to(device), sc.to(device), m).cpu()
            checks[f"quantize_{name}_{str(dt)[6:]}"] = bool(torch.equal(ref, got))
            dq = tk.dequantize_triton(ref.to(device), sc.to(device), m, out_dtype=dt).cpu()
            checks[f"dequantize_{name}_{str(dt)[6:]}"] = bool(
                torch.equal(dq, Q.dequantize(ref, sc, m).to(dt)))
    return checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Triton codec GPU check (correctness + speed)")
    flags.add_quick(ap, help="1K tokens instead of 4K in the speed part")
    flags.add_repeats(ap, default=5)
    flags.add_out(ap, help="also write the results here (JSON, atomically)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes everywhere (smoke run under TRITON_INTERPRET=1 on a CPU)")
    a = ap.parse_args(argv)
    from bench import triton as tb
    from codec.triton import kernels as tj
    from codec.triton import ops as tk

    if not tj.available() or (a.device == "cuda" and not torch.cuda.is_available()):
        print("gpu_check: no usable Triton/CUDA here", file=sys.stderr)
        return 2
    env = tb.environment(a.device)
    print("environment:", json.dumps(env), flush=True)
    t0 = time.time()
    try:
        checks = correctness(a.device, tiny=a.tiny)
    except Exception:  # report and go on to the speed part
        traceback.print_exc()
        checks = {"correctness_ran": False}
    print(f"correctness: {sum(checks.values())}/{len(checks)} ok in {time.time() - t0:.1f} s",
          flush=True)
    for k, v in checks.items():
        if not v:
            print("  FAILED", k)
    t0 = time.time()
    if a.tiny:
        res = tb.run(a.device, L=2, T=24, H=2, D=4, layouts=((4, None), (1, 8)), reps=1)
    else:
        res = tb.run(a.device, T=1024 if a.quick else tb.TOKENS_7B, reps=a.repeats,
                     extra_blocks=(32, 128))
    print(f"speed part: {time.time() - t0:.1f} s", flush=True)
    res["env"] = env
    res["correctness"] = checks
    if a.out:
        atomic_write_json(a.out, res, indent=1)
    ok = all(checks.values()) and all(res["checks"].values())
    print()
    print(f"== Triton codec on {env.get('gpu', a.device)} | torch {env['torch']} | triton "
          f"{env['triton']} | {env['date']} | 7B-shaped KV L={res['shape']['L']} "
          f"T={res['shape']['T']} H={res['shape']['H']} D={res['shape']['D']} "
          f"({res['fp16_bytes'] / 1e6:.0f} MB fp16) ==")
    print(f"correctness vs CPU backend: {'ALL OK' if all(checks.values()) else 'FAILED'} "
          f"({len(checks)} checks)")
    print(tb.format_table(res))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
