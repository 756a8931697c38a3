"""The Triton kernel sources of the codec (codec.triton.ops) and their compilation.

Purpose: the GPU kernels themselves - quantization / dequantization, per-(layer,
channel) histograms, the two-pass rANS encoder and the rANS decoder (docs/gpu.md, and
the design notes of codec/triton/ops.py) - as plain functions jitted on first use by
`kernel` (so TRITON_INTERPRET is read at call time and importing this module never needs
Triton), the launch helpers (`on_device`, `launch_opts`), the checks of where the kernels can
run (`interpreting`, `available`, `resolve_backend`, `require_device`), and
`compile_for_target`, the ahead-of-time compile check that needs no GPU. Kernels read
only constexpr globals of this module (`K_*`, `tl`). The Python wrappers that launch
these kernels are codec/triton/ops.py's.

Run the tests (CPU, interpreter):
  TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/codec/test_codec_triton.py -q
"""
from __future__ import annotations

import contextlib
import functools
import os
import types

import torch

try:  # Triton is optional: the CPU backend never needs it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - e.g. a CPU-only install without triton
    triton = None
    tl = None
    HAVE_TRITON = False

# The coder's constants and error codes: codec.entropy.rans_spec (docs/bitstream.md sections 2-4).
from ..entropy.rans_spec import (ERR_FINAL, ERR_INTERNAL, ERR_LEFTOVER, ERR_OK, ERR_STATE,  # noqa: E402
                        ERR_SYMBOL, ERR_TRUNCATED, PROB_SCALE, RANS_L)

# Lanes (streams) per program for the rANS kernels. On a GPU one lane is one thread
# (num_warps * 32 == BLOCK); small in the interpreter where each step is a numpy op.
RANS_BLOCK_GPU = 64
RANS_WARPS_GPU = 2
RANS_BLOCK_INTERP = 16


# Constants seen by the kernels: Triton only lets a kernel read constexpr globals.
_constexpr = tl.constexpr if HAVE_TRITON else (lambda v: v)
K_RANS_L = _constexpr(RANS_L)
K_PROB_SCALE = _constexpr(PROB_SCALE)
K_ERR_OK = _constexpr(ERR_OK)
K_ERR_STATE = _constexpr(ERR_STATE)
K_ERR_TRUNCATED = _constexpr(ERR_TRUNCATED)
K_ERR_FINAL = _constexpr(ERR_FINAL)
K_ERR_LEFTOVER = _constexpr(ERR_LEFTOVER)
K_ERR_SYMBOL = _constexpr(ERR_SYMBOL)
K_ERR_INTERNAL = _constexpr(ERR_INTERNAL)


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """Triton importable AND (a CUDA device present OR TRITON_INTERPRET=1)."""
    if not HAVE_TRITON:
        return False
    return interpreting() or torch.cuda.is_available()


def resolve_backend(device, backend: str = "auto") -> str:
    """Which entropy/quantization backend to use for tensors on `device`.

    backend: "auto" -> "triton" when the device is CUDA and `available()`, else "cpu";
      "cpu" -> "cpu" (always possible: tensors are copied to the host);
      "triton" -> "triton", or ValueError when Triton cannot run here.
    Both backends produce identical bytes, so this is a speed choice only.
    """
    dev = torch.device(device)
    if backend == "cpu":
        return "cpu"
    if backend == "triton":
        if not available() or (dev.type != "cuda" and not interpreting()):
            raise ValueError(f"backend='triton' needs Triton and a CUDA device (got {dev}); "
                             "use backend='cpu' or 'auto'")
        return "triton"
    if backend != "auto":
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'cpu' or 'triton'")
    return "triton" if dev.type == "cuda" and available() else "cpu"


