"""Which LMCache objects start a context, so that only those keep attention-sink tokens.

Our codecs store the first ``sink_tokens`` (4) tokens of a CONTEXT exactly (attention
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
"""
from __future__ import annotations

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
