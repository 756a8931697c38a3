"""Per-layer K/V bit allocation: from measured per-(layer, K/V, bins) KL and bytes, the bins
of every layer's K and V that minimise the summed bytes subject to a summed-KL bound (or
the summed KL subject to a byte budget), as a ``CodecConfig`` with per-layer specs.

The model side measures the table (``kv_extraction_hf.calibrate.sensitivity``: the forward
KL in nats/token against the lossless KV when ONLY one layer's K or V is quantized at a
given number of bins, and the bytes that choice costs); this module knows no model. The
summed KL is the additive estimate of the total: for small independent perturbations the
KL is a quadratic form of them (the Fisher information) whose cross terms vanish in
expectation, so per-unit KLs add to first order. The held-out benchmark
(``python -m bench.quality --targets ... --per-layer-bits``) measures the real total.

Algorithm: the marginal-return greedy on each unit's lower convex hull of (bytes, KL)
points, as in Shoham & Gersho, "Efficient bit allocation for an arbitrary set of
quantizers", IEEE Trans. ASSP 36(9), 1988 (the Lagrangian / equal-slope allocation; the
layer-wise variant of KVTC's bit allocation, arXiv 2511.01815, and NVIDIA Model-Optimizer's
KV AutoQuant, which allocates by forward KL on calibration data). Every unit (a layer's K
or its V) starts at its cheapest hull point; the step with the largest KL decrease per
extra byte over all units is taken until the summed KL meets the bound (``kl_target``),
or, with a byte budget, while steps fit (a step that does not fit blocks its unit; later,
flatter steps of other units may still fit). For a bound that falls on the hull of the
sum this is the exact optimum; between hull points it is within one step of it. Ties go to
the lower layer, K before V. Deterministic: plain Python floats, a fixed order.

Errors: ValueError (one line) on a malformed table, a bound no allocation meets, or a
budget below the cheapest allocation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .config import CodecConfig, QuantizationSpec

__all__ = ["Allocation", "allocate_bins", "estimate", "excess_table", "specs_from_bins", "config_from_bins",
           "check_table"]

KINDS = ("k", "v")


@dataclass(frozen=True)
class Allocation:
    """The chosen bins. ``key_bins`` / ``value_bins``: one int per layer; ``kl``: the summed
    KL estimate (nats/token) of the choice; ``bytes``: its summed bytes (the table's unit,
    e.g. bytes per window); ``rule``: how it was chosen (one line)."""

    key_bins: tuple
    value_bins: tuple
    kl: float
    bytes: float
    rule: str

    def record(self) -> dict:
        """JSON-ready dict."""
        return {"key_bins": list(self.key_bins), "value_bins": list(self.value_bins),
                "kl_estimate": self.kl, "bytes_estimate": self.bytes, "rule": self.rule}


def check_table(table: dict) -> tuple[list[int], int]:
    """(candidate bins, num_layers) of a sensitivity table ``{"bins": [b0, ...], "kl":
    [L][2][nb], "bytes": [L][2][nb]}`` (KL in nats/token >= 0, bytes > 0, finite; index 0
    of the middle axis K, 1 V). Raises ValueError (one line) when it is not one."""
    if not isinstance(table, dict):
        raise ValueError(f"sensitivity table must be a mapping, got {type(table).__name__}")
    bins = table.get("bins")
    if not isinstance(bins, (list, tuple)) or not bins:
        raise ValueError("sensitivity table has no candidate bins")
    for b in bins:
        QuantizationSpec(0, 1, b)            # even, 4..256, an int: its own ValueError
    if len(set(bins)) != len(bins):
        raise ValueError(f"sensitivity table repeats a bins value: {list(bins)}")
    kl, nb = table.get("kl"), table.get("bytes")
    if not isinstance(kl, (list, tuple)) or not isinstance(nb, (list, tuple)) or not kl or len(kl) != len(nb):
        raise ValueError("sensitivity table needs kl and bytes lists of one entry per layer")
    for name, arr in (("kl", kl), ("bytes", nb)):
        for layer in arr:
            if not isinstance(layer, (list, tuple)) or len(layer) != 2 or \
                    any(not isinstance(row, (list, tuple)) or len(row) != len(bins) for row in layer):
                raise ValueError(f"sensitivity table {name} must be [layers][2][{len(bins)}]")
            for row in layer:
                for x in row:
                    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (x == x) \
                            or x in (float("inf"), float("-inf")):
                        raise ValueError(f"sensitivity table {name} holds a non-finite value {x!r}")
                    if (name == "kl" and x < 0) or (name == "bytes" and x <= 0):
                        raise ValueError(f"sensitivity table {name} value {x!r} out of range")
    return [int(b) for b in bins], len(kl)


def excess_table(table: dict) -> dict:
    """A copy of ``table`` whose KL is each unit's excess over its own smallest KL (over the
    candidates): the per-unit floor removed before the KLs are summed.

    Why: in a bf16 model ANY change of one layer's KV moves the roundings of every later
    activation, which alone gives a KL floor (on SmolLM2-135M about 1e-3 nats/token per
    unit, the size of quant8's whole-cache KL), the same for 128 bins as for 256. That floor
    does not add over units (quantizing every layer at 128/64 bins costs ~0.004, not 60
    floors), so summing raw per-unit KLs would count it 2L times; the excess over the
    floor is the part that adds. ``kl_floor`` ([L][2]) keeps the removed floors. Raises
    ValueError as ``check_table``."""
    check_table(table)
    floors = [[min(float(x) for x in unit) for unit in layer] for layer in table["kl"]]
    kl = [[[float(x) - floors[i][j] for x in unit] for j, unit in enumerate(layer)]
          for i, layer in enumerate(table["kl"])]
    return dict(table, kl=kl, kl_floor=floors)


def _hull(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Lower convex hull of (bytes, kl, bins) points that are efficient (more bytes, less
    KL), ordered by bytes: the points a Lagrangian allocation can choose."""
    pts = sorted(points, key=lambda p: (p[0], p[1], p[2]))
    eff: list[tuple[float, float, int]] = []
    for p in pts:                               # drop dominated points (no less KL for more bytes)
        if not eff or p[1] < eff[-1][1]:
            eff.append(p)
    hull: list[tuple[float, float, int]] = []
    for p in eff:
        while len(hull) >= 2:
            (x1, y1, _), (x2, y2, _) = hull[-2], hull[-1]
            # drop hull[-1] when it lies on or above the segment hull[-2] -> p
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def _sum_kl(hulls: list, pos: list) -> float:
    return math.fsum(hulls[layer][kind][pos[layer][kind]][1] for layer in range(len(hulls)) for kind in (0, 1))


def _points(table: dict, bins: list[int], layer: int, kind: int) -> list[tuple[float, float, int]]:
    return [(float(table["bytes"][layer][kind][i]), float(table["kl"][layer][kind][i]), b)
            for i, b in enumerate(bins)]


def estimate(table: dict, key_bins: Sequence[int], value_bins: Sequence[int]) -> tuple[float, float]:
    """(summed KL estimate, summed bytes) of per-layer ``key_bins`` / ``value_bins`` on
    ``table`` (``check_table``'s form). Raises ValueError when a layer's bins is not a
    candidate of the table or the lengths differ from its layer count."""
    bins, L = check_table(table)
    if len(key_bins) != L or len(value_bins) != L:
        raise ValueError(f"need {L} key and value bins, got {len(key_bins)} and {len(value_bins)}")
    kls, sizes = [], []
    for layer in range(L):
        for kind, b in enumerate((key_bins[layer], value_bins[layer])):
            if b not in bins:
                raise ValueError(f"{KINDS[kind].upper()} bins {b} of layer {layer} is not a candidate "
                                 f"of the table {bins}")
            i = bins.index(b)
            kls.append(float(table["kl"][layer][kind][i]))
            sizes.append(float(table["bytes"][layer][kind][i]))
    return math.fsum(kls), math.fsum(sizes)


def allocate_bins(table: dict, kl_target: Optional[float] = None,
                  byte_budget: Optional[float] = None) -> Allocation:
    """Bins per layer for K and V from a sensitivity ``table`` (``check_table``'s form).

    Exactly one of ``kl_target`` (nats/token: the fewest bytes whose summed KL estimate is
    <= it) and ``byte_budget`` (the table's byte unit: the least summed KL whose bytes are
    <= it) must be given. Returns an ``Allocation`` (its ``kl`` and ``bytes`` are the
    table's sums for the choice). Raises ValueError on a bad table, both or neither bound,
    a KL target below the finest choice's summed KL, or a budget below the cheapest
    choice's bytes."""
    if (kl_target is None) == (byte_budget is None):
        raise ValueError("give exactly one of kl_target and byte_budget")
    bins, L = check_table(table)
    hulls = [[_hull(_points(table, bins, layer, kind)) for kind in (0, 1)] for layer in range(L)]
    pos = [[0, 0] for _ in range(L)]
    nbytes = math.fsum(h[0][0] for unit in hulls for h in unit)
    kl = _sum_kl(hulls, pos)
    # every hull step, steepest first (slopes fall along a hull, so a unit's steps come in order)
    steps = []
    for layer in range(L):
        for kind in (0, 1):
            h = hulls[layer][kind]
            for j in range(1, len(h)):
                gain, cost = h[j - 1][1] - h[j][1], h[j][0] - h[j - 1][0]
                steps.append((-(gain / cost) if cost > 0 else float("-inf"), layer, kind, j, gain, cost))
    steps.sort(key=lambda s: (s[0], s[1], s[2], s[3]))
    if kl_target is not None:
        kl_target = float(kl_target)
        finest = math.fsum(h[-1][1] for unit in hulls for h in unit)
        if not kl_target >= finest:
            raise ValueError(f"no allocation meets a summed KL of {kl_target:.4g} nats/token: the finest "
                             f"candidates ({max(bins)} bins everywhere on the hull) sum to {finest:.4g}")
        for _, layer, kind, j, _, _ in steps:
            if _sum_kl(hulls, pos) <= kl_target:     # an exact sum each time: no drift from the steps
                break
            pos[layer][kind] = j
        rule = f"fewest bytes with summed KL estimate <= {kl_target:.6g} nats/token"
    else:
        budget = float(byte_budget)
        if not nbytes <= budget:
            raise ValueError(f"a byte budget of {budget:.6g} is below the cheapest allocation's {nbytes:.6g}")
        blocked: set = set()
        for _, layer, kind, j, gain, cost in steps:
            if (layer, kind) in blocked or pos[layer][kind] != j - 1:
                continue
            if nbytes + cost > budget:
                blocked.add((layer, kind))
                continue
            pos[layer][kind] = j
            kl, nbytes = kl - gain, nbytes + cost
        rule = f"least summed KL estimate with bytes <= {budget:.6g}"
    kb = tuple(hulls[layer][0][pos[layer][0]][2] for layer in range(L))
    vb = tuple(hulls[layer][1][pos[layer][1]][2] for layer in range(L))
    kl, nbytes = estimate(table, kb, vb)     # recomputed in one order: no drift from the steps
    return Allocation(kb, vb, kl, nbytes, f"greedy marginal return on convex hulls (Shoham & Gersho 1988): {rule}")


def specs_from_bins(bins: Sequence[int]) -> tuple[QuantizationSpec, ...]:
    """Contiguous ``QuantizationSpec`` ranges of per-layer ``bins``, adjacent equal bins
    merged (``[32, 32, 16]`` -> ``[0, 2) 32``, ``[2, 3) 16``). Raises ValueError on an
    empty list or a bad bins value."""
    out: list[QuantizationSpec] = []
    if not bins:
        raise ValueError("no bins to make specs of")
    for layer, b in enumerate(bins):
        if out and out[-1].bins == b:
            out[-1] = QuantizationSpec(out[-1].start_layer, layer + 1, int(b))
        else:
            out.append(QuantizationSpec(layer, layer + 1, int(b)))
    return tuple(out)


def config_from_bins(base: CodecConfig, key_bins: Sequence[int], value_bins: Sequence[int]) -> CodecConfig:
    """``base`` (scales, sinks, stream layout) with per-layer ``key_bins`` / ``value_bins``
    (``specs_from_bins``), level None and variant "custom": a schedule no level names, which
    the container records whole (a decode needs nothing else; its config hash differs from
    every level's). Raises ValueError when the lengths are not ``base.num_layers``."""
    if len(key_bins) != base.num_layers or len(value_bins) != base.num_layers:
        raise ValueError(f"need {base.num_layers} key and value bins, got {len(key_bins)} and {len(value_bins)}")
    return base.replace(key_specs=specs_from_bins(key_bins), value_specs=specs_from_bins(value_bins),
                        level=None, variant="custom")
