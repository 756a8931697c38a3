"""KVTC's rotary position embedding: the rotate-half RoPE the encoder undoes on keys of a
pre-RoPE calibration and the decoder redoes (torch reference), and its numba kernels for
the decode (float32 rows in place, bf16 rows into the output; ``None`` without numba).

Shapes: x float32 [L, T, H, D] (D even), positions int64 [T]; cos/sin tables [T, D/2]
float32. No I/O; part of the ``codec.kvtc`` package (see its docstring).
"""
from __future__ import annotations

import functools

import numpy as np
import torch


# ------------------------------------------------------------------------------ RoPE
def _rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [T, 1, D] of the rotate-half RoPE (Su et al., RoFormer, 2021, eq.
    34; the layout of HF transformers' LlamaRotaryEmbedding, computed the same way in
    float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None, :], emb.sin()[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x float32 [L, T, H, D] (D even) by RoPE at ``positions`` int64 [T]
    (same values as ``x * cos + rotate_half(x) * sin``, computed on the two halves)."""
    h = x.shape[-1] // 2
    cos, sin = _rope_cos_sin(positions, 2 * h, theta)
    sin_signed = torch.cat([-sin[..., :h], sin[..., h:]], dim=-1)      # [T, 1, D]
    out = x * cos                        # whole rows at once: contiguous, vectorised
    out.addcmul_(x.roll(h, dims=-1), sin_signed)   # roll = [x2, x1]: rotate_half up to sign
    return out


def undo_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Inverse of ``apply_rope`` (rotation by the negative angle)."""
    cos, sin = _rope_cos_sin(positions, x.shape[-1], theta)
    return x * cos - _rotate_half(x) * sin


def _rope_rows_py(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotate-half RoPE in place (RoFormer eq. 34; HF's layout): x float32 [T, H, D]
    (C-contiguous), cos/sin float32 [T, D/2]: [x1, x2] -> [x1 cos - x2 sin,
    x2 cos + x1 sin] per head, the same two products and one sum per value as
    ``apply_rope``. Compiled by numba (``rope_kernel``; nogil: the decode workers run
    it side by side); without numba ``inverse.inverse_layers`` uses torch ops instead."""
    T, H, D = x.shape
    h = D // 2
    for t in range(T):
        for hh in range(H):
            for j in range(h):
                a = x[t, hh, j]
                b = x[t, hh, j + h]
                c = cos[t, j]
                s = sin[t, j]
                x[t, hh, j] = a * c - b * s
                x[t, hh, j + h] = b * c + a * s


def _rope_bf16_py(src: np.ndarray, dst: np.ndarray, cos: np.ndarray, sin: np.ndarray
                  ) -> None:
    """``_rope_rows_py`` on bf16 rows given as their bit patterns: src, dst uint16 [T, H, D]
    (C-contiguous), cos/sin float32 [T, D/2]. Each value is widened to float32 exactly,
    rotated with the same two products and one sum, and rounded to the nearest bf16 (ties
    to even), i.e. the same bits as widening, ``_rope_rows_py`` and a torch cast, without
    the two float32 copies. Compiled by numba (``rope_bf16_kernel``)."""
    T, H, D = src.shape
    h = D // 2
    xb = np.empty((H, D), np.uint32)
    yb = np.empty((H, D), np.float32)
    x = xb.view(np.float32)
    y = yb.view(np.uint32)
    for t in range(T):
        for hh in range(H):
            for d in range(D):
                xb[hh, d] = np.uint32(src[t, hh, d]) << np.uint32(16)
        for hh in range(H):
            for j in range(h):
                a = x[hh, j]
                b = x[hh, j + h]
                c = cos[t, j]
                s = sin[t, j]
                yb[hh, j] = a * c - b * s
                yb[hh, j + h] = b * c + a * s
        for hh in range(H):
            for d in range(D):
                v = y[hh, d]
                dst[t, hh, d] = np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16))
                                                                  & np.uint32(1))) >> np.uint32(16))


_ROPE_KERNEL = None
_ROPE_BF16_KERNEL = None


@functools.lru_cache(maxsize=32)
def rope_tables(start: int, T: int, D: int, theta: float) -> tuple:
    """RoPE tables of positions [start, start + T) for the decode, cached (a context's
    chunks start at the same positions every time; computing them costs little, but as
    small multi-threaded torch ops on a busy machine it cost up to ~40 ms per chunk):
    cos [T, 1, D] and signed sin [T, 1, D] float32 tensors (the torch fallback), cos and
    sin float32 [T, D/2] read-only numpy arrays (the numba kernels). At most 32 entries
    (~8 MB at T = 1024, D = 128)."""
    h = D // 2
    cos, sin = _rope_cos_sin(torch.arange(start, start + T), D, theta)
    cos_h, sin_h = cos[:, 0, :h].contiguous(), sin[:, 0, :h].contiguous()      # [T, h]
    cos_np, sin_np = cos_h.numpy(), sin_h.numpy()
    cos_np.setflags(write=False)
    sin_np.setflags(write=False)
    return (cos.contiguous(), torch.cat([-sin_h, sin_h], dim=-1)[:, None, :],
            cos_np, sin_np)


def _jit_or_false(fn):
    """``fn`` compiled by numba (nogil, cached on disk), or False without numba."""
    try:
        from numba import njit
        return njit(cache=True, nogil=True)(fn)
    except ImportError:  # pragma: no cover - numba is in requirements.txt
        return False


def rope_bf16_kernel():
    """The compiled ``_rope_bf16_py`` (numba, cached on disk), or None without numba."""
    global _ROPE_BF16_KERNEL
    if _ROPE_BF16_KERNEL is None:
        _ROPE_BF16_KERNEL = _jit_or_false(_rope_bf16_py)
    return _ROPE_BF16_KERNEL or None


def rope_kernel():
    """The compiled ``_rope_rows_py`` (numba, cached on disk; compiled on first use), or
    None without numba."""
    global _ROPE_KERNEL
    if _ROPE_KERNEL is None:
        _ROPE_KERNEL = _jit_or_false(_rope_rows_py)
    return _ROPE_KERNEL or None