def require_device(*tensors: torch.Tensor) -> torch.device:
    """Check that the kernels can run on these tensors; return their device."""
    if not HAVE_TRITON:
        raise RuntimeError("Triton is not installed; use the CPU backend (backend='cpu')")
    devs = {t.device for t in tensors}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
    dev = devs.pop()
    if interpreting():
        if dev.type != "cpu":
            raise ValueError("under TRITON_INTERPRET=1 the Triton kernels take CPU tensors")
    elif dev.type != "cuda":
        raise ValueError(f"Triton kernels need CUDA tensors (got {dev}); use the CPU backend "
                         "or set TRITON_INTERPRET=1")
    return dev


# ---------------------------------------------------------------------------------------
# Kernels. Plain functions, jitted on first use (so TRITON_INTERPRET is read at call time,
# and importing this module never needs Triton).
# ---------------------------------------------------------------------------------------
def _layer_block(N, BLOCK: tl.constexpr):
    """(layer = program_id(1) as int64, element indices n of block program_id(0) (int32:
    N < 2^31, checked by the wrappers), n < N): a device function of the elementwise
    kernels, grid (cdiv(N, BLOCK), L)."""
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return tl.program_id(1).to(tl.int64), n, n < N


def _quantize_kernel(x_ptr, inv_ptr, m_ptr, out_ptr, N, S, DIV, MOD,
                     BLOCK: tl.constexpr):
    """x [L, N] (any float dtype) -> uint8 symbols [L, N].

    inv: float32 [L, S], element n of layer l uses inv[l, (n // DIV) % MOD].
    m: float32 [L], M = bins // 2 - 1. sym = clamp(rint(x32 * inv), -M, M) + M.
    Grid: (cdiv(N, BLOCK), L).
    """
    layer, n, mask = _layer_block(N, BLOCK)
    x = tl.load(x_ptr + layer * N + n, mask=mask, other=0.0).to(tl.float32)
    inv = tl.load(inv_ptr + layer * S + (n // DIV) % MOD, mask=mask, other=0.0)
    m = tl.load(m_ptr + layer)
    v = x * inv
    a = tl.minimum(tl.abs(v), m + 1.0)          # rint is monotone: clamp first is exact
    r = tl.floor(a)
    d = a - r                                    # exact for a >= 0
    ri = r.to(tl.int32)
    up = (d > 0.5) | ((d == 0.5) & ((ri & 1) == 1))   # round half to even
    ri = tl.minimum(ri + up.to(tl.int32), m.to(tl.int32))
    q = tl.where(v < 0, -ri, ri) + m.to(tl.int32)
    tl.store(out_ptr + layer * N + n, q.to(tl.uint8), mask=mask)


def _dequantize_kernel(sym_ptr, step_ptr, m_ptr, out_ptr, N, S, DIV, MOD,
                       OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """uint8 symbols [L, N] -> (float32(sym) - M) * step[l, (n // DIV) % MOD], cast to
    out's dtype (round to nearest even). OUT_BF16: out is an int16 view of a bfloat16
    tensor and the rounding is done on the bits (the interpreter truncates otherwise).
    Grid: (cdiv(N, BLOCK), L)."""
    layer, n, mask = _layer_block(N, BLOCK)
    s = tl.load(sym_ptr + layer * N + n, mask=mask, other=0).to(tl.float32)
    step = tl.load(step_ptr + layer * S + (n // DIV) % MOD, mask=mask, other=0.0)
    m = tl.load(m_ptr + layer)
    y = (s - m) * step
    if OUT_BF16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)          # RNE to the top 16 bits
        tl.store(out_ptr + layer * N + n, (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True),
                 mask=mask)
    else:
        tl.store(out_ptr + layer * N + n, y.to(out_ptr.dtype.element_ty), mask=mask)


def _histogram_kernel(sym_ptr, out_ptr, T, C,
                      BT: tl.constexpr, BC: tl.constexpr, NB: tl.constexpr):
    """sym uint8 [L, T, C] -> counts int32 [L, C, NB] (symbols must be < NB).

    One program per (BC channels, layer); it walks the tokens in [BT, BC] tiles and
    accumulates a register histogram of BC * NB bins (key = channel * NB + symbol), so
    there are no atomics. Grid: (cdiv(C, BC), L).
    """
    pc = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    c = pc * BC + tl.arange(0, BC)                      # [BC]
    cmask = c < C
    acc = tl.zeros((BC * NB,), dtype=tl.int32)
    base = sym_ptr + layer * T * C
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)                       # [BT]
        m2 = (t[:, None] < T) & cmask[None, :]
        s = tl.load(base + t[:, None].to(tl.int64) * C + c[None, :], mask=m2, other=0)
        key = tl.arange(0, BC)[None, :] * NB + s.to(tl.int32)     # [BT, BC]
        key = tl.where(m2, key, 0)              # masked-out elements land in bin 0 ...
        acc += tl.histogram(tl.reshape(key, (BT * BC,)), BC * NB)
        n_out = BT * BC - tl.sum(tl.sum(m2.to(tl.int32), axis=1), axis=0)
        acc -= tl.where(tl.arange(0, BC * NB) == 0, n_out, 0)   # ... and are taken out
        # (histogram's mask= argument is missing from older Triton releases)
    k = tl.arange(0, BC * NB)
    cc = pc * BC + k // NB
    tl.store(out_ptr + (layer * C + cc) * NB + k % NB, acc, mask=cc < C)


def _stream_lanes(kvl, k_ptr, v_ptr, L, T, C, G, B, n_groups, n_blocks, BLOCK: tl.constexpr):
    """The lanes of a rANS program (a device function of both rANS kernels): for (kv *
    L + layer) = kvl, channel groups g = program_id(0) * BLOCK + lane and token block
    b = program_id(1): (lane valid, stream index (section 3 order), first token, tokens,
    first channel, channels, the layer's [T, C] in k_ptr / v_ptr (by kv) [L, T, C], the
    (kv, layer)'s offset in the model index [2, L, C])."""
    b = tl.program_id(1)
    kv = kvl // L
    layer = kvl - kv * L
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    stream = (kvl.to(tl.int64) * n_groups + g) * n_blocks + b
    t0 = b * B
    c0 = g * G
    sym_base = layer.to(tl.int64) * T * C
    if kv == 0:
        ptr = k_ptr + sym_base
    else:
        ptr = v_ptr + sym_base
    return (g < n_groups, stream, t0, tl.minimum(B, T - t0), c0, tl.minimum(G, C - c0), ptr,
            kvl.to(tl.int64) * C)


def _rans_encode_kernel(sym_k_ptr, sym_v_ptr, midx_ptr, cum_ptr, woff_ptr, words_ptr,
                        nwords_ptr, err_ptr, L, T, C, G, B, n_groups, n_blocks,
                        WRITE: tl.constexpr, BLOCK: tl.constexpr):
    """rANS-encode BLOCK streams (docs/bitstream.md section 2), one per lane.

    Program (pid0, b, kvl): lanes are channel groups g = pid0 * BLOCK + lane of the
    (kv, layer) = divmod(kvl, L) and token block b. Stream index
    i = (kvl * n_groups + g) * n_blocks + b (section 3 order).
    sym_*: uint8 [L, T, C]; midx: int32 [2, L, C]; cum: int32 [n_models, 257].
    WRITE=False (pass 1): nwords[i] = 2 + renormalisation words, err[i] = 6 on a
    zero-frequency symbol. WRITE=True (pass 2): words (int16 view of the payload) receive
    the stream in [woff[i], woff[i + 1]) written backwards; err[i] = 7 if the slot is
    not filled exactly.
    """
    kvl = tl.program_id(2)
    lane, stream, t0, bsize, c0, gsize, sym_ptr, midx_base = _stream_lanes(
        kvl, sym_k_ptr, sym_v_ptr, L, T, C, G, B, n_groups, n_blocks, BLOCK)
    x = tl.full((BLOCK,), K_RANS_L, dtype=tl.uint32)
    nw = tl.zeros((BLOCK,), dtype=tl.int32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    if WRITE:
        start = tl.load(woff_ptr + stream, mask=lane, other=0)
        pos = tl.load(woff_ptr + stream + 1, mask=lane, other=0)
    for jj in range(0, G):
        j = G - 1 - jj                                   # channels in reverse
        act = lane & (j < gsize)
        c = c0 + j
        mdl = tl.load(midx_ptr + midx_base + c, mask=act, other=0)
        row = cum_ptr + mdl.to(tl.int64) * 257
        for tt in range(0, bsize):
            t = t0 + bsize - 1 - tt                      # tokens in reverse
            s = tl.load(sym_ptr + t.to(tl.int64) * C + c, mask=act, other=0).to(tl.int32)
            lo = tl.load(row + s, mask=act, other=0)
            hi = tl.load(row + s + 1, mask=act, other=1)
            f = hi - lo
            bad = tl.where(act & (f <= 0), K_ERR_SYMBOL, bad)
            fu = tl.maximum(f, 1).to(tl.uint32)
            ren = act & (x >= (fu << 16))
            if WRITE:
                pos = pos - ren.to(tl.int64)
                tl.store(words_ptr + pos, (x & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True),
                         mask=ren)
            nw += ren.to(tl.int32)
            x = tl.where(ren, x >> 16, x)
            xn = ((x // fu) << 16) + (x % fu) + lo.to(tl.uint32)
            x = tl.where(act, xn, x)
    if WRITE:
        pos = pos - 1
        tl.store(words_ptr + pos, (x >> 16).to(tl.uint16).to(tl.int16, bitcast=True), mask=lane)
        pos = pos - 1
        tl.store(words_ptr + pos, (x & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=lane)
        bad = tl.where(lane & (pos != start), K_ERR_INTERNAL, bad)
    else:
        tl.store(nwords_ptr + stream, nw + 2, mask=lane)
    tl.store(err_ptr + stream, bad, mask=lane)


def _rans_decode_kernel(words_ptr, woff_ptr, midx_ptr, cum_ptr, out_k_ptr, out_v_ptr,
                        err_ptr, kvl_ptr, L, T, C, G, B, n_groups, n_blocks,
                        SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
                        SCAN: tl.constexpr = False):
    """rANS-decode BLOCK streams, one per lane (same program/lane mapping as the encoder).

    words: int16 view of the payload; stream i occupies words [woff[i], woff[i + 1])
    (host-validated: >= 2 words). Symbol lookup: the largest s < NB = 2^SEARCH_STEPS with
    cum[s] <= slot (rows are padded with M past nbins, and nbins <= NB), either
    SCAN=False: a branch-free binary search, SEARCH_STEPS dependent gathers per symbol; or
    SCAN=True: the lane's row cum[1..NB] is loaded into NB registers once per channel and
    each symbol is NB compare/selects over them (no memory access; for NB <= 64).
    err[i]: 0 ok, 2 x < L at start, 3 truncated, 4 final state != L, 5 leftover words.
    Reads never leave the stream's own slot.
    kvl: int32 list of the (kv * L + layer) indices this launch covers (program_id(2)
    indexes it), so layers with small alphabets get a launch with a small NB.
    """
    kvl = tl.load(kvl_ptr + tl.program_id(2))
    lane, stream, t0, bsize, c0, gsize, out_ptr, midx_base = _stream_lanes(
        kvl, out_k_ptr, out_v_ptr, L, T, C, G, B, n_groups, n_blocks, BLOCK)
    start = tl.load(woff_ptr + stream, mask=lane, other=0)
    end = tl.load(woff_ptr + stream + 1, mask=lane, other=2)
    w0 = tl.load(words_ptr + start, mask=lane, other=0).to(tl.int32) & 0xFFFF
    w1 = tl.load(words_ptr + start + 1, mask=lane, other=1).to(tl.int32) & 0xFFFF
    x = (w0 | (w1 << 16)).to(tl.uint32)
    bad_state = lane & (x < K_RANS_L)
    pos = start + 2
    for j in range(0, G):
        act = lane & (j < gsize)
        c = c0 + j
        mdl = tl.load(midx_ptr + midx_base + c, mask=act, other=0)
        row = cum_ptr + mdl.to(tl.int64) * 257
        if SCAN:
            # the lane's cum[1..NB] as a tuple of NB per-lane registers (a 2D tile would
            # force shared-memory layout conversions inside the symbol loop)
            upper = ()
            for k in tl.static_range(1 << SEARCH_STEPS):
                upper = upper + (tl.load(row + 1 + k, mask=act, other=K_PROB_SCALE),)
        for tt in range(0, bsize):
            t = t0 + tt
            slot = (x & 0xFFFF).to(tl.int32)
            if SCAN:
                s = tl.zeros((BLOCK,), dtype=tl.int32)
                lo = tl.zeros((BLOCK,), dtype=tl.int32)
                hi = tl.full((BLOCK,), K_PROB_SCALE, dtype=tl.int32)
                for k in tl.static_range(1 << SEARCH_STEPS):
                    u = upper[k]                             # cum[k + 1]
                    le = u <= slot                           # <=> s > k
                    s += le.to(tl.int32)
                    lo = tl.where(le, u, lo)                 # -> cum[s]
                    hi = tl.where(le, hi, tl.minimum(hi, u))  # -> cum[s + 1]
            else:
                s = tl.zeros((BLOCK,), dtype=tl.int32)
                lo = tl.zeros((BLOCK,), dtype=tl.int32)     # cum[s], cum[0] = 0
                for k in tl.static_range(SEARCH_STEPS):
                    cand = s + (1 << (SEARCH_STEPS - 1 - k))
                    v = tl.load(row + cand, mask=act, other=K_PROB_SCALE)
                    take = v <= slot
                    s = tl.where(take, cand, s)
                    lo = tl.where(take, v, lo)
                hi = tl.load(row + s + 1, mask=act, other=K_PROB_SCALE)
            xn = (hi - lo).to(tl.uint32) * (x >> 16) + (slot - lo).to(tl.uint32)
            need = act & (xn < K_RANS_L)
            w = tl.load(words_ptr + pos, mask=need & (pos < end), other=0).to(tl.int32) & 0xFFFF
            xn = tl.where(need, (xn << 16) | w.to(tl.uint32), xn)
            pos = pos + need.to(tl.int64)
            x = tl.where(act, xn, x)
            tl.store(out_ptr + t.to(tl.int64) * C + c, s.to(tl.uint8), mask=act)
    err = tl.where(pos > end, K_ERR_TRUNCATED,
                   tl.where(x != K_RANS_L, K_ERR_FINAL, tl.where(pos != end, K_ERR_LEFTOVER, K_ERR_OK)))
    err = tl.where(bad_state, K_ERR_STATE, err)
    tl.store(err_ptr + stream, err, mask=lane)


_DEVICE_FUNCTIONS = ("_layer_block", "_stream_lanes")   # called by kernels: jitted in the kernel's mode


def _with_device_functions(name: str, interp: bool):
    """Kernel `name` as a function whose globals hold its device functions jitted for the
    mode (the interpreter calls InterpretedFunctions, the compiler JITFunctions; a
    module-level decoration would fix one mode at import)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrap = InterpretedFunction if interp else JITFunction
    g = dict(globals(), **{d: wrap(globals()[d]) for d in _DEVICE_FUNCTIONS})
    fn = globals()[name]
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


@functools.lru_cache(maxsize=None)
def _jit(name: str, interp: bool):
    """triton.jit the kernel `name` (cached per interpreter mode)."""
    if not HAVE_TRITON:  # pragma: no cover
        raise RuntimeError("Triton is not installed")
    return triton.jit(_with_device_functions(name, interp))


def kernel(name: str):
    return _jit(name, interpreting())


def on_device(dev: torch.device):
    """Launch context: Triton launches on the CURRENT CUDA device, so make it `dev`
    (tensors on cuda:1 must not be processed by a kernel running on cuda:0)."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def launch_opts(num_warps: int = 4) -> dict:
    # fp fusion off everywhere: the quantizer needs x * inv rounded before rint, and the
    # integer kernels do not care (it also silences Triton 3.9's default-change warning)
    return {} if interpreting() else {"num_warps": num_warps, "enable_fp_fusion": False}


def compile_for_target(arch: int = 90, warp_size: int = 32) -> dict[str, str]:
    """Ahead-of-time compile every kernel variant for a CUDA target WITHOUT a GPU (Triton's
    frontend + LLVM + the bundled ptxas): catches compile-only errors (non-constexpr
    globals, type errors) that the interpreter accepts. Returns {variant: PTX text}.
    Raises whatever Triton raises on a kernel that does not compile."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, warp_size)
    i32 = "i32"
    ints = {k: i32 for k in ("L", "T", "C", "G", "B", "n_groups", "n_blocks")}
    variants = {}
    for xt in ("fp32", "fp16", "bf16"):
        variants[f"quantize_{xt}"] = ("_quantize_kernel", dict(
            x_ptr=f"*{xt}", inv_ptr="*fp32", m_ptr="*fp32", out_ptr="*u8", N=i32, S=i32,
            DIV=i32, MOD=i32, BLOCK="constexpr"), dict(BLOCK=1024), 4)
    for ot, bf in (("fp32", False), ("fp16", False), ("i16", True)):
        variants[f"dequantize_{ot}"] = ("_dequantize_kernel", dict(
            sym_ptr="*u8", step_ptr="*fp32", m_ptr="*fp32", out_ptr=f"*{ot}", N=i32, S=i32,
            DIV=i32, MOD=i32, OUT_BF16="constexpr", BLOCK="constexpr"),
            dict(OUT_BF16=bf, BLOCK=1024), 4)
    for nb in (32, 256):
        variants[f"histogram_nb{nb}"] = ("_histogram_kernel", dict(
            sym_ptr="*u8", out_ptr="*i32", T=i32, C=i32, BT="constexpr", BC="constexpr",
            NB="constexpr"), dict(BT=128, BC=1024 // nb, NB=nb), 4)
    for write in (False, True):
        variants[f"rans_encode_write{int(write)}"] = ("_rans_encode_kernel", dict(
            sym_k_ptr="*u8", sym_v_ptr="*u8", midx_ptr="*i32", cum_ptr="*i32",
            woff_ptr="*i64" if write else "*i32", words_ptr="*i16" if write else "*i32",
            nwords_ptr="*i32", err_ptr="*i32", **ints, WRITE="constexpr", BLOCK="constexpr"),
            dict(WRITE=write, BLOCK=RANS_BLOCK_GPU), RANS_WARPS_GPU)
    for steps, scan in ((4, False), (8, False), (5, True)):
        variants[f"rans_decode_steps{steps}" + ("_scan" if scan else "")] = (
            "_rans_decode_kernel", dict(
                words_ptr="*i16", woff_ptr="*i64", midx_ptr="*i32", cum_ptr="*i32",
                out_k_ptr="*u8", out_v_ptr="*u8", err_ptr="*i32", kvl_ptr="*i32", **ints,
                SEARCH_STEPS="constexpr", BLOCK="constexpr", SCAN="constexpr"),
            dict(SEARCH_STEPS=steps, BLOCK=RANS_BLOCK_GPU, SCAN=scan), RANS_WARPS_GPU)
    out = {}
    for vname, (kname, sig, consts, warps) in variants.items():
        # a compiled-mode JITFunction even under TRITON_INTERPRET=1
        fn = triton.runtime.jit.JITFunction(_with_device_functions(kname, False))
        src = ASTSource(fn, signature=sig, constexprs=consts)
        opts = {"num_warps": warps, "enable_fp_fusion": False}
        out[vname] = triton.compile(src, target=target, options=opts).asm["ptx"]
    return out
