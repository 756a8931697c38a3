"""The kvtc decode's inverse transform: K/V rows [L, Tq, H, D] from the decoded symbols of
one level (per (K/V, layer) bases: ``inverse_layers``; a grouped calibration's joint bases:
``inverse_groups``), written into the caller's tensors, with RoPE redone for keys coded
before it; ``inverse_ref`` is the textbook path the fast ones are tested against
(tests/codec/test_kvtc_inverse.py). docs/codec.md sections 8.4 and 8.8.

Separate from codec.kvtc.codec (the header and the container) because it is the numeric
hot path of a decode: float32 / bf16 products split over the decode workers.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .. import scratch
from . import rope, workers
from .calibration import KvtcCalibration
from .kept import KeptSymbols
from .rope import apply_rope, rope_tables
from .workers import rows_view, split_over_workers


def inverse_layers(sym, offs: list, P: dict, kv: int, shape: tuple,
                   rope_from: Optional[int], theta: float,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """KV [L, Tq, H, D] from the symbols (uint8 [L, Tq, n] in the padded layout, or a
    ``KeptSymbols`` of the kept layout), written into ``out`` (any float dtype, e.g. a
    view of the model-dtype result; None = a new float32 tensor, returned either way).

    Per layer l (at its kept width n_l, dropped components are never multiplied):
    x = sym[:, :n_l] @ B_s[:n_l] + (mean - off * colsum(B_s)), one float32 ``addmm``
    with the step-scaled inverse basis B_s (x = (sym - off) * step @ B^T + mean).
    With centroid offsets (``P["shrink"]``) the coefficients are centred first and
    each non-zero one moved toward 0 by its component's offset:
    x = (q - shrink sign(q)) @ B_s^T + mean. Keys coded before RoPE
    (``rope_from`` = the first token's position; None = no RoPE) are rotated in place
    in that float32 layer (``_rope_rows_py``, a numba kernel: rotate-half RoPE,
    RoFormer eq. 34, [x1 cos - x2 sin, x2 cos + x1 sin] per head; torch ops without
    numba), then the layer is cast into ``out``. No full-size float32 intermediate: each
    worker casts one layer's kept symbol columns at a time into its own buffers.

    Threads: with one worker (``_decode_workers()``: max of torch's and numba's
    thread counts) the layers run in the calling thread; with more, the layers are
    split over ``_decode_pool()`` (Python threads, each running torch ops on one
    thread; torch releases the GIL), so the cores work on whole layers instead of
    synchronising many small parallel regions (a per-layer loop with 2 OpenMP
    threads collapsed ~8x on a busy machine; docs/codec.md section 8.4). Each layer's
    arithmetic is the same ops in the same order either way, so the bytes do not
    depend on the thread count. float32 rounding only: ``inverse_ref`` (the
    textbook path) agrees within float32 rounding (tests/codec/test_kvtc_inverse.py).
    bf16 products: with a bf16 ``out``, no centroid offsets and a CPU with bf16 dot
    products (``bf16_gemm``), the product is a bf16 ``addmm`` (float32 accumulation)
    of the exact integer coefficients q - off with the step-scaled basis and the mean
    rounded to bf16 (values written straight into ``out``; keys rotated by
    ``_rope_bf16_py`` on the bf16 bits: widened exactly, RoPE in float32, rounded
    once); error within eps_bf16 (|x| + |q| @ |B_s| + |mean|) of the float32 result
    (twice the pair's bound after RoPE; tests/codec/test_kvtc_inverse.py), 2-4x faster
    than the float32 product (docs/codec.md 8.4b).
    """
    L, Tq, H, D = shape
    C = H * D
    roped = rope_from is not None
    if out is None:
        out = scratch.empty((L, Tq, H, D), dtype=torch.float32)
    if L == 0 or Tq == 0:
        return out
    basis = P["basis_ts"][kv]                                         # [L, n, C]
    keep = P["keep"][kv]
    n = basis.shape[1]
    if isinstance(sym, KeptSymbols):
        pieces = sym.pieces
    else:
        symt = torch.from_numpy(np.ascontiguousarray(sym, np.uint8))  # [L, Tq, n]

        def pieces(layer):
            return [(0, keep[layer], symt[layer, :, :keep[layer]])]
    offt = torch.tensor(offs, dtype=torch.float32)
    shrink = P.get("shrink")
    if shrink is not None:
        shrink = shrink[kv]                                          # [L, 1, n]
        bias = P["mean"][kv, :, 0]                                   # [L, C]
    else:
        bias = P["mean"][kv, :, 0] - offt[:, None] * P["colsum"][kv]   # [L, C]
    h = D // 2
    kern = rope.rope_kernel() if roped else None
    # bf16 destination, integer coefficients (no centroid offsets) and a CPU with bf16
    # dot products: the product runs in bf16 with float32 accumulation (2-4x faster
    # than float32 here; the basis and mean are rounded to bf16 once, docs/codec.md 8.4b)
    bf16 = out.dtype == torch.bfloat16 and shrink is None and workers.bf16_gemm()
    if bf16:
        if "basis_ts_bf16" not in P:     # cached beside the float32 tensors
            P["basis_ts_bf16"] = P["basis_ts"].to(torch.bfloat16)
            P["mean_bf16"] = P["mean"][:, :, 0].to(torch.bfloat16)
        basis_h = P["basis_ts_bf16"][kv]                              # [L, n, C]
        mean_h = P["mean_bf16"][kv]                                   # [L, C]
    kern16 = rope.rope_bf16_kernel() if (bf16 and roped and kern is not None) else None
    if roped:
        cos_full, sin_signed, cos_np, sin_np = rope_tables(rope_from, Tq, D, theta)

    def layers(idx) -> None:
        with torch.inference_mode():    # a worker thread does not inherit the mode
            _layers(idx)

    def _layers(idx) -> None:
        x = scratch.empty((Tq, C), dtype=torch.float32)
        # the coefficient operands are flat buffers whose first Tq * nl elements are
        # viewed as a CONTIGUOUS [Tq, nl] matrix (never a column slice of [Tq, n]: on
        # AMX oneDNN's bf16 GEMM reads a row up to its stride, codec/scratch.py)
        qb = scratch.empty((Tq * n,), dtype=torch.bfloat16 if bf16 else torch.float32)
        xh = scratch.empty((Tq, C), dtype=torch.bfloat16) if bf16 else None
        q16 = scratch.empty((Tq * n,), dtype=torch.int16) if bf16 else None
        for layer in idx:
            nl = keep[layer]
            if bf16:
                # straight into the destination unless RoPE follows (then via float32)
                dst = out[layer].view(Tq, C) if not roped and out[layer].is_contiguous() \
                    else xh
                if nl:
                    q, qi = rows_view(qb, Tq, nl), rows_view(q16, Tq, nl)
                    for lo, hi, src in pieces(layer):
                        qi[:, lo:hi].copy_(src)
                    qi -= offs[layer]        # integer q = symbol - M (int16 ops are
                    q.copy_(qi)              # ~2x faster than bf16 ones); exact in bf16
                    torch.addmm(mean_h[layer], q, basis_h[layer, :nl], out=dst)
                else:
                    dst.copy_(mean_h[layer].expand(Tq, C))
                if not roped:
                    if dst is xh:
                        out[layer].copy_(xh.view(Tq, H, D))
                    continue
                if kern16 is not None and out[layer].is_contiguous():
                    kern16(xh.view(torch.int16).numpy().view(np.uint16).reshape(Tq, H, D),
                           out[layer].view(torch.int16).numpy().view(np.uint16),
                           cos_np, sin_np)
                    continue
                x.copy_(xh)
            elif nl:
                q = rows_view(qb, Tq, nl)
                for lo, hi, src in pieces(layer):    # symbols of the kept columns
                    q[:, lo:hi].copy_(src)
                if shrink is not None:
                    q -= offt[layer]
                    q.addcmul_(torch.sign(q), shrink[layer, :, :nl], value=-1.0)
                torch.addmm(bias[layer], q, basis[layer, :nl], out=x)
            else:
                x.copy_(bias[layer].expand(Tq, C))
            xv = x.view(Tq, H, D)
            if roped and kern is not None:
                kern(x.numpy().reshape(Tq, H, D), cos_np, sin_np)   # in place
            elif roped:   # no numba: the same arithmetic with torch ops
                xv = xv * cos_full + xv.roll(h, dims=-1) * sin_signed
            out[layer].copy_(xv)

    split_over_workers(layers, L)
    return out


def inverse_groups(sym: KeptSymbols, offs: list, P: dict, cal: KvtcCalibration,
                   shape: tuple, rope_from: Optional[int], out_k: torch.Tensor,
                   out_v: torch.Tensor) -> None:
    """K and V [L, Tq, H, D] of a grouped calibration from the symbols of its layer
    groups, written into ``out_k`` / ``out_v`` (views of the model-dtype result).

    Per group g: x = (sym - off) @ B_s[:n_g] + mean, one ``addmm`` [Tq, n_g] x [n_g,
    Cg] (bf16 with float32 accumulation for a bf16 destination on a CPU with bf16 dot
    products, ``bf16_gemm``; float32 otherwise), then each layer's V slice is copied
    out and its K slice rotated by RoPE from ``rope_from`` (None = no RoPE; the same
    numba kernels as ``inverse_layers``). Groups are split over ``_decode_pool()`` as
    ``inverse_layers`` splits layers; each group's arithmetic is the same whatever the thread
    count, so the result does not depend on it."""
    L, Tq, H, D = shape
    C = H * D
    if L == 0 or Tq == 0:
        return
    NG, G = cal.num_groups, cal.group_layers
    keep = P["keep"][0]
    basis = P["basis_ts"]                                              # [NG, n, Cg]
    n, Cg = basis.shape[1], basis.shape[2]
    roped = rope_from is not None
    bf16 = out_k.dtype == torch.bfloat16 and out_v.dtype == torch.bfloat16 and \
        workers.bf16_gemm()
    if bf16:
        if "basis_ts_bf16" not in P:
            P["basis_ts_bf16"] = P["basis_ts"].to(torch.bfloat16)
            P["mean_bf16"] = P["mean"][:, 0].to(torch.bfloat16)
        basis_h, mean_h = P["basis_ts_bf16"], P["mean_bf16"]
    else:
        offt = torch.tensor(offs, dtype=torch.float32)
        bias = P["mean"][:, 0] - offt[:, None] * P["colsum"]              # [NG, Cg]
    kern = rope.rope_kernel() if roped else None
    kern16 = rope.rope_bf16_kernel() if (bf16 and roped and kern is not None) else None
    if roped:
        cos_full, sin_signed, cos_np, sin_np = rope_tables(rope_from, Tq, D,
                                                            cal.rope_theta)
    h = D // 2

    def groups(idx) -> None:
        with torch.inference_mode():
            _groups(idx)

    def _groups(idx) -> None:
        xb = scratch.empty((Tq, Cg), dtype=torch.bfloat16 if bf16 else torch.float32)
        # flat operands viewed as contiguous [Tq, nl] (as in ``inverse_layers``)
        qb = scratch.empty((Tq * n,), dtype=torch.bfloat16 if bf16 else torch.float32)
        q16 = scratch.empty((Tq * n,), dtype=torch.int16) if bf16 else None
        kb = scratch.empty((Tq, C), dtype=xb.dtype) if roped else None
        kf = scratch.empty((Tq, C), dtype=torch.float32) if roped else None
        for g in idx:
            nl = keep[g]
            if nl:
                if bf16:
                    q, qi = rows_view(qb, Tq, nl), rows_view(q16, Tq, nl)
                    for lo, hi, src in sym.pieces(g):
                        qi[:, lo:hi].copy_(src)
                    qi -= offs[g]              # exact integers, exact in bf16
                    q.copy_(qi)
                    torch.addmm(mean_h[g], q, basis_h[g, :nl], out=xb)
                else:
                    q = rows_view(qb, Tq, nl)
                    for lo, hi, src in sym.pieces(g):
                        q[:, lo:hi].copy_(src)
                    torch.addmm(bias[g], q, basis[g, :nl], out=xb)
            else:
                xb.copy_((mean_h[g] if bf16 else P["mean"][g, 0]).expand(Tq, Cg))
            for j, layer in enumerate(cal.group_layer_ids(g)):
                ks = xb[:, 2 * j * C:(2 * j + 1) * C]
                out_v[layer].view(Tq, C).copy_(xb[:, (2 * j + 1) * C:(2 * j + 2) * C])
                ok = out_k[layer]
                if not roped:
                    ok.view(Tq, C).copy_(ks)
                    continue
                if kern16 is not None and ok.is_contiguous():
                    kb.copy_(ks)
                    kern16(kb.view(torch.int16).numpy().view(np.uint16).reshape(Tq, H, D),
                           ok.view(torch.int16).numpy().view(np.uint16), cos_np, sin_np)
                    continue
                kf.copy_(ks)
                if kern is not None:
                    kern(kf.numpy().reshape(Tq, H, D), cos_np, sin_np)
                    ok.copy_(kf.view(Tq, H, D))
                else:
                    xv = kf.view(Tq, H, D)
                    ok.copy_(xv * cos_full + xv.roll(h, dims=-1) * sin_signed)

    split_over_workers(groups, NG)


def inverse_ref(sym: np.ndarray, offs: list, P: dict, kv: int, shape: tuple,
                rope_from: Optional[int], theta: float) -> torch.Tensor:
    """Reference (textbook, slow) inverse of ``inverse_layers``, float32 [L, Tq, H, D]:
    coefficients c = (sym - off) (centroid: c - shrink sign(c)), x = (c * step) @ B^T
    + mean with the unscaled kept basis, then ``apply_rope`` from ``rope_from``. For
    tests and the decode benchmark only."""
    L, Tq, H, D = shape
    c = torch.from_numpy(np.ascontiguousarray(sym, np.uint8)).to(torch.float32)
    c = c - torch.tensor(offs, dtype=torch.float32)[:, None, None]
    if P.get("shrink") is not None:
        c = c - torch.sign(c) * P["shrink"][kv]
    x = torch.bmm(c * P["step"][kv], P["basis_t"][kv]) + P["mean"][kv]
    x = x.reshape(L, Tq, H, D)
    if rope_from is not None:
        x = apply_rope(x, torch.arange(rope_from, rope_from + Tq), theta)
    return x
