"""Per-layer K/V bit allocation (codec.bit_allocation) on synthetic sensitivity tables with a
known optimum (checked against exhaustive search), the byte-budget form, determinism, the
merged specs of the emitted config, and the one-line errors of bad tables and bounds.

Run: .venv/bin/python -m pytest tests/codec/test_bit_allocation.py -q
"""
from __future__ import annotations

import itertools
import random

import pytest

from codec import bit_allocation as ba
from codec.config import CodecConfig, QuantizationSpec

BINS = [8, 16, 32, 64]


def _table(kl, nbytes, bins=BINS):
    return {"bins": list(bins), "kl": kl, "bytes": nbytes}


def _convex_table(weights, L):
    """KL = w / bins^2 (the quantization-noise model), bytes = log2(bins) per unit: convex,
    so the greedy's hull steps are the exact optimum at every reachable budget."""
    kl = [[[w * 1000.0 / b ** 2 for b in BINS] for w in weights[layer]] for layer in range(L)]
    nb = [[[100.0 * (b.bit_length() - 1) for b in BINS] for _ in range(2)] for _ in range(L)]
    return _table(kl, nb)


def _brute(table, L, kl_target=None, byte_budget=None):
    """Exhaustive optimum over every bins choice of every unit (tiny tables only)."""
    best = None
    for combo in itertools.product(range(len(table["bins"])), repeat=2 * L):
        kb = [table["bins"][combo[2 * i]] for i in range(L)]
        vb = [table["bins"][combo[2 * i + 1]] for i in range(L)]
        kl, nb = ba.estimate(table, kb, vb)
        if kl_target is not None and kl <= kl_target + 1e-12:
            key = (nb, kl)
        elif byte_budget is not None and nb <= byte_budget + 1e-9:
            key = (kl, nb)
        else:
            continue
        if best is None or key < best[0]:
            best = (key, kb, vb)
    return best


def test_sensitive_unit_gets_more_bins():
    # layer 0's K is 100x as sensitive as everything else: it alone gets the finest bins
    t = _convex_table([[100.0, 1.0], [1.0, 1.0]], 2)
    target = 100 * 1000.0 / 64 ** 2 + 3 * 1000.0 / 32 ** 2
    a = ba.allocate_bins(t, kl_target=target)
    assert a.key_bins[0] == 64 and max(a.key_bins[1], a.value_bins[0], a.value_bins[1]) <= 32
    assert a.kl <= target


@pytest.mark.parametrize("seed", range(6))
def test_kl_target_matches_exhaustive_optimum_on_convex_tables(seed):
    rng = random.Random(seed)
    L = 2
    t = _convex_table([[rng.uniform(0.5, 50), rng.uniform(0.5, 50)] for _ in range(L)], L)
    for budget in (1300.0, 1500.0, 1800.0, 2100.0):  # every step costs 100: each budget is a vertex of the sum
        ref = ba.allocate_bins(t, byte_budget=budget)
        # the KL target of that vertex: the greedy must find the fewest bytes for it, as the search does
        got = ba.allocate_bins(t, kl_target=ref.kl)
        (nb, kl), _, _ = _brute(t, L, kl_target=ref.kl)
        assert got.bytes == pytest.approx(nb) and got.kl <= ref.kl + 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_byte_budget_matches_exhaustive_optimum_on_convex_tables(seed):
    rng = random.Random(100 + seed)
    L = 2
    t = _convex_table([[rng.uniform(0.5, 50), rng.uniform(0.5, 50)] for _ in range(L)], L)
    for budget in (1200.0, 1400.0, 1700.0, 1900.0, 2400.0):   # multiples of the step cost (100): vertices
        got = ba.allocate_bins(t, byte_budget=budget)
        (kl, nb), _, _ = _brute(t, L, byte_budget=budget)
        assert got.kl == pytest.approx(kl) and got.bytes <= budget


def test_result_always_meets_its_bound_on_nonconvex_tables():
    rng = random.Random(7)
    L = 3
    kl = [[sorted((rng.uniform(0, 1) for _ in BINS), reverse=True) for _ in range(2)] for _ in range(L)]
    nb = [[sorted(rng.uniform(10, 100) for _ in BINS) for _ in range(2)] for _ in range(L)]
    t = _table(kl, nb)
    finest = sum(u[-1] for layer in kl for u in layer)
    coarsest = sum(u[0] for layer in kl for u in layer)
    for x in (finest, finest + 0.1, (finest + coarsest) / 2, coarsest, coarsest + 1):
        a = ba.allocate_bins(t, kl_target=x)
        assert a.kl <= x + 1e-12
        (best_nb, _), _, _ = _brute(t, L, kl_target=x)
        assert a.bytes >= best_nb - 1e-9           # never better than the true optimum (a sanity check)
    cheapest = sum(u[0] for layer in nb for u in layer)
    for budget in (cheapest, cheapest + 50, cheapest + 200):
        assert ba.allocate_bins(t, byte_budget=budget).bytes <= budget


