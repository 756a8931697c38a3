"""The fixed inputs of the codec digests (tests/codec/test_codec_digests.py, and the
version-4 digests of tests/codec/test_codec_bitstream_versions.py): a KV of small integers
times powers of two (``tests.helpers.kv.integer_kv``: numpy PCG64 integers, exact in
float16 and bfloat16 on every CPU), kvtc calibrations from fixed numbers (no fit) and the list of
(codec, level, dtype) cases. Changing any of it moves every digest at once."""
from __future__ import annotations

import numpy as np
import torch

import codec
from codec import kvtc
from tests.helpers.kv import integer_kv

L, T, H, D = 2, 192, 2, 64      # T = 192: KIVI quantizes the tokens before its last 128
CHUNK = 64                      # three chunks: offsets, sinks and the last chunk's tail
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def fixed_kv(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [L, T, H, D] of ``dtype``: ``tests.helpers.kv.integer_kv`` with its default seed
    (integers times powers of two per channel, a few outlier channels; exact in bf16)."""
    return integer_kv(L, T, H, D, dtype)


def fixed_calibration(group_layers: int = 0, rounding: float = 0.5) -> "kvtc.KvtcCalibration":
    """A kvtc calibration from fixed numbers (no fit): orthonormal signed-permutation bases,
    power-of-two steps dropping a suffix, levels 0-5 with the default targets."""
    rng = np.random.default_rng(7)
    C = H * D
    levels = tuple(sorted(kvtc.DEFAULT_LEVEL_TARGETS))
    keep = [12, 20, 28, 40, 56, 100]
    if group_layers:
        NG, Cg = -(-L // group_layers), 2 * group_layers * C
        lead = (NG,)
        width = Cg
    else:
        lead = (2, L)
        width = C
    n_mats = int(np.prod(lead))
    basis = np.zeros((n_mats, width, width), np.float32)
    for m in range(n_mats):
        perm = rng.permutation(width)
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=width)
        basis[m, perm, np.arange(width)] = sign
    basis = basis.reshape(*lead, width, width)
    mean = (rng.integers(-8, 9, size=(*lead, width)) / 16).astype(np.float32)
    var = np.broadcast_to(np.exp2(-np.arange(width) / 16.0).astype(np.float32),
                          (*lead, width)).copy()
    step = np.zeros((len(levels), *lead, width), np.float32)
    for i, n in enumerate(keep[:len(levels)]):
        n = min(n * (2 if group_layers else 1), width)
        step[i, ..., :n] = np.exp2(-9 - i + np.floor(np.arange(n) / 16)).astype(np.float32)
    cal = kvtc.KvtcCalibration(
        num_layers=L, num_heads=H, head_dim=D, mean=mean, basis=basis, var=var, step=step,
        levels=levels, targets=tuple(float(kvtc.DEFAULT_LEVEL_TARGETS[x]) for x in levels),
        default_level=4, key_space="post_rope", rope_theta=0.0, per_head=False,
        # the label the digests were made with (the file's path then): part of the
        # calibration's hash, so of every kvtc container; a new path must not change it
        meta={"made_by": "tests/test_codec_digests.py"}, rounding=rounding,
        group_layers=group_layers)
    cal.hash = cal.content_hash()
    return cal


KVTC_CALIBRATIONS = {"kvtc": {}, "kvtc-deadzone": {"rounding": 0.375},
                     "kvtc-grouped": {"group_layers": 2}}


def cases() -> list[tuple[str, str, object, str]]:
    """(case id, codec name, level, dtype key) for every registered codec and level."""
    out = []
    for name in sorted(codec.CODECS):
        if name == "kvtc":
            continue
        for lvl in (codec.levels(name) or (None,)):
            for dt in DTYPES:
                out.append((f"{name}/{lvl}/{dt}", name, lvl, dt))
    for cname in KVTC_CALIBRATIONS:
        for lvl in sorted(kvtc.DEFAULT_LEVEL_TARGETS):
            for dt in DTYPES:
                out.append((f"{cname}/{lvl}/{dt}", cname, lvl, dt))
    return out
