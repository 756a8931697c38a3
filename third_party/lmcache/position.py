"""Where an LMCache object sits in its context, from its KV alone (an MP-mode ``ObjectKey``
holds no position): whether it starts a context, so that only those objects keep
attention-sink tokens (:func:`starts_context`), and for kvtc's pre-RoPE transform, the
position of its first token estimated from its keys' RoPE phase (:func:`estimate_offset`).

Sink tokens. Our codecs store the first ``sink_tokens`` (4) tokens of a CONTEXT exactly (attention
sinks: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024;
``codec.config``, ``codec.kvtc``). Our own store path knows each chunk's position
(``codec.encode_chunks``: only the chunk at token 0 keeps them). An LMCache serde is not
told it: an MP-mode ``ObjectKey`` holds ``chunk_hash``, ``model_name``, ``kv_rank``,
``object_group_id`` and ``cache_salt``, no position. Coding every object as its own
context keeps 4 exact tokens per 256-token object: measured on the default model's 4K
pydoc context, 11.4% of cachegen level 1's bytes and 23.6% of kvtc level 4's
(docs/lmcache.md, "Sink tokens").

The rule (serde option ``sinks: "auto"``, the default): an object starts a context when
its first token's value vectors are short: the mean over layers and KV heads of
``||v[l, 0, h, :]||_2`` is below ``SINK_NORM_RATIO`` (0.5) times the median over the
object's tokens of the same mean. Measured (docs/lmcache.md): the token at position 0
gives 0.27-0.30 on SmolLM2-135M (pydoc, needle, LongChat contexts) and Gemma 3 270M
(pydoc, with BOS); the first token of every other 256-token chunk gives >= 0.71. A miss
in the other direction (a chunk whose first token happens to be short) only costs the 4
exact tokens. Objects shorter than ``MIN_TOKENS`` and single-plane (MLA / fused) layouts,
where the rule was not measured, keep the sinks (the old behaviour); ``sinks:
"every_object"`` keeps them in every object.

Positions (kvtc). A kvtc calibration with ``key_space`` "pre_rope" decorrelates keys with RoPE undone
(``codec.kvtc``), so an encode must know each token's position. Our store path knows it
(``codec.encode_chunks``); an LMCache serde is not told it (an MP-mode ``ObjectKey`` holds
no position), and coding every object at position 0 undoes RoPE at the wrong angles:
measured on the default model's 4K pydoc context in 256-token objects, kvtc level 4 then
needs 10.5% more bytes than at the true positions (docs/lmcache.md, "Positions").

Estimate (rotate-half RoPE, frequencies ``w_j = theta ** (-2 j / D)``, ``j < D / 2``): with
a key pair as the complex number ``z = k[j] + i k[j + D/2]``, a key at position ``p`` is
``z_pre * exp(i w_j p)``. For an object of T tokens whose first token is at ``p0``,
``m_j = mean_t z_t exp(-i w_j t)`` is ``exp(i w_j p0)`` times the mean pre-RoPE key, which
the calibration holds (``mean``). The estimate is the candidate ``p`` (a multiple of
``step``, LMCache's chunk size, up to ``max_tokens - T``) maximising
``sum_{l, h, j} Re(conj(mu_{l,h,j}) m_{l,h,j} exp(-i w_j p))``: the angle at which the
object's mean key lines up with the calibration's. Measured: every 256-token chunk of 4K
pydoc and LongChat contexts and 2K needle contexts of the default model found at its true
position among 32 candidates (0..7936), the best score 28-30% above the next. A wrong
estimate costs bytes, never correctness: the position used is recorded in the container
and the decode re-applies RoPE at it.
"""
from __future__ import annotations

import math

import torch

SINK_NORM_RATIO = 0.5
MIN_TOKENS = 16
SINK_MODES = ("auto", "every_object")


def starts_context(v: torch.Tensor) -> bool:
    """Whether an object whose values are ``v`` [L, T, H, D] (any float dtype, CPU) looks
    like the start of a context (see the module docstring). ``T < MIN_TOKENS`` or
    all-zero values: True (keep the sinks). Raises ValueError for another rank."""
    if v.dim() != 4:
        raise ValueError(f"values must be [L, T, H, D], got {tuple(v.shape)}")
    if v.shape[1] < MIN_TOKENS:
        return True
    norms = v.float().norm(dim=-1).mean(dim=(0, 2))          # [T]
    med = float(norms.median())
    if not med > 0.0:
        return True
    return float(norms[0]) < SINK_NORM_RATIO * med


def key_means(cal) -> torch.Tensor:
    """The calibration's mean pre-RoPE key as [L, H, D] float64 (kvtc's ``mean``: [2, L, C],
    or [NG, 2 G C] with ``group_layers`` G, features (K, V) per layer of the group)."""
    L, H, D = cal.num_layers, cal.num_heads, cal.head_dim
    C = H * D
    mean = torch.as_tensor(cal.mean, dtype=torch.float64)
    G = int(getattr(cal, "group_layers", 0) or 0)
    if G > 0:
        rows = [mean[l // G, 2 * C * (l % G): 2 * C * (l % G) + C] for l in range(L)]
        return torch.stack(rows).reshape(L, H, D)
    return mean[0].reshape(L, H, D)


def estimate_offset(k: torch.Tensor, cal, step: int, max_tokens: int) -> int:
    """The estimated position of ``k``'s first token (``k`` [L, T, H, D], any float dtype):
    a multiple of ``step`` in ``[0, max_tokens - T]``; 0 when the calibration's keys are not
    pre-RoPE (nothing to align) or no candidate aligns (every score <= 0).
    Raises ValueError when ``k`` does not match the calibration's shape."""
    L, T, H, D = k.shape
    if (L, H, D) != (cal.num_layers, cal.num_heads, cal.head_dim):
        raise ValueError(f"keys {tuple(k.shape)} do not match the calibration's "
                         f"{cal.num_layers} layers x {cal.num_heads} heads x {cal.head_dim}")
    if cal.key_space != "pre_rope" or not cal.rope_theta > 0 or D % 2 or T < 1:
        return 0
    n = max(0, max_tokens - T) // step + 1
    half = D // 2
    w = cal.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / D)     # [D/2]
    mu = key_means(cal)
    muz = torch.complex(mu[..., :half], mu[..., half:])                            # [L, H, D/2]
    kf = k.to(torch.float64)
    z = torch.complex(kf[..., :half], kf[..., half:])                              # [L, T, H, D/2]
    t = torch.arange(T, dtype=torch.float64)
    m = (z * torch.exp(-1j * w[None, None, None] * t[None, :, None, None])).mean(1)
    a = (muz.conj() * m).sum(dim=(0, 1))                                           # [D/2]
    p = torch.arange(n, dtype=torch.float64) * step
    score = (a[None] * torch.exp(-1j * w[None] * p[:, None])).real.sum(1)          # [n]
    best = int(score.argmax())
    if not math.isfinite(float(score[best])) or float(score[best]) <= 0.0:
        return 0
    return best * step