def test_dominated_candidates_are_never_chosen():
    # 16 bins costs more than 32 and loses more KL: never on the hull
    kl = [[[1.0, 2.0, 0.5, 0.1], [1.0, 0.5, 0.25, 0.1]]]
    nb = [[[10.0, 30.0, 20.0, 40.0], [10.0, 20.0, 30.0, 40.0]]]
    t = _table(kl, nb)
    for x in (0.2, 0.6, 1.0, 1.5, 2.0):
        assert ba.allocate_bins(t, kl_target=x).key_bins[0] != 16


def test_deterministic_and_ties_prefer_lower_layer_k_first():
    t = _convex_table([[1.0, 1.0], [1.0, 1.0]], 2)
    step = 1000.0 / 8 ** 2 - 1000.0 / 16 ** 2
    start = 4 * 1000.0 / 8 ** 2
    a = ba.allocate_bins(t, kl_target=start - step)       # one step: layer 0's K takes it
    assert (a.key_bins, a.value_bins) == ((16, 8), (8, 8))
    assert a == ba.allocate_bins(t, kl_target=start - step)


def test_config_from_bins_merges_equal_neighbours_and_round_trips():
    base = CodecConfig.for_model(5)
    cfg = ba.config_from_bins(base, [32, 32, 16, 16, 32], [8, 8, 8, 8, 8])
    assert cfg.key_specs == (QuantizationSpec(0, 2, 32), QuantizationSpec(2, 4, 16), QuantizationSpec(4, 5, 32))
    assert cfg.value_specs == (QuantizationSpec(0, 5, 8),)
    assert cfg.level is None and cfg.variant == "custom"
    assert (cfg.scale_group, cfg.sink_tokens) == (base.scale_group, base.sink_tokens)
    assert CodecConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.key_bins == [32, 32, 16, 16, 32]
    with pytest.raises(ValueError, match="need 5"):
        ba.config_from_bins(base, [32], [8])


def test_bad_tables_and_bounds_raise_one_line():
    t = _convex_table([[1.0, 1.0]], 1)
    for bad in ({"bins": [], "kl": [], "bytes": []}, dict(t, bins=[8, 16, 32, 33]),
                dict(t, kl=[[[1.0, 1.0], [1.0]]]), dict(t, kl=[[[float("nan")] * 4, [1.0] * 4]]),
                dict(t, bytes=[[[0.0] * 4, [1.0] * 4]]), dict(t, bins=[8, 8, 16, 32]), "x"):
        with pytest.raises(ValueError) as e:
            ba.allocate_bins(bad, kl_target=1.0)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="exactly one"):
        ba.allocate_bins(t)
    with pytest.raises(ValueError, match="exactly one"):
        ba.allocate_bins(t, kl_target=1.0, byte_budget=10.0)
    with pytest.raises(ValueError, match="no allocation meets"):
        ba.allocate_bins(t, kl_target=1e-9)
    with pytest.raises(ValueError, match="below the cheapest"):
        ba.allocate_bins(t, byte_budget=1.0)
    with pytest.raises(ValueError, match="not a candidate"):
        ba.estimate(t, [12], [8])


def test_excess_table_removes_each_units_floor():
    # a per-unit floor (any perturbation's rounding noise) added to a convex table: the
    # excess is the floorless table again, and the allocation on it is the floorless one
    t = _convex_table([[3.0, 1.0], [2.0, 5.0]], 2)
    floors = [[0.01, 0.02], [0.03, 0.04]]
    noisy = dict(t, kl=[[[x + floors[i][j] for x in unit] for j, unit in enumerate(layer)]
                        for i, layer in enumerate(t["kl"])])
    e = ba.excess_table(noisy)
    for i in range(2):
        for j in range(2):
            assert min(e["kl"][i][j]) == 0.0
            assert e["kl_floor"][i][j] == pytest.approx(floors[i][j] + t["kl"][i][j][-1])   # the finest's KL
            assert e["kl"][i][j] == pytest.approx([x - t["kl"][i][j][-1] for x in t["kl"][i][j]])
    target = ba.estimate(e, [16, 32], [16, 64])[0]
    a, b = ba.allocate_bins(e, kl_target=target), ba.allocate_bins(ba.excess_table(t), kl_target=target)
    assert (a.key_bins, a.value_bins) == (b.key_bins, b.value_bins)
    assert noisy["kl"] is not e["kl"] and "kl_floor" not in noisy      # the input is left as it was
