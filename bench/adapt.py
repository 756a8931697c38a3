"""Bandwidth adaptation judged against an oracle and fixed baselines (CacheGen section 5.2,
evaluation of section 7.4), on the real shaped link and in a clock-model simulation.

What runs:
1. Level table (once, cached in the output): a real KV of the default model (needle prompt,
   --context-tokens, seed 0) is encoded with the CacheGen codec at levels 0-5 in chunks of
   --chunk-tokens; per level and chunk: bytes, and decode seconds per token (codec.decode_kv
   on this CPU); the HF prefill speed of the same context is measured too.
2. Real link (`--real`, default on): streaming.link.ShapedLink (netns + tc tbf as root,
   else the userspace token bucket) with the KV store server; the store holds stand-in
   chunks (streaming.standin) of exactly the real per-level sizes, and the decoder does real
   CPU work (SHA-256 rounds) calibrated to the measured per-level decode time. The shaper
   follows each trace chunk by chunk (streaming.traces.apply_trace); the AdaptivePolicy
   runs unmodified through streaming.client.stream_load (abandon on overrun included).
   Text chunks are charged tokens / prefill speed after the load (not executed: no model).
3. Simulation: the same policy code driven by streaming.adapt.simulate (ClockModel:
   bytes/rate + a per-request overhead and manifest time calibrated from the real runs,
   the per-level decode table, the prefill speed) for every policy (adaptive, oracle,
   fixed-l0..l5, text), every trace and every SLO of the sweep.

Traces: the 10 recorded traces of the public CacheGen artifact (trace_set "artifact", the
EVALUATION set; each replayed from --offsets cyclic start offsets, default all 10 -> 100
requests per SLO, the same requests for every policy; --real-offsets of them per trace, default
2 -> 20 requests, also run on the real link and compared with the simulation on the same
requests), its generated traces ("generated") and --synthetic i.i.d. uniform
10-1000 Mbit/s traces ("synthetic", simulated only) - generated + synthetic are the TUNING
set the policy's reserve was chosen on (config.tuning) -, a HELD-OUT evaluation set from the
artifact's own generator ("artifact-generator": --generator-traces, default 100, fresh traces
i.i.d. uniform 0.1-10 Gbit/s per chunk, seed --generator-seed 15, used by no tuning set;
simulated only), constant 10/100/1000 Mbit/s ("constant"), steps
1000 -> 10 and 10 -> 1000 Mbit/s mid-context ("step"); artifact Gbit/s scaled by --scale.
Goals (issue 15) are judged per trace set with paired cluster-bootstrap 95% intervals
(resampling traces, each trace's start offsets together; goals(), cluster_bootstrap_diff).
Quality: per-level KL from benchmarks/quality.json when present (token-weighted mean KL of
a load; text chunks are recomputed exactly, KL 0); otherwise quality_kl is null and the
planner uses an ordinal utility (higher level better, text best), stated in the output.

Run (default; ~3 min quiet (115 s on 2026-11-30 before the held-out set, which adds ~45 s),
5.4 min at load 3.7-4 (2026-12-01), 16 min at load 9-14):  python -m bench.adapt
Quick (~2 min; ~1 min with --level-table):   python -m bench.adapt --quick
Simulation only, reusing a level table:      python -m bench.adapt --no-real --level-table benchmarks/adaptation.json
Round 6's dip reserve (evaluated, not the default): add --dip-reserve
Tuning of the policy (TUNING traces only):   python scripts/adapt_tune.py (docs/streaming.md section 4)
Output: benchmarks/adaptation.json (schema: docs/results-schema.md, section adaptation.json).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import flags
from common.header import atomic_write_json
from common.header import environment as header_environment
from common.units import mbps_to_bytes_per_s
from streaming import standin
from streaming.adapt import AdaptivePolicy, ClockModel, FixedPolicy, oracle, oracle_labels, simulate
from streaming.adapt_params import DEFAULT_PRESET, POLICY_PRESETS, preset as policy_preset
from streaming.traces import (GENERATOR_SEED, Trace, apply_trace, artifact_generated, artifact_generator,
                              artifact_recorded, constant, synthetic_uniform)

LEVELS = (0, 1, 2, 3, 4, 5)
SLOS = (0.5, 1.0, 2.0, 4.0)
ISSUE_ALL_TEXT_S = 0.5  # issue case: all-text load time at its prefill speed (s)
_REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- level table
def measure_level_table(context_tokens: int = 4096, chunk_tokens: int = 416, levels=LEVELS, log=print) -> dict:
    """Encode a real KV of the default model at each level -> the table used everywhere else.

    Returns {"tokens": [per chunk], "sizes": {level: [bytes per chunk]}, "decode_s_per_token":
    {level: s/token (median over chunks)}, "prefill_tps_hf": tokens/s, ...}. Raises whatever
    the model loader raises (kv_extraction_hf.errors.ExtractionError) when no model is found.
    """
    import torch

    from codec import decode_kv, encode_chunks
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.model import load_model
    from kv_extraction_hf.prompts import build_prompt

    bundle = load_model(None, log=log)
    p = build_prompt("needle", bundle.tokenizer, context_tokens, seed=0, index=0)
    ids = list(p.context_ids)
    prefill_kv(bundle, ids[:256])  # warm-up, excluded
    t = time.perf_counter()
    k, v = prefill_kv(bundle, ids)
    prefill_s = time.perf_counter() - t
    n_tok = k.shape[1]
    out = {"model_id": bundle.info.model_id, "weights_hash": bundle.info.weights_hash, "dtype": bundle.info.dtype,
           "context_tokens": n_tok, "chunk_tokens": chunk_tokens, "prefill_tps_hf": n_tok / prefill_s,
           "prefill_s_hf": prefill_s, "torch_threads": torch.get_num_threads(),
           "source": "codec.encode_chunks(codec='cachegen', level=L) of the default model's KV of the needle "
                     "prompt (seed 0); decode = codec.decode_kv on this CPU, median s/token over chunks "
                     "(min in decode_s_per_token_min)",
           "sizes": {}, "decode_s_per_token": {}, "encode_s": {}}
    for lv in levels:
        t = time.perf_counter()
        chunks = encode_chunks(k, v, codec="cachegen", level=lv, chunk_tokens=chunk_tokens)
        out["encode_s"][str(lv)] = round(time.perf_counter() - t, 3)
        if "tokens" not in out:
            out["tokens"] = [min(chunk_tokens, n_tok - i * chunk_tokens) for i in range(len(chunks))]
        decode_kv(chunks[0])  # warm-up (numba), excluded
        per_tok = []
        for i, c in enumerate(chunks):
            t = time.perf_counter()
            decode_kv(c)
            per_tok.append((time.perf_counter() - t) / out["tokens"][i])
        out["sizes"][str(lv)] = [len(c) for c in chunks]
        # median over chunks: what decode costs under this machine's current load (the min, the
        # least disturbed measurement, is kept beside it); the real run calibrates decode_scale
        out["decode_s_per_token"][str(lv)] = statistics.median(per_tok)
        out.setdefault("decode_s_per_token_min", {})[str(lv)] = min(per_tok)
        log(f"level {lv}: {sum(len(c) for c in chunks)} bytes, decode {statistics.median(per_tok) * 1e6:.1f} "
            f"us/token (median), {min(per_tok) * 1e6:.1f} (min)")
    return out


def _table_levels(table: dict) -> dict[int, list[int]]:
    return {int(k): list(v) for k, v in table["sizes"].items()}


# --------------------------------------------------------------------------- quality
def load_quality(path: Path) -> tuple[dict[int, float] | None, str]:
    """Per-level KL of the cachegen codec from quality.json -> ({level: kl}, note)."""
    if not path.exists():
        return None, f"{path.name} not found: quality_kl unavailable; planning uses an ordinal utility"
    try:
        doc = json.loads(path.read_text())
        kl = {int(r["level"]): float(r["kl"]) for r in doc.get("rows", [])
              if r.get("codec") == "cachegen" and r.get("level") is not None and r.get("kl") is not None}
    except (ValueError, KeyError, TypeError) as e:
        return None, f"{path.name} unreadable ({e}): quality_kl unavailable"
    if not kl:
        return None, f"{path.name} has no cachegen rows: quality_kl unavailable"
    return kl, f"per-level KL of codec cachegen from {path.name} (token-weighted; text = 0)"


# --------------------------------------------------------------------------- traces
def start_offsets(length: int, count: int, seed: int = 0) -> list[int]:
    """`count` distinct cyclic start offsets in [0, length), drawn with random.Random(seed)
    (all of them, in order, when count >= length). The same offsets for every policy: the
    requests are paired. Raises ValueError when count < 1."""
    import random

    if count < 1 or length < 1:
        raise ValueError("--offsets and --real-offsets must be >= 1")
    if count >= length:
        return list(range(length))
    return sorted(random.Random(seed).sample(range(length), count))


def rotate(tr: Trace, offset: int) -> Trace:
    """The request that starts at chunk `offset` of a recorded trace and wraps around: chunk k
    of the load runs at tr.mbps[(offset + k) % len]. Named "<trace>@<offset>"."""
    o = offset % len(tr.mbps)
    return Trace(f"{tr.name}@{o}", tuple(tr.mbps[o:] + tr.mbps[:o]), tr.source, tr.scale)


def trace_sets(n: int, scale: float, quick: bool, synthetic: int = 40, offsets: int = 1,
               seed: int = 0, generator: int = 100, generator_seed: int = GENERATOR_SEED) -> dict[str, list[Trace]]:
    """The trace sets of the sweep (Mbit/s per chunk). `offsets`: requests per recorded trace
    of the artifact (recorded and generated), each starting at another cyclic offset
    (start_offsets(len, offsets, seed)): 10 traces x 10 offsets = 100 requests per SLO.
    `generator`: traces of the held-out set "artifact-generator" (streaming.traces.
    artifact_generator: the artifact's own generator, i.i.d. uniform 0.1-10 Gbit/s per chunk x
    scale, seed `generator_seed`, one request per trace; 0 leaves the set out; 10 with quick)."""
    rec = artifact_recorded(scale)
    gen = artifact_generated(scale)
    if quick:
        rec, gen = rec[:4], gen[:1]
        generator = min(generator, 10)
    sets = {
        "artifact": [rotate(t, o) for t in rec for o in start_offsets(len(t.mbps), offsets, seed)],
        "artifact-generator": artifact_generator(n, generator, seed=generator_seed, scale=scale),
        "generated": [rotate(t, o) for t in gen for o in start_offsets(len(t.mbps), offsets, seed)],
        "synthetic": synthetic_uniform(n, min(5, synthetic) if quick else synthetic, seed=1),
        "constant": [constant(r, n) for r in (10, 100, 1000)],
        "step": [Trace("step-1000-10", tuple([1000.0] * (n // 2) + [10.0] * (n - n // 2))),
                 Trace("step-10-1000", tuple([10.0] * (n // 2) + [1000.0] * (n - n // 2)))],
    }
    if not sets["artifact-generator"]:
        del sets["artifact-generator"]
    return sets


# --------------------------------------------------------------------------- manifest stand-in
class _Man:
    """The fields of streaming.store.Manifest the policies and simulate() read."""

    def __init__(self, table: dict):
        self.levels = tuple(sorted(_table_levels(table)))
        self.sizes = {lv: tuple(s) for lv, s in _table_levels(table).items()}
        toks = table["tokens"]
        starts = [sum(toks[:i]) for i in range(len(toks))]
        self.token_ranges = tuple((a, a + t) for a, t in zip(starts, toks))
        self.chunk_count = len(toks)


def clock_model(table: dict, prefill_tps: float, inject_s_per_token: float, overhead_s: float, start_s: float,
                utility: dict[int, float] | None) -> ClockModel:
    dec = {int(k): float(v) for k, v in table["decode_s_per_token"].items()}
    return ClockModel(_table_levels(table), list(table["tokens"]), dec, prefill_tps, inject_s_per_token,
                      overhead_s, start_s, utility, None if utility is None else 0.0)


# The benchmark's adaptive policy is a preset of the ONE policy object
# streaming.adapt_params.PolicyParams (issue 27.3): "tuned" by default (DEFAULT_PRESET, chosen
# on the TUNING traces below), "tuned-dip" with --dip-reserve, any preset with --policy-preset.
# The constants and comments below are the record of how "tuned" was chosen.
SLO_MARGIN = POLICY_PRESETS["tuned"].slo_margin  # AdaptivePolicy(slo_margin=...) (its default)
# AdaptivePolicy(slo_reserve_s=...): seconds of the SLO held back for a bandwidth dip. Chosen on
# the TUNING traces only (the artifact's generated traces + 40 synthetic iid-uniform 10-1000
# Mbit/s traces, seed 1; simulated, SLO 1 and 2 s; grid 0, 0.25, 0.3, 0.35 s and slo_margin
# 0.1-0.3): the smallest value whose SLO-1 s violations exceed the oracle's by <= 5 points there.
# The 10 recorded artifact traces are the evaluation set and were not used to choose it.
SLO_RESERVE_S = POLICY_PRESETS["tuned"].slo_reserve_s  # 0.3
# The rules of round 3 (issue 15), each checked on the same TUNING traces (generated + synthetic
# + constant + step, simulated, SLO 0.5/1/2/4 s) against the two goals, never on the artifact's
# recorded traces: after an abandon the chunk takes its smallest level or text; the probe is the
# smallest level, cut at half the chunk's recompute time, no back-off; text chosen for quality
# is deferred to the end of the load and counts as slack for an overrun.
# Round 4: the plan's floor SLO x min_plan_frac (was SLO / 2: at SLO 0.5 s the 0.25 s reserve
# was capped there) and the plain harmonic mean (robust=False: RobustMPC's discount on top of
# the reserve cost quality without fewer violations) with reserve 0.3 s - chosen on the same
# TUNING traces with 10 cyclic start offsets per generated trace (435 requests per SLO); see
# TUNING["round4"].
# (The "tuned" preset: slo_reserve_s 0.3, robust False, min_plan_frac 0.3; every other
# field - after_abandon "smallest", probe_level "smallest", probe_deadline_frac 0.5,
# probe_backoff 1, defer_text, text_slack, early_abandon, early_min_s 0.02, early_margin 0,
# partial_sample, slo_margin 0.05 - equals AdaptivePolicy's default.)
# Round 6: the dip reserve (AdaptivePolicy.dip_reserve_s): from the 3rd goodput sample on, the
# reserve is min(0.3 s, 5 chunks at their smallest level at the lowest rate in the window) -
# a link that has not dipped keeps little of it (at SLO 0.5 s the fixed 0.3 s held every plan at
# level 0). Selected by scripts/adapt_tune.py on TUNING requests only (TUNING["round6"]), then
# evaluated on the artifact: quality at 0.5 s better but still below fixed level 2, and goal 1
# lost at 1 s by one request (6% vs oracle 0%) - so NOT the default; `--dip-reserve` runs it.
DIP_RESERVE = {"dip_chunks": 5, "dip_min_samples": 3}  # = preset "tuned-dip" minus "tuned"
assert POLICY_PRESETS["tuned-dip"] == POLICY_PRESETS["tuned"].with_(**DIP_RESERVE)
# Round 5: early abandon from the bytes received (AdaptivePolicy.should_abandon, checked every
# 64 KiB as streaming.client does) and the cut transfer's bytes/time as a provisional sample;
# early_min_bytes is the estimator's sample floor max(64 KiB, 4 shaper bursts) (the burst rule
# of issue 15, not tuned). Compared on the same TUNING requests only (TUNING["round5"]).
TUNING = {"evaluation_trace_set": "artifact",
          "tuning_trace_sets": ["generated", "synthetic"],
          "synthetic": "streaming.traces.synthetic_uniform(n_chunks, 40, seed=1): iid uniform 10-1000 Mbit/s",
          "tuned": {"slo_reserve_s": SLO_RESERVE_S, "slo_margin": SLO_MARGIN, "robust": False, "min_plan_frac": 0.3},
          "grid": {"slo_reserve_s": [0.0, 0.25, 0.3, 0.35], "slo_margin": [0.05, 0.1, 0.2, 0.3],
                   "window": [3, 5, 8], "max_discount": [1.0, 2.0]},
          "round3": {"trace_sets": ["generated", "synthetic", "constant", "step"], "slo_s": [0.5, 1, 2, 4],
                     "compared": {"after_abandon": ["bound", "smallest"], "probe_backoff": [1.0, 2.0],
                                  "slo_reserve_frac": [None, 0.1, 0.2, 0.3],
                                  "slo_reserve_s_with_frac": [0.25, 0.5], "defer_text": [False, True],
                                  "text_slack": [False, True]},
                     "criterion": "goal 1 (violations <= oracle + 5 points) at every SLO of the tuning sets, "
                                  "then goal 2 (quality of met loads vs the best fixed level at no more "
                                  "violations)"},
          "round4": {"trace_sets": ["generated x 10 start offsets", "synthetic x 10 start offsets", "constant",
                                    "step"], "requests_per_slo": 435, "slo_s": [0.5, 1, 2, 4],
                     "compared": {"slo_reserve_s": [0.25, 0.3, 0.35, 0.45, 0.55, 0.65],
                                  "min_plan_frac": [0.5, 0.4, 0.3], "robust": [True, False], "window": [5, 10],
                                  "abandon_margin": [0.5, 1.0], "overrun_share": [0.5, 1.0],
                                  "slo_reserve_frac": [None, 0.1, 0.2, 0.3], "slo_margin": [0.05, 0.1],
                                  "prior_error": [None, 0.5, 1.0], "risk_z (quantile_rate)": [None, 1.0, 1.645]},
                     "criterion": "all three checks (G1 violations <= oracle + 5 points; G2 mean KL of all "
                                  "loads and of met loads <= the best fixed level or text at no more "
                                  "violations) at every SLO of the tuning requests, then the lowest KL "
                                  "summed over the SLOs",
                     "passing": {"robust=False, slo_reserve_s=0.3, min_plan_frac=0.3 (chosen)":
                                 "KL 0.0697/0.0313/0.0079/0.0019, violations 21/5/2/0% (oracle 19/3/1/0%)",
                                 "robust=True, slo_reserve_s=0.25, min_plan_frac=0.3":
                                 "KL 0.0669/0.0330/0.0106/0.0022, violations 22/5/2/0%"},
                     "before": "round-3 parameters on the same requests: G1 missed at SLO 0.5 "
                               "(26% vs oracle 19%)"},
          "round5": {"trace_sets": ["generated x 10 start offsets", "synthetic x 10 start offsets", "constant",
                                    "step"], "requests_per_slo": 435, "slo_s": [0.5, 1, 2, 4],
                     "compared": {"early_abandon": [False, True], "partial_sample": [False, True],
                                  "early_min_bytes": [65536, 262144], "early_min_s": [0.0, 0.02, 0.05],
                                  "early_margin": [0.0, 0.1, 0.25]},
                     "criterion": "round 4's (G1 and G2 at every SLO, then the lowest KL summed over the SLOs)",
                     "results": {"before (round 4)": "KL 0.0697/0.0313/0.0079/0.0019, violations 21/5/2/0%",
                                 "early_min_s=0.02, margin 0, partial_sample (chosen)":
                                 "KL 0.0697/0.0265/0.0055/0.0016, violations 20/3/1/0% (oracle 19/3/1/0%)",
                                 "early_min_s=0": "KL 0.0697/0.0256/0.0055/0.0016, violations 20/3/1/0% - "
                                                  "0.02 s kept as the real link's floor against a first read's "
                                                  "timing (a 0.001 KL difference at SLO 1 s)",
                                 "early_min_bytes=256 KiB": "KL .../0.0270/0.0057/0.0017, violations 21/5/1/0%",
                                 "early_margin=0.1 / 0.25": "KL .../0.0271/0.0057 / .../0.0277/0.0061, violations "
                                                            "20/4/1/0%",
                                 "partial_sample=False": "KL 0.0699/0.0267/0.0050/0.0016, violations 20/3/1/0%"}},
          "round6": {"script": "python scripts/adapt_tune.py --offsets 5 --level-table benchmarks/adaptation.json "
                               "--results benchmarks/results.json",
                     "trace_sets": ["generated x 5 offsets (15)", "synthetic iid uniform 10-1000 Mbit/s, 40 x 5 (200)",
                                    "markov: Gilbert-Elliott good U[200,1000] / bad log-U[10,100] Mbit/s, "
                                    "40 x 5 (200)", "floor: per-trace floor log-U[10,400], rates U[floor,1000] "
                                    "Mbit/s, 40 x 5 (200)", "constant (3)", "step (2)"],
                     "requests_per_slo": 620, "slo_s": [0.5, 1, 2, 4],
                     "compared": {"slo_reserve_frac": [None, 0.2, 0.3], "robust+slo_reserve_s": [0, 0.1, 0.2],
                                  "slo_reserve_s": [0.2, 0.3], "dip_chunks": [3, 5, 8], "dip_min_samples": [2, 3],
                                  "dip_chunks 5 + robust": [True]},
                     "criterion": "no (tuning set, SLO) where round 5 meets G1 may be lost (where round 5 misses "
                                  "it, at most 1 point more excess); then the lowest pooled mean KL summed over "
                                  "the SLOs (scripts/adapt_tune.py pick())",
                     "results": {"round5": "violations 181/87/9/1 of 620 (oracle 179/52/3/1), KL "
                                           "0.0693/0.0251/0.0083/0.0025",
                                 "dip 5, 3 samples (selected; --dip-reserve)": "violations 194/88/9/1, KL "
                                                              "0.0561/0.0239/0.0083/0.0025; synthetic 0.5 s +10 "
                                                              "of 200 (the limit)",
                                 "not admissible": "reserve_frac 0.2/0.3, robust with reserve 0/0.1/0.2, reserve "
                                                   "0.2, dip 3 or 5 or 8 with 2 samples, dip 5 + robust: G1 lost "
                                                   "on synthetic 0.5 s or markov 2 s"},
                     "open": "markov 1 s: 88 vs oracle 52 of 200 for every candidate (round 5: 87) - a bad state "
                             "lasting several chunks is not absorbed by a 0.3 s reserve",
                     "evaluation": "artifact, simulated with the committed level table and calibration (python -m "
                                   "bench.adapt --no-real --level-table benchmarks/adaptation.json --dip-reserve): "
                                   "violations 40/6/0/0% (round 5: 40/5/0/0%, oracle 40/0/0/0%), KL of met loads "
                                   "0.0496/0.0244/0.0069/0.0021 (round 5: 0.0704/0.0267/0.0069/0.0021; fixed-l2 "
                                   "0.0336 at 0.5 s): goal 2 at 0.5 s still missed, goal 1 at 1 s lost by one "
                                   "request -> not adopted as the default"},
          "criterion": "SLO 1 s: violations where the oracle meets the SLO <= 5% of the tuning traces, "
                       "then the lowest regret at SLO 2 s",
          "note": "the artifact's recorded traces (the evaluation set) were not used to choose parameters"}


def make_adaptive(slo: float, prefill_tps: float, table: dict, inject: float, utility, init_mbps: float | None,
                  burst_bytes: int = 0, overhead_s: float = 0.001, burst_s: float = 0.0,
                  preset: str = DEFAULT_PRESET, **overrides) -> AdaptivePolicy:
    """The benchmark's AdaptivePolicy: the PolicyParams preset `preset` ("tuned": chosen on
    the tuning traces), the level table's decode cost, per-level utility -KL; `overrides`
    replace preset fields (scripts/adapt_tune.py's candidates). ValueError on an unknown
    preset or field."""
    dec = {int(k): float(v) for k, v in table["decode_s_per_token"].items()}
    params = policy_preset(preset).with_(**overrides) if overrides else policy_preset(preset)
    return AdaptivePolicy.from_params(slo, prefill_tps, init_mbps, params, decode_s_per_token=dec,
                                      inject_s_per_token=inject, burst_bytes=burst_bytes, utility=utility,
                                      text_utility=0.0, request_overhead_s=overhead_s, probe_rate_mbps=1000.0,
                                      burst_s=burst_s)


def _kl_of(levels: list, tokens: list[int], kl: dict[int, float] | None) -> float | None:
    if kl is None:
        return None
    tot = sum(tokens)
    return sum(t * (0.0 if lv is None else kl[lv]) for lv, t in zip(levels, tokens)) / tot


def _util_per_token(levels: list, model: ClockModel) -> float:
    return sum(model.util(k, lv) for k, lv in enumerate(levels)) / sum(model.tokens)


# --------------------------------------------------------------------------- simulation
def simulate_all(table, sets, slos, prefill_tps, inject, overhead_s, start_s, kl, log=print,
                 decode_scale: float = 1.0, preset: str = DEFAULT_PRESET) -> tuple[list, list]:
    """Every policy on every trace and SLO with the clock model -> (request rows, timelines).
    The model's decode clock is the level table x decode_scale (calibrated on the real run);
    the adaptive policy starts from the unscaled table, as on the real link."""
    man = _Man(table)
    util = None if kl is None else {lv: -kl[lv] for lv in man.levels}
    model = clock_model(table, prefill_tps, inject, overhead_s, start_s, util)
    model.decode_s_per_token = {lv: v * decode_scale for lv, v in model.decode_s_per_token.items()}
    reqs, timelines = [], []
    tl_done: set[str] = set()
    for set_name, traces in sets.items():
        t_set = time.perf_counter()
        for tr in traces:
            rates = [mbps_to_bytes_per_s(tr.at(k)) for k in range(man.chunk_count)]
            labels = oracle_labels(model, rates)  # one DP per trace, every SLO picks from it
            for slo in slos:
                orc = oracle(model, rates, slo, labels=labels)
                orc_u = orc.utility / sum(model.tokens)
                pols = {"adaptive": make_adaptive(slo, prefill_tps, table, inject, util, tr.at(0), 0, overhead_s,
                                                   preset=preset),
                        "text": FixedPolicy(None)}
                pols.update({f"fixed-l{lv}": FixedPolicy(lv) for lv in man.levels})
                for name, pol in pols.items():
                    r = simulate(pol, man, [tr.at(k) for k in range(man.chunk_count)], model=model)
                    reqs.append(_req(name, set_name, tr, slo, r.total_s, r.levels, model, kl, orc_u, "simulated",
                                     abandons=r.abandons))
                    base_name = tr.name.rsplit("@", 1)[0]  # one timeline per recorded trace (first offset)
                    if name == "adaptive" and set_name in ("artifact", "step") and slo == 1.0 \
                            and base_name not in tl_done:
                        tl_done.add(base_name)
                        timelines.append({"policy": name, "trace": tr.name, "trace_set": set_name, "slo_s": slo,
                                          "link": "simulated", "chunks": r.timeline})
                orc_levels = list(orc.options)
                reqs.append(_req("oracle", set_name, tr, slo, orc.finish_s, orc_levels, model, kl, orc_u, "simulated"))
        log(f"simulated {set_name}: {len(traces)} requests x {len(slos)} SLOs ({time.perf_counter() - t_set:.1f} s)")
    return reqs, timelines


def _req(policy, set_name, tr, slo, total, levels, model, kl, orc_u, link, abandons=0, extra=None) -> dict:
    u = _util_per_token(levels, model)
    d = {"policy": policy, "trace_set": set_name, "trace": tr.name, "trace_scale": tr.scale, "slo_s": slo,
         "total_s": round(total, 5), "violated": total > slo, "overshoot_s": round(max(0.0, total - slo), 5),
         "levels": levels, "quality_kl": _kl_of(levels, list(model.tokens), kl),
         "regret_vs_oracle": round(orc_u - u, 6) if orc_u is not None else None, "abandons": abandons,
         "link": link}
    if extra:
        d.update(extra)
    return d


def _ci95(xs: list[float]) -> float | None:
    """Half-width of the normal-approximation 95% CI of the mean (1.96 sd / sqrt(n)); None below n=2."""
    return round(1.96 * statistics.stdev(xs) / math.sqrt(len(xs)), 6) if len(xs) >= 2 else None


def _wilson95(k: int, n: int) -> list[float]:
    """Wilson score 95% interval [lo, hi] of a proportion k/n (Wilson 1927)."""
    z = 1.96
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, c - h), 4), round(min(1.0, c + h), 4)]


def aggregate(reqs: list[dict]) -> list[dict]:
    """Rows per (link, policy, trace_set, slo): n, violation_rate (+ Wilson 95% interval),
    overshoot mean/p95 (s, over all requests, 0 when met), quality_kl (mean over all n
    requests), quality_kl_met (mean over the n_met requests that met the SLO: the quality
    delivered on time), each with a 95% CI half-width, regret_vs_oracle (mean per-token
    utility gap: KL points when quality is known), n_traces (distinct recorded traces behind
    the n requests: a trace replayed from several start offsets counts once)."""
    groups: dict[tuple, list[dict]] = {}
    for r in reqs:
        groups.setdefault((r["link"], r["policy"], r["trace_set"], r["slo_s"]), []).append(r)
    rows = []
    for (link, pol, ts, slo), g in sorted(groups.items(), key=lambda x: (x[0][0], x[0][2], x[0][3], x[0][1])):
        ov = sorted(x["overshoot_s"] for x in g)
        q = [x["quality_kl"] for x in g if x["quality_kl"] is not None]
        rg = [x["regret_vs_oracle"] for x in g if x["regret_vs_oracle"] is not None]
        qm = [x["quality_kl"] for x in g if x["quality_kl"] is not None and not x["violated"]]
        nv = sum(x["violated"] for x in g)
        rows.append({
            "policy": pol, "trace_set": ts, "slo_s": slo, "n": len(g), "link": link,
            "n_traces": len({cluster_of(x["trace"]) for x in g if x.get("trace")}) or None,
            "violation_rate": round(nv / len(g), 4), "violation_rate_ci95": _wilson95(nv, len(g)),
            "n_met": len(g) - nv,
            "overshoot_s_mean": round(statistics.fmean(ov), 5),
            "overshoot_s_p95": round(ov[min(len(ov) - 1, math.ceil(0.95 * len(ov)) - 1)], 5),
            "quality_kl": round(statistics.fmean(q), 6) if q else None,
            "quality_kl_ci95": _ci95(q) if q else None,
            "quality_kl_met": round(statistics.fmean(qm), 6) if qm else None,
            "quality_kl_met_ci95": _ci95(qm) if qm else None,
            "regret_vs_oracle": round(statistics.fmean(rg), 6) if rg else None,
            "abandons": sum(x.get("abandons", 0) for x in g),
        })
    return rows


GOAL_SET_ORDER = ("artifact", "artifact-generator", "generated", "synthetic", "constant", "step", "issue-drop")
G1_POINTS = 0.05  # goal 1: adaptive violation rate <= oracle's + 5 points
BOOT_REPS = 2000  # cluster bootstrap replicates of the goals' confidence intervals
BOOT_SEED = 0  # numpy default_rng seed of the cluster bootstrap (fixed: the same draws every run)


def cluster_of(trace: str) -> str:
    """The recorded trace a request replays: "<trace>@<offset>" -> "<trace>" (rotate()); a
    name without "@" is its own trace. The unit the goals' bootstrap resamples."""
    return trace.rsplit("@", 1)[0]


def bootstrap_weights(n_clusters: int, reps: int = BOOT_REPS, seed: int = BOOT_SEED):
    """(reps, n_clusters) int array: row b counts how often each cluster is drawn in bootstrap
    replicate b (n_clusters draws with replacement, numpy default_rng(seed)). Depends only on
    (n_clusters, reps, seed), so every statistic and policy of one trace set uses the same
    draws (paired). Raises ValueError when n_clusters < 1 or reps < 1."""
    import numpy as np

    if n_clusters < 1 or reps < 1:
        raise ValueError("the bootstrap needs at least one cluster and one replicate")
    idx = np.random.default_rng(seed).integers(0, n_clusters, size=(reps, n_clusters))
    w = np.zeros((reps, n_clusters), dtype=np.int64)
    np.add.at(w, (np.repeat(np.arange(reps), n_clusters), idx.ravel()), 1)
    return w


def cluster_bootstrap_diff(reqs_a: list[dict], reqs_b: list[dict], value: str = "violated", met_only: bool = False,
                           reps: int = BOOT_REPS, seed: int = BOOT_SEED) -> dict | None:
    """Paired cluster bootstrap (Efron & Tibshirani 1993, ch. 6; Davison & Hinkley 1997, sec.
    3.8: resample the independent units, keep what is correlated inside them together) of
    mean(value over a's requests) - mean(value over b's requests).

    reqs_a, reqs_b: request dicts (bench.adapt._req: "trace", "violated", "quality_kl") of two
    policies on the SAME requests (the same multiset of trace names, else ValueError). A
    cluster is the recorded trace a request replays (cluster_of): its start offsets share
    every rate, so they are resampled together. `value`: "violated" (0/1, the statistic is
    then a violation-rate difference, 0-1) or "quality_kl" (token-weighted KL); `met_only`:
    average over the requests that met the SLO only (per policy, in each replicate).
    Each replicate draws the clusters with replacement (bootstrap_weights: the same draw for
    a and b - paired) and pools their requests (a ratio of sums, so clusters of unequal size
    weigh by their requests). Returns {"diff" (the full-sample difference), "ci95" [lo, hi]
    (percentile interval, 2.5 and 97.5 %), "n" (requests), "n_traces" (clusters), "reps",
    "reps_defined" (replicates where both means exist)}; None when a value is null (quality
    unknown) or either side has no request to average."""
    import numpy as np

    if sorted(r["trace"] for r in reqs_a) != sorted(r["trace"] for r in reqs_b):
        raise ValueError("cluster_bootstrap_diff: the two policies must cover the same requests")
    if not reqs_a:
        return None
    clusters = sorted({cluster_of(r["trace"]) for r in reqs_a})
    pos = {c: i for i, c in enumerate(clusters)}

    def sums(reqs):
        n, tot = np.zeros(len(clusters)), np.zeros(len(clusters))
        for r in reqs:
            if met_only and r["violated"]:
                continue
            v = r.get(value)
            if v is None:
                return None
            n[pos[cluster_of(r["trace"])]] += 1
            tot[pos[cluster_of(r["trace"])]] += float(v)
        return n, tot

    sa, sb = sums(reqs_a), sums(reqs_b)
    if sa is None or sb is None or not sa[0].sum() or not sb[0].sum():
        return None
    diff = sa[1].sum() / sa[0].sum() - sb[1].sum() / sb[0].sum()
    w = bootstrap_weights(len(clusters), reps, seed)
    with np.errstate(invalid="ignore", divide="ignore"):
        d = (w @ sa[1]) / (w @ sa[0]) - (w @ sb[1]) / (w @ sb[0])
    ok = d[np.isfinite(d)]
    nd = 4 if value == "violated" else 6
    lo, hi = (np.percentile(ok, [2.5, 97.5]) if ok.size else (float("nan"), float("nan")))
    return {"diff": round(float(diff), nd), "ci95": [round(float(lo), nd), round(float(hi), nd)],
            "n": len(reqs_a), "n_traces": len(clusters), "reps": reps, "reps_defined": int(ok.size)}


def cluster_bootstrap_goal2(by_policy: dict[str, list[dict]], met_only: bool = True, reps: int = BOOT_REPS,
                            seed: int = BOOT_SEED) -> dict | None:
    """Paired cluster bootstrap of goal 2's statistic as a whole: adaptive mean KL - the lowest
    mean KL among the fixed levels and text whose violation rate <= the adaptive's, the
    comparator chosen again in every replicate (so the interval includes the uncertainty of
    which fixed level qualifies).

    by_policy: policy -> request dicts ("trace", "violated", "quality_kl") on the SAME
    requests; "adaptive" required, candidates are "fixed-*" and "text" (others ignored; a
    candidate whose requests differ raises ValueError). `met_only`: KL averaged over the loads
    that met the SLO (goal 2's figure), else over all loads. Clusters and draws as
    cluster_bootstrap_diff (bootstrap_weights(n_traces, reps, seed)). Returns {"ci95" [lo, hi]
    (percentile, over the replicates where a comparator qualifies and both means exist),
    "n", "n_traces", "reps", "reps_defined", "comparators" {policy: share of the defined
    replicates where it was the best fixed}}; None when quality is unknown or no candidate."""
    import numpy as np

    ra = by_policy.get("adaptive") or []
    cands = sorted(p for p in by_policy if p.startswith("fixed-") or p == "text")
    if not ra or not cands:
        return None
    names = sorted(r["trace"] for r in ra)
    clusters = sorted({cluster_of(r["trace"]) for r in ra})
    pos = {c: i for i, c in enumerate(clusters)}
    w = bootstrap_weights(len(clusters), reps, seed)

    def stats(reqs):  # (violation rate, mean KL) per replicate; None when a KL is unknown
        n, v, m, kl = (np.zeros(len(clusters)) for _ in range(4))
        for r in reqs:
            i = pos[cluster_of(r["trace"])]
            n[i] += 1
            v[i] += bool(r["violated"])
            if met_only and r["violated"]:
                continue
            if r.get("quality_kl") is None:
                return None
            m[i] += 1
            kl[i] += float(r["quality_kl"])
        with np.errstate(invalid="ignore", divide="ignore"):
            return (w @ v) / (w @ n), (w @ kl) / (w @ m)

    sa = stats(ra)
    if sa is None:
        return None
    best = np.full(reps, np.inf)
    who = np.full(reps, -1)
    for j, p in enumerate(cands):
        if sorted(r["trace"] for r in by_policy[p]) != names:
            raise ValueError("cluster_bootstrap_goal2: every policy must cover the same requests")
        sp = stats(by_policy[p])
        if sp is None:
            continue
        ok = (sp[0] <= sa[0] + 1e-9) & np.isfinite(sp[1]) & (sp[1] < best)
        best[ok], who[ok] = sp[1][ok], j
    d = sa[1] - best
    ok = np.isfinite(d)
    if not ok.any():
        return {"ci95": None, "n": len(ra), "n_traces": len(clusters), "reps": reps, "reps_defined": 0,
                "comparators": {}}
    lo, hi = np.percentile(d[ok], [2.5, 97.5])
    share = {cands[j]: round(float(np.mean(who[ok] == j)), 4) for j in sorted(set(who[ok].tolist()))}
    return {"ci95": [round(float(lo), 6), round(float(hi), 6)], "n": len(ra), "n_traces": len(clusters),
            "reps": reps, "reps_defined": int(ok.sum()), "comparators": share}


BOOT_MIN_TRACES = 5  # below this many traces a bootstrap interval is printed but given no verdict


def _ci_verdict(ci: list[float] | None, limit: float, n_traces: int | None = None) -> str | None:
    """Where the goal's limit lies against the 95% interval of (adaptive - reference): "met"
    (the whole interval <= limit), "missed" (the whole interval > limit), else "inconclusive";
    "too few traces" below BOOT_MIN_TRACES (a percentile bootstrap of 2-3 clusters is no
    interval); None without an interval."""
    if ci is None or any(x != x for x in ci):
        return None
    if n_traces is not None and n_traces < BOOT_MIN_TRACES:
        return "too few traces"
    return "met" if ci[1] <= limit + 1e-9 else "missed" if ci[0] > limit + 1e-9 else "inconclusive"


def goals(rows: list[dict], trace_set: str | None = None, reqs: list[dict] | None = None,
          reps: int = BOOT_REPS, seed: int = BOOT_SEED) -> list[dict]:
    """The issue's two policy goals per (trace_set, link, SLO) (`trace_set` None: every set in
    rows, in GOAL_SET_ORDER):
    g1_slo: adaptive violation_rate <= oracle's + 5 points;
    g2_quality: adaptive quality_kl_met <= the lowest quality_kl_met among the fixed levels and
    text whose violation_rate <= the adaptive's ("the best fixed level that meets the SLO at
    the same violation rate"; quality of the loads that met the SLO - a load that misses it
    is counted in violation_rate and overshoot, and the issue asks the policy to minimize its
    overshoot, not its KL). The all-requests figure (quality_kl) is reported beside it.
    With `reqs` (the request dicts the rows aggregate) each entry also carries n_traces (the
    distinct recorded traces behind its n requests) and paired cluster-bootstrap 95% intervals
    (cluster_bootstrap_diff, `reps` replicates, `seed`) of adaptive - oracle violation rate
    (violation_diff_vs_oracle[_ci95], verdict g1_ci against +5 points) and of adaptive - best
    fixed KL (cluster_bootstrap_goal2: the best fixed level at no more violations chosen again
    in each replicate; kl_met_diff_vs_best_fixed[_ci95] -> g2_ci, with g2_ci_comparators the
    share of replicates each fixed level was the comparator; kl_all_diff_vs_best_fixed_all
    [_ci95] -> g2_all_ci; verdict against 0): "met" / "missed" when the whole interval is on
    one side, else "inconclusive" ("too few traces" below BOOT_MIN_TRACES).
    Returns one dict per (trace_set, link, slo_s); null when rows are missing or quality unknown."""
    out = []
    sets = [trace_set] if trace_set is not None else sorted(
        {r["trace_set"] for r in rows}, key=lambda t: (GOAL_SET_ORDER.index(t) if t in GOAL_SET_ORDER
                                                      else len(GOAL_SET_ORDER), t))
    by_key: dict[tuple, list[dict]] = {}
    for r in reqs or ():
        by_key.setdefault((r["trace_set"], r["link"], r["slo_s"], r["policy"]), []).append(r)
    for ts in sets:
        for link, slo in sorted({(r["link"], r["slo_s"]) for r in rows if r["trace_set"] == ts}):
            d = _goal(rows, ts, link, slo)
            if d is None:
                continue
            if reqs is not None:
                _goal_ci(d, by_key, reps, seed)
            out.append(d)
    return out


def _goal(rows: list[dict], trace_set: str, link: str, slo: float) -> dict | None:
    g = {r["policy"]: r for r in rows if r["trace_set"] == trace_set and r["link"] == link and r["slo_s"] == slo}
    a, o = g.get("adaptive"), g.get("oracle")
    if a is None:
        return None
    d = {"trace_set": trace_set, "link": link, "slo_s": slo, "n": a["n"],
         "adaptive_violation_rate": a["violation_rate"],
         "oracle_violation_rate": o["violation_rate"] if o else None,
         "g1_slo": (a["violation_rate"] <= o["violation_rate"] + G1_POINTS + 1e-9) if o else None}
    fx = [r for p, r in g.items() if (p.startswith("fixed-") or p == "text")
          and r["violation_rate"] <= a["violation_rate"] + 1e-9]
    fm = [r for r in fx if r["quality_kl_met"] is not None]
    if fm and a["quality_kl_met"] is not None:
        best = min(fm, key=lambda r: r["quality_kl_met"])
        d.update({"adaptive_quality_kl_met": a["quality_kl_met"], "best_fixed": best["policy"],
                  "best_fixed_violation_rate": best["violation_rate"],
                  "best_fixed_quality_kl_met": best["quality_kl_met"],
                  "g2_quality": a["quality_kl_met"] <= best["quality_kl_met"] + 1e-9})
    else:
        # no fixed level or text at no more violations: goal 2 holds (nothing to match) -
        # unless no fixed row was measured at all (e.g. the real link): then it is unknown
        measured = any(p.startswith("fixed-") or p == "text" for p in g)
        d.update({"adaptive_quality_kl_met": a["quality_kl_met"], "best_fixed": None,
                  "g2_quality": None if a["quality_kl_met"] is None or not measured else True})
    fa = [r for r in fx if r["quality_kl"] is not None]
    if fa and a["quality_kl"] is not None:
        ba = min(fa, key=lambda r: r["quality_kl"])
        d.update({"adaptive_quality_kl_all": a["quality_kl"], "best_fixed_all": ba["policy"],
                  "best_fixed_quality_kl_all": ba["quality_kl"],
                  "g2_quality_all_requests": a["quality_kl"] <= ba["quality_kl"] + 1e-9})
    return d


def _goal_ci(d: dict, by_key: dict, reps: int, seed: int) -> None:
    """Adds n_traces and the cluster-bootstrap intervals to one goals() entry (in place)."""
    key = (d["trace_set"], d["link"], d["slo_s"])
    ra = by_key.get(key + ("adaptive",), [])
    nt = len({cluster_of(r["trace"]) for r in ra}) or None
    d["n_traces"] = nt
    b = None
    if ra and by_key.get(key + ("oracle",)):
        try:
            b = cluster_bootstrap_diff(ra, by_key[key + ("oracle",)], "violated", False, reps, seed)
        except ValueError:  # not the same requests: no paired interval
            b = None
    d["violation_diff_vs_oracle"] = None if b is None else b["diff"]
    d["violation_diff_vs_oracle_ci95"] = None if b is None else b["ci95"]
    d["g1_ci"] = None if b is None else _ci_verdict(b["ci95"], G1_POINTS, nt)
    pols = {p: rs for (ts, ln, sl, p), rs in by_key.items() if (ts, ln, sl) == key}
    for name, best, best_kl, a_kl, met, verdict in (
            ("kl_met_diff_vs_best_fixed", "best_fixed", "best_fixed_quality_kl_met", "adaptive_quality_kl_met",
             True, "g2_ci"),
            ("kl_all_diff_vs_best_fixed_all", "best_fixed_all", "best_fixed_quality_kl_all",
             "adaptive_quality_kl_all", False, "g2_all_ci")):
        d[name] = (round(d[a_kl] - d[best_kl], 6) if d.get(best) and d.get(a_kl) is not None
                   and d.get(best_kl) is not None else None)
        try:
            g = cluster_bootstrap_goal2(pols, met, reps, seed) if d[name] is not None else None
        except ValueError:
            g = None
        d[name + "_ci95"] = None if g is None else g["ci95"]
        d[verdict] = None if g is None else _ci_verdict(g["ci95"], 0.0, nt)
        if met:
            d["g2_ci_comparators"] = None if g is None else g["comparators"]


# --------------------------------------------------------------------------- real link
def _calibrate_rounds(nbytes: int, target_s: float) -> int:
    data = standin.make_chunk(max(nbytes, 64), 0)
    standin.decode(data, 2)
    t = time.perf_counter()
    standin.decode(data, 8)
    per = (time.perf_counter() - t) / 8
    return max(1, round(target_s / per))


def run_real(table, traces: list[tuple[str, Trace]], slo: float, prefill_tps: float, inject: float, kl,
             method: str, log=print, extra_cases=(), preset: str = DEFAULT_PRESET) -> tuple[list, list, dict, dict]:
    """The adaptive policy on the real shaped link for each (set, trace) at `slo`.
    Returns (request rows, timelines, link description, calibration)."""
    from streaming.client import stream_load
    from streaming.link import ShapedLink
    from streaming.store import start_store_server

    man = _Man(table)
    util = None if kl is None else {lv: -kl[lv] for lv in man.levels}
    model = clock_model(table, prefill_tps, inject, 0.0, 0.0, util)
    toks = list(table["tokens"])
    # stand-in decode: rounds per (level, chunk) so that decode takes the measured s/token
    by_len: dict[int, int] = {}
    for lv in man.levels:
        per_tok = float(table["decode_s_per_token"][str(lv)])
        for k, nb in enumerate(man.sizes[lv]):
            by_len[nb] = max(by_len.get(nb, 1), _calibrate_rounds(nb, per_tok * toks[k]))

    def decode_fn(data: bytes):
        return standin.decode(data, by_len.get(len(data), 1))

    reqs, timelines, wire_extra, man_s, dec_ratio = [], [], [], [], []
    cases = [(s, tr, slo, prefill_tps) for s, tr in traces] + list(extra_cases)
    max_rate = max(max(tr.mbps) for _, tr, _, _ in cases)
    with tempfile.TemporaryDirectory(prefix="cgh-adapt-") as d, ShapedLink(max_rate, method=method) as link:
        ld = link.describe()  # the shaper's burst rule: max(min bytes, rate * seconds)
        burst, burst_s = ld["burst_min_bytes"] or link.burst_bytes, ld["burst_rate_s"]
        with start_store_server(d, link) as h, h.client(timeout=120) as c:
            ids = list(range(sum(toks)))
            chunks = {lv: [standin.make_chunk(nb, seed=1000 * lv + i) for i, nb in enumerate(man.sizes[lv])]
                      for lv in man.levels}
            key = c.put_context("bench-model", "bench-weights", "standin-v1", ids, chunks, list(man.token_ranges))
            stream_load(c, key, 0, decode_fn, keep_decoded=False)  # warm-up (connection, page cache)
            for set_name, tr, slo_c, tps in cases:
                link.set_rate(tr.at(0))
                pol = make_adaptive(slo_c, tps, table, inject, util, tr.at(0), burst, burst_s=burst_s,
                                preset=preset)
                mod = clock_model(table, tps, inject, 0.0, 0.0, util)
                r = stream_load(c, key, pol, decode_fn, keep_decoded=False, before_chunk=apply_trace(link, tr))
                levels = [ch.level for ch in r.chunks]
                kv_tok = sum(b - a for (a, b), lv in zip(man.token_ranges, levels) if lv is not None)
                total = r.total_s + kv_tok * inject + r.recompute_tokens / tps
                man_s.append(r.manifest_s)
                for ch in r.chunks:
                    if ch.level is not None and not ch.refetched:
                        wire_extra.append(ch.transfer_s - ch.bytes / mbps_to_bytes_per_s(tr.at(ch.index)))
                        want = float(table["decode_s_per_token"][str(ch.level)]) * toks[ch.index]
                        if want > 0:
                            dec_ratio.append(ch.decode_s / want)
                rates = [mbps_to_bytes_per_s(tr.at(k)) for k in range(man.chunk_count)]
                orc = oracle(mod, rates, slo_c)
                ests = [dd.throughput_mbps_est for dd in r.decisions]
                hms = [dd.estimate_mbps for dd in r.decisions]
                reqs.append(_req("adaptive", set_name, tr, slo_c, total, levels, mod, kl, orc.utility / sum(mod.tokens),
                                 "real", abandons=len(r.abandoned),
                                 extra={"load_s": round(r.total_s, 5),
                                        "recompute_s": round(r.recompute_tokens / tps, 5),
                                        "estimates_mbps": ests, "harmonic_mean_mbps": hms,
                                        "wire_s": [round(ch.transfer_s, 5) for ch in r.chunks],
                                        "error": r.error, "prefill_tps": tps}))
                dec_by_k = {dd.chunk: dd for dd in r.decisions}
                timelines.append({"policy": "adaptive", "trace": tr.name, "trace_set": set_name, "slo_s": slo_c,
                                  "link": "real", "abandoned": r.abandoned, "chunks": [
                                      {"chunk": ch.index, "level": ch.level, "bandwidth_mbps": tr.at(ch.index),
                                       "est_mbps": (dec_by_k[ch.index].throughput_mbps_est
                                                    if ch.index in dec_by_k else None),
                                       "harmonic_mean_mbps": (dec_by_k[ch.index].estimate_mbps
                                                              if ch.index in dec_by_k else None),
                                       "budget_s": dec_by_k[ch.index].budget_s if ch.index in dec_by_k else None,
                                       "reason": dec_by_k[ch.index].reason if ch.index in dec_by_k else None,
                                       "wire_s": round(ch.transfer_s, 5), "decode_s": round(ch.decode_s, 5),
                                       "start_s": round(ch.fetch_start_s, 5), "bytes": ch.bytes}
                                      for ch in r.chunks]})
                log(f"real {set_name:>9} {tr.name:>22} SLO {slo_c:g}: total {total:.3f} s "
                    f"{'VIOLATED' if total > slo_c else 'met'} levels {levels} abandons {len(r.abandoned)}")
        desc = link.describe()
    calib = {"request_overhead_s": max(0.0, statistics.median(wire_extra)) if wire_extra else 0.001,
             "start_s": statistics.median(man_s) if man_s else 0.0, "n_chunks": len(wire_extra),
             "decode_scale": statistics.median(dec_ratio) if dec_ratio else 1.0,
             "method": "request_overhead_s: median over the real run's KV chunks of (wire seconds - bytes / "
                       "trace rate); start_s: median manifest lookup seconds; decode_scale: median of (real "
                       "decode seconds / level table's), applied to the simulated decode clock (the CPU is "
                       "shared: decode under load is slower than when the table was measured)"}
    return reqs, timelines, desc, calib


# --------------------------------------------------------------------------- defaults from real runs
def engine_calibration(results_path: Path, table: dict) -> dict:
    """Prefill speed of the engine and injection s/token from a results.json default run
    (text runs: context_tokens / prefill_s; cachegen runs: inject_s / loaded_tokens), else the
    HF prefill speed of the level table and no injection cost."""
    out = {"prefill_tps": table["prefill_tps_hf"], "inject_s_per_token": 0.0,
           "source": "HF prefill of the level table's context (no results.json)"}
    try:
        doc = json.loads(results_path.read_text())
        runs = doc.get("runs", [])
        tps = [r["context_tokens"] / r["prefill_s"] for r in runs
               if r.get("mode") == "text" and r.get("prefill_s") and r.get("context_tokens")]
        inj = [r["inject_s"] / r["loaded_tokens"] for r in runs
               if r.get("mode") == "cachegen" and r.get("inject_s") is not None and r.get("loaded_tokens")]
        if tps:
            out = {"prefill_tps": statistics.median(tps),
                   "inject_s_per_token": statistics.median(inj) if inj else 0.0,
                   "source": f"{results_path.name}: engine {doc.get('config', {}).get('engine')}, median of "
                             f"{len(tps)} text runs (prefill) and {len(inj)} cachegen runs (injection)"}
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        pass
    return out


def _env() -> dict:
    """adaptation.json's ``environment`` (:func:`common.header.environment`)."""
    return header_environment(("python", "platform", "num_cpus", "git_commit",
                               "load_avg_1m_at_start"))


def main(argv: list[str] | None = None) -> int:
    """The CLI (module docstring)."""
    return _main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's flags (module docstring); defaults in configs/adaptation.yaml."""
    ap = argparse.ArgumentParser(prog="python -m bench.adapt", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    flags.add_config(ap, default=flags.CONFIGS / "adaptation.yaml")
    flags.add_out(ap, type=Path, default=_REPO / "benchmarks" / "adaptation.json",
                  help="result file (JSON, atomically; default benchmarks/adaptation.json)")
    ap.add_argument("--level-table", type=Path, help="reuse the level table of an earlier output (JSON)")
    flags.add_context_tokens(ap, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=416, help="multiple of 16; 416 -> 10 chunks of 4096")
    ap.add_argument("--slo-s", type=float, nargs="+", default=list(SLOS))
    ap.add_argument("--real-slo-s", type=float, default=2.0, help="SLO of the real-link runs")
    ap.add_argument("--scale", type=float, default=0.1, help="artifact Gbit/s * 1000 * scale -> Mbit/s")
    ap.add_argument("--prefill-tps", type=float, help="engine prefill tokens/s (default: from --results, else HF)")
    ap.add_argument("--inject-s-per-token", type=float, help="default: from --results, else 0")
    ap.add_argument("--results", type=Path, default=_REPO / "benchmarks" / "results.json",
                    help="a run_benchmarks results.json to take the engine's prefill/injection speed from")
    ap.add_argument("--quality", type=Path, default=_REPO / "benchmarks" / "quality.json")
    flags.add_link_method(ap)
    ap.add_argument("--no-real", dest="real", action="store_false", help="simulation only")
    flags.add_quick(ap, help="4 artifact traces, 1 generated, 5 synthetic; same SLOs")
    ap.add_argument("--offsets", type=int, default=10,
                    help="requests per recorded artifact trace (recorded and generated), each at another "
                         "cyclic start offset, the same for every policy (default 10: all offsets of a "
                         "10-chunk trace -> 100 requests per SLO)")
    ap.add_argument("--real-offsets", type=int, default=2,
                    help="of those, start offsets per artifact trace also run on the real link (default 2: "
                         "20 requests; the simulation's figures are compared on the same requests)")
    ap.add_argument("--offset-seed", type=int, default=0, help="seed of the start offsets drawn")
    ap.add_argument("--policy-preset", choices=sorted(POLICY_PRESETS), default=DEFAULT_PRESET,
                    help="the adaptive policy's parameters: a preset of streaming.adapt_params.PolicyParams "
                         f"(default {DEFAULT_PRESET}: chosen on the tuning traces; 'default': AdaptivePolicy's "
                         "own defaults); recorded as config.policy_preset")
    ap.add_argument("--dip-reserve", action="store_true",
                    help="run the adaptive policy with round 6's dip reserve (DIP_RESERVE: dip_chunks=5, "
                         "dip_min_samples=3; evaluated, not the default - docs/streaming.md section 4)")
    ap.add_argument("--synthetic", type=int, default=40,
                    help="synthetic tuning traces (trace_set 'synthetic', simulated only; default 40)")
    ap.add_argument("--generator-traces", type=int, default=100,
                    help="traces of the held-out set 'artifact-generator' (the artifact's generator: iid "
                         "uniform 0.1-10 Gbit/s per chunk x --scale; simulated only; default 100, 10 with "
                         "--quick, 0 = none)")
    ap.add_argument("--generator-seed", type=int, default=GENERATOR_SEED,
                    help=f"seed of the held-out generator traces (default {GENERATOR_SEED}: used by no tuning set)")
    ap.add_argument("--bootstrap-reps", type=int, default=BOOT_REPS,
                    help=f"cluster-bootstrap replicates of the goals' 95%% intervals (default {BOOT_REPS}, "
                         f"seed {BOOT_SEED})")
    return ap


def _main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = flags.parse_with_config(ap, argv)
    from streaming.errors import StreamingError

    t_start = time.perf_counter()
    preset = "tuned-dip" if a.dip_reserve else a.policy_preset  # config records it
    try:
        if a.chunk_tokens <= 0 or a.chunk_tokens % 16 or a.context_tokens <= 0:
            raise ValueError("--chunk-tokens must be a positive multiple of 16 and --context-tokens > 0")
        if any(s <= 0 for s in a.slo_s) or a.scale <= 0:
            raise ValueError("SLOs and --scale must be > 0")
        # counts checked before any measuring (the level table takes a minute)
        for flag, value, lo in (("--offsets", a.offsets, 1), ("--real-offsets", a.real_offsets, 1),
                                ("--generator-traces", a.generator_traces, 0),
                                ("--bootstrap-reps", a.bootstrap_reps, 1)):
            if value < lo:
                raise ValueError(f"{flag} must be >= {lo}, got {value}")
        src_calib = None
        if a.level_table:
            src = json.loads(a.level_table.read_text())
            table = src.get("config", {}).get("level_table", src)
            c0 = src.get("link", {}).get("simulated", {}).get("calibration") if isinstance(src, dict) else None
            if isinstance(c0, dict) and c0.get("n_chunks"):  # an earlier real run's clock calibration
                src_calib = dict(c0, method=f"reused from {a.level_table.name} (its real run): "
                                           + str(c0.get("method", "")))
            if "sizes" not in table:
                raise ValueError(f"{a.level_table}: no level table (sizes, decode_s_per_token, tokens)")
        else:
            table = measure_level_table(a.context_tokens, a.chunk_tokens)
        cal = engine_calibration(a.results, table)
        prefill_tps = a.prefill_tps or cal["prefill_tps"]
        inject = a.inject_s_per_token if a.inject_s_per_token is not None else cal["inject_s_per_token"]
        if prefill_tps <= 0 or inject < 0:
            raise ValueError("--prefill-tps must be > 0 and --inject-s-per-token >= 0")
        kl, qnote = load_quality(a.quality)
        if kl is not None and not all(int(lv) in kl for lv in table["sizes"]):
            kl, qnote = None, (f"{a.quality.name} lacks levels {sorted(set(map(int, table['sizes'])) - set(kl))} "
                               "of codec cachegen: quality_kl unavailable")
        n = len(table["tokens"])
        sets = trace_sets(n, a.scale, a.quick, a.synthetic, a.offsets, a.offset_seed, a.generator_traces,
                          a.generator_seed)
        # the real-link requests: real_offsets of the simulated offsets of each recorded trace
        # (a subset, drawn with the same seed), so real and simulated compare on the same requests
        sim_off = {}
        for t in sets["artifact"]:
            base_name, o = t.name.rsplit("@", 1)
            sim_off.setdefault(base_name, []).append(int(o))
        real_art = []
        for t in sets["artifact"]:
            base_name, o = t.name.rsplit("@", 1)
            offs = sim_off[base_name]
            pick = [offs[i] for i in start_offsets(len(offs), min(a.real_offsets, len(offs)), a.offset_seed)]
            if int(o) in pick:
                real_art.append(t)
        all_text_s = ISSUE_ALL_TEXT_S
        real_reqs, real_tl, link_desc = [], [], None
        calib = src_calib or {"request_overhead_s": 0.001, "start_s": 0.0, "n_chunks": 0,
                              "method": "default (no real run): 1 ms per request, no manifest time"}
        checks = {}
        if a.real:
            real_traces = [("artifact", tr) for tr in real_art] + [
                (s, tr) for s in ("constant", "step") for tr in sets[s]]
            # issue case: 1000 -> 10 Mbit/s mid-context, SLO 0.6 s, a prefill speed at which
            # sending every chunk as text takes 0.5 s (the input stated in the issue)
            drop = sets["step"][0]
            extra = [("issue-drop", drop, 0.6, sum(table["tokens"]) / ISSUE_ALL_TEXT_S)]
            real_reqs, real_tl, link_desc, calib = run_real(table, real_traces, a.real_slo_s, prefill_tps, inject, kl,
                                                            a.link_method, extra_cases=extra, preset=preset)
            c1000 = [r for r in real_reqs if r["trace"] == "constant-1000" and r["slo_s"] == a.real_slo_s]
            if c1000:
                ests = [e for e in c1000[0]["estimates_mbps"][1:] if e is not None]
                hms = [e for e in c1000[0]["harmonic_mean_mbps"][1:] if e is not None]
                # the estimator (harmonic mean of wire goodput) is what the goal judges; the
                # planning rate is lower by design (RobustMPC discount after prediction errors)
                checks["constant_1000_estimate_mbps_after_first_chunk"] = hms
                checks["constant_1000_max_rel_error"] = (max(abs(e - 1000) / 1000 for e in hms) if hms else None)
                checks["constant_1000_planning_rate_mbps"] = ests
                checks["constant_1000_levels"] = c1000[0]["levels"]
            idrop = [r for r in real_reqs if r["trace_set"] == "issue-drop"]
            if idrop:
                checks["drop_1000_to_10_slo_0.6"] = {k: idrop[0][k] for k in ("levels", "total_s", "violated",
                                                                               "abandons", "prefill_tps")}
                checks["drop_1000_to_10_slo_0.6"]["all_text_s"] = round(all_text_s, 4)
        sim_reqs, sim_tl = simulate_all(table, sets, a.slo_s, prefill_tps, inject, calib["request_overhead_s"],
                                        calib["start_s"], kl, decode_scale=calib.get("decode_scale", 1.0),
                                        preset=preset)
        rows = aggregate(sim_reqs + real_reqs)
        agree = sim_vs_real(sim_reqs, real_reqs)
        doc = {
            "schema": "adaptation/1",
            "command": "python -m bench.adapt " + " ".join(argv if argv is not None else sys.argv[1:]),
            "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rows": rows,
            "config": {"slo_s": list(a.slo_s), "real_slo_s": a.real_slo_s if a.real else None,
                       "trace_scale": a.scale, "trace_sets": {k: [t.describe() for t in v] for k, v in sets.items()},
                       "prefill_tps": prefill_tps, "inject_s_per_token": inject, "engine_calibration": cal,
                       "issue_case_all_text_s": all_text_s, "level_table": table, "quality": qnote,
                       "quality_kl_per_level": kl, "quick": a.quick,
                       "requests_per_trace": {"offsets": a.offsets, "real_offsets": a.real_offsets,
                                              "offset_seed": a.offset_seed,
                                              "rule": "request '<trace>@<o>' runs chunk k at the trace's value "
                                                      "(o + k) mod len (bench.adapt.rotate); offsets drawn by "
                                                      "bench.adapt.start_offsets, the same for every policy",
                                              "real_requests": [t.name for t in real_art] if a.real else []},
                       "policy_preset": preset, "policy": policy_preset(preset).as_dict(), "tuning": TUNING,
                       "held_out": {"trace_set": "artifact-generator",
                                    "traces": len(sets.get("artifact-generator", [])), "seed": a.generator_seed,
                                    "generator": "streaming.traces.artifact_generator: iid uniform 0.1-10 Gbit/s "
                                                 "per chunk (the CacheGen artifact's description of its traces) "
                                                 "x 1000 x trace_scale -> Mbit/s; one request per trace",
                                    "note": "an evaluation set: its seed is used by no tuning set (tuning seeds "
                                            "1, 2, 3 and the artifact's generated traces); drawn after the policy "
                                            "was fixed"},
                       "goals_bootstrap": {"reps": a.bootstrap_reps, "seed": BOOT_SEED,
                                           "method": "paired cluster bootstrap (bench.adapt.cluster_bootstrap_diff): "
                                                     "resample the recorded traces with replacement, each trace's "
                                                     "requests (start offsets) together, the same draw for every "
                                                     "policy; percentile 95% interval; for goal 2 "
                                                     "(cluster_bootstrap_goal2) the best fixed level at no more "
                                                     "violations is chosen again in each replicate; no verdict "
                                                     f"below {BOOT_MIN_TRACES} traces"}},
            "link": {"real": link_desc, "simulated": {
                "clock_model": "transfer = bytes / trace rate + request_overhead_s; decode = measured s/token per "
                               "level (pipelined, the last chunk's not overlapped); injection = s/token of loaded "
                               "KV; text chunks recomputed after the load at prefill_tps; start_s before chunk 0",
                "calibration": calib}},
            "sim_vs_real": agree,
            "goals": goals(rows, reqs=sim_reqs + real_reqs, reps=a.bootstrap_reps),
            "checks": checks,
            "requests": sim_reqs + real_reqs,
            "timelines": real_tl + sim_tl,
            "environment": _env(),
            "wall_s": None,
        }
        doc["wall_s"] = round(time.perf_counter() - t_start, 1)
        atomic_write_json(a.out, doc, indent=1, default=str)
    except (StreamingError, ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_summary(rows, agree, checks, doc["goals"])
    print(f"wrote {a.out} ({doc['wall_s']} s)")
    return 0


def sim_vs_real(sim_reqs: list[dict], real_reqs: list[dict]) -> list[dict]:
    """Real vs simulated on the SAME requests (trace name incl. start offset, SLO, policy):
    per (trace_set, slo_s, policy) of the real rows, both violation rates over those requests
    only, the points between them, and how many requests agree on met/violated."""
    sim = {(r["trace"], r["slo_s"], r["policy"]): r for r in sim_reqs}
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for rr in real_reqs:
        sr = sim.get((rr["trace"], rr["slo_s"], rr["policy"]))
        if sr is not None:
            groups.setdefault((rr["trace_set"], rr["slo_s"], rr["policy"]), []).append((rr, sr))
    out = []
    for (ts, slo, pol), pairs in sorted(groups.items()):
        n = len(pairs)
        vr = sum(r["violated"] for r, _ in pairs) / n
        vs = sum(s["violated"] for _, s in pairs) / n
        out.append({"trace_set": ts, "slo_s": slo, "policy": pol, "n": n, "paired": True,
                    "violation_rate_real": round(vr, 4), "violation_rate_sim": round(vs, 4),
                    "diff_points": round(100 * abs(vr - vs), 1),
                    "same_outcome": sum(r["violated"] == s["violated"] for r, s in pairs),
                    "total_s_real_minus_sim_mean": round(statistics.fmean(r["total_s"] - s["total_s"]
                                                                          for r, s in pairs), 5)})
    return out


def _print_summary(rows, agree, checks, gl=()) -> None:
    print(f"{'link':>9} {'trace_set':>18} {'SLO':>4} {'policy':>9} {'n':>3} {'viol%':>6} {'ovs_mean':>8} "
          f"{'ovs_p95':>8} {'KL':>8} {'regret':>8}")
    for r in rows:
        q = "-" if r["quality_kl"] is None else f"{r['quality_kl']:.4f}"
        g = "-" if r["regret_vs_oracle"] is None else f"{r['regret_vs_oracle']:.4f}"
        print(f"{r['link']:>9} {r['trace_set']:>18} {r['slo_s']:>4g} {r['policy']:>9} {r['n']:>3} "
              f"{100 * r['violation_rate']:>6.1f} {r['overshoot_s_mean']:>8.3f} {r['overshoot_s_p95']:>8.3f} "
              f"{q:>8} {g:>8}")
    for x in agree:
        print(f"sim vs real {x['trace_set']} SLO {x['slo_s']} (same {x['n']} requests): "
              f"{100 * x['violation_rate_real']:.0f}% real, {100 * x['violation_rate_sim']:.0f}% simulated "
              f"({x['diff_points']} points; {x['same_outcome']}/{x['n']} same outcome; total_s real - sim "
              f"{x['total_s_real_minus_sim_mean']:+.3f} s)")
    if gl:
        print("goals (point estimates; met / MISSED / - where a side was not measured or nothing qualifies): "
              "G1 adaptive violations <= oracle's + 5 points; G2 adaptive KL of met loads <= the best fixed "
              "level's (or text's) at no more violations")
    for x in gl:
        orc = "-" if x["oracle_violation_rate"] is None else f"{100 * x['oracle_violation_rate']:.0f}%"
        kl = x.get("adaptive_quality_kl_met")
        g2 = (f"G2 KL of met loads adaptive {_num(kl)} vs {x['best_fixed']} {_num(x.get('best_fixed_quality_kl_met'))} "
              f"-> {_verdict(x.get('g2_quality'))} (all loads: {_num(x.get('adaptive_quality_kl_all'))} vs "
              f"{x.get('best_fixed_all') or '-'} {_num(x.get('best_fixed_quality_kl_all'))})"
              if x.get("best_fixed") else f"G2 KL of met loads adaptive {_num(kl)}, no fixed level at no more "
              f"violations -> {_verdict(x.get('g2_quality'))}")
        print(f"goals {x['trace_set']} {x['link']} SLO {x['slo_s']:g} ({_requests(x)}): G1 violations adaptive "
              f"{100 * x['adaptive_violation_rate']:.0f}% vs oracle {orc} -> {_verdict(x['g1_slo'])}; {g2}")
    _print_goal_cis(gl)
    if checks:
        print("checks:", json.dumps(checks, default=str))


def _verdict(v) -> str:
    return "-" if v is None else ("met" if v else "MISSED")


def _num(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _requests(x: dict) -> str:
    nt = x.get("n_traces")
    return f"{x['n']} requests" + ("" if nt is None else f" from {nt} trace{'s' if nt != 1 else ''}")


def _fmt_ci(x: dict, name: str, scale: float, fmt: str) -> str:
    ci = x.get(name + "_ci95")
    if x.get(name) is None or ci is None:
        return "-"
    return f"{scale * x[name]:{fmt}} [{scale * ci[0]:{fmt}}, {scale * ci[1]:{fmt}}]"


def _print_goal_cis(gl, sets=("artifact", "artifact-generator")) -> None:
    """Per SLO, the goals on the recorded artifact traces and on the held-out generator set
    with their cluster-bootstrap 95% intervals (simulated link), so that a miss on 10 traces
    can be read against its uncertainty."""
    sel = [x for x in gl if x["trace_set"] in sets and x["link"] == "simulated" and "n_traces" in x]
    if not sel:
        return
    print("goals with paired cluster-bootstrap 95% intervals (resampling traces; simulated link). G1: adaptive - "
          "oracle violations (points), limit +5; G2: adaptive - best fixed KL of met loads, limit 0; "
          "verdict of the interval: met / missed / inconclusive")
    for slo in sorted({x["slo_s"] for x in sel}):
        for x in sorted((x for x in sel if x["slo_s"] == slo), key=lambda x: sets.index(x["trace_set"])):
            print(f"  SLO {slo:g} s {x['trace_set']:>18} ({_requests(x)}): "
                  f"G1 {_fmt_ci(x, 'violation_diff_vs_oracle', 100, '+.1f')} -> point {_verdict(x.get('g1_slo'))}, "
                  f"interval {x.get('g1_ci')}; G2 vs {x.get('best_fixed') or '-'} "
                  f"{_fmt_ci(x, 'kl_met_diff_vs_best_fixed', 1, '+.4f')} -> point {_verdict(x.get('g2_quality'))}, "
                  f"interval {x.get('g2_ci')} (comparators {x.get('g2_ci_comparators')}); all loads vs "
                  f"{x.get('best_fixed_all')} "
                  f"{_fmt_ci(x, 'kl_all_diff_vs_best_fixed_all', 1, '+.4f')} ({x.get('g2_all_ci')})")


if __name__ == "__main__":
    sys.exit(main())
