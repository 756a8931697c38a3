"""The codec's level schedules: per-layer quantization bins (``QuantizationSpec``) of the
reference variant's levels (LMCache's default and the CacheGen artifact's) and of the
harness variant's measured levels (``HARNESS_LEVELS``).

Separate from ``codec.config`` (the ``CodecConfig`` dataclass: validation, presets, YAML)
because the schedules are data derived for any layer count, read also by the torch-free
``codec.level_table`` and by ``bench.schedules``; all names are re-exported by
``codec.config``, their former home.

Implements the layer-wise quantization schedule of CacheGen (Liu et al., SIGCOMM 2024,
section 5.2 "layer-wise quantization": shallow layers get more bins) as LMCache and the
CacheGen artifact define it (LMCache's ``lmcache/storage_backend/serde/cachegen_basics.py``;
the artifact's levels in github.com/UChi-JCL/CacheGen, config/quantization*.json).

Reference-variant levels (boundaries of the artifact levels are the 7B/32-layer ones scaled to
the model's depth):

- level 0: LMCache's default schedule, NOT scaled (LMCache uses fixed boundaries):
  keys [0,10) 32 bins, rest 16; values [0,2) 32 bins, rest 16; < 10 layers: 32 everywhere.
- level 1 (artifact): keys 16/16/12 on layer thirds, values 16 on the first 1/16 then 12.
- level 2 (artifact): keys 32/16/16, values 32/16.
- level 3 (artifact): 32 bins everywhere.

``python -m bench.schedules 30`` prints the schedules of every level for 30 layers.
"""
from __future__ import annotations

from dataclasses import dataclass

LEVELS = (0, 1, 2, 3)           # reference variant: LMCache default (0), artifact 1-3


@dataclass(frozen=True)
class QuantizationSpec:
    """``bins`` quantization bins for layers ``[start_layer, end_layer)``.

    The quantizer uses ``M = bins // 2 - 1`` so symbols lie in ``[0, 2M]`` (LMCache's
    convention: 32 bins -> 31 symbols -15..15). ``bins`` must be even, 4..256.
    Raises ValueError on bad values.
    """

    start_layer: int
    end_layer: int
    bins: int

    def __post_init__(self) -> None:
        for name in ("start_layer", "end_layer", "bins"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"QuantizationSpec.{name} must be an int, got {v!r}")
        if not 0 <= self.start_layer < self.end_layer:
            raise ValueError(
                f"QuantizationSpec needs 0 <= start_layer < end_layer, got "
                f"[{self.start_layer}, {self.end_layer})")
        if not (4 <= self.bins <= 256 and self.bins % 2 == 0):
            raise ValueError(f"QuantizationSpec.bins must be even and in [4, 256], got {self.bins}")

    @property
    def max_level(self) -> int:
        """M = bins/2 - 1: symbols are in [0, 2M], the zero point is M."""
        return self.bins // 2 - 1


def _specs(num_layers: int, bounds: list[tuple[float, int]]) -> tuple[QuantizationSpec, ...]:
    """Build contiguous specs from ``[(end_layer, bins), ...]``; ends are clipped to
    ``[1, num_layers]``, empty ranges dropped, equal neighbours merged; the last range
    ends at num_layers."""
    out: list[QuantizationSpec] = []
    start = 0
    for i, (end, bins) in enumerate(bounds):
        end = num_layers if i == len(bounds) - 1 else min(max(int(end), 1), num_layers)
        if end > start:
            if out and out[-1].bins == bins:      # merge equal neighbours
                out[-1] = QuantizationSpec(out[-1].start_layer, end, bins)
            else:
                out.append(QuantizationSpec(start, end, bins))
            start = end
    return tuple(out)


def _scaled(boundary_7b: int, num_layers: int) -> int:
    """A 32-layer boundary scaled to ``num_layers`` (round half up, at least 1)."""
    return max(1, int(boundary_7b * num_layers / 32 + 0.5))


def reference_schedule(num_layers: int, level: int) -> tuple[tuple[QuantizationSpec, ...],
                                                                tuple[QuantizationSpec, ...]]:
    """(key specs, value specs) of the LMCache default (level 0) and artifact levels 1-3."""
    n = num_layers
    if level == 0:
        if n < 10:
            return _specs(n, [(n, 32)]), _specs(n, [(n, 32)])
        return _specs(n, [(10, 32), (n, 16)]), _specs(n, [(2, 32), (n, 16)])
    a, b, v = _scaled(10, n), _scaled(20, n), _scaled(2, n)
    if level == 1:
        return _specs(n, [(a, 16), (b, 16), (n, 12)]), _specs(n, [(v, 16), (n, 12)])
    if level == 2:
        return _specs(n, [(a, 32), (b, 16), (n, 16)]), _specs(n, [(v, 32), (n, 16)])
    if level == 3:
        return _specs(n, [(n, 32)]), _specs(n, [(n, 32)])
    raise ValueError(f"unknown level {level!r}; levels are {list(LEVELS)}")


# Harness levels: uniform bins on every layer (layer-wise schedules measured no better,
# docs/codec.md section 4), a uniform quantization step per (layer, KV head) over the
# chunk ("chunk_head" scales), the first HARNESS_SINK_TOKENS tokens stored exactly.
# Chosen from the measurements in docs/codec.md (SmolLM2-135M, 2K-token pydoc contexts):
# level 1 (the default) is ~8x smaller than bf16 at <= 1% perplexity increase.
HARNESS_LEVELS: dict[int, tuple[int, int]] = {   # level -> (key bins, value bins)
    0: (24, 8),      # smallest
    1: (32, 10),     # default: ideal 8.6x (coded ~8.3x), ppl -0.4% / KL 0.036 (4 contexts)
    2: (32, 12),     # coded 7.75x, ppl -0.4% / KL 0.031
    3: (48, 12),     # ideal 7.0x, KL 0.024
    4: (64, 16),     # ideal 5.9x, KL 0.016
    5: (128, 64),    # ideal 3.8x, KL 0.003 (near lossless)
}
HARNESS_DEFAULT_LEVEL = 1
REFERENCE_DEFAULT_LEVEL = 0     # LMCache's default schedule
HARNESS_SINK_TOKENS = 4  # attention-sink tokens stored exactly (attention sinks: Xiao et al.,
#                          StreamingLLM, arXiv:2309.17453; measured gain in docs/codec.md)


def harness_schedule(num_layers: int, level: int):
    """(key specs, value specs) of the harness variant's level; see ``HARNESS_LEVELS``."""
    if level not in HARNESS_LEVELS:
        raise ValueError(f"unknown level {level!r}; levels are {sorted(HARNESS_LEVELS)}")
    kb, vb = HARNESS_LEVELS[level]
    return _specs(num_layers, [(num_layers, kb)]), _specs(num_layers, [(num_layers, vb)])


