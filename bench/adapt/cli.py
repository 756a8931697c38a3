"""Bandwidth adaptation judged against an oracle and fixed baselines (CacheGen section 5.2,
evaluation of section 7.4), on the real shaped link and in a clock-model simulation.

What runs:
1. Level table (once, cached in the output): a real KV of the default model (needle prompt,
   --context-tokens, seed 0) is encoded with the CacheGen codec at levels 0-5 in chunks of
   --chunk-tokens; per level and chunk: bytes, and decode seconds per token (codec.decode_kv
   on this CPU); the HF prefill speed of the same context is measured too.
2. Real link (`--real`, default on): streaming.link.ShapedLink (netns + tc tbf as root,
   else the userspace token bucket) with the KV store server; the store holds stand-in
   chunks (bench.standin_codec) of exactly the real per-level sizes, and the decoder does real
   CPU work (SHA-256 rounds) calibrated to the measured per-level decode time. The shaper
   follows each trace chunk by chunk (streaming.adapt.traces.apply_trace); the AdaptivePolicy
   runs unmodified through streaming.load.stream_load (abandon on overrun included).
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
Goals are judged per trace set with paired cluster-bootstrap 95% intervals
(resampling traces, each trace's start offsets together; goals(), cluster_bootstrap_diff).
Quality: per-level KL from benchmarks/quality.json when present (token-weighted mean KL of
a load; text chunks are recomputed exactly, KL 0); otherwise quality_kl is null and the
planner uses an ordinal utility (higher level better, text best), stated in the output.

Run (default; ~3 min quiet (115 s on 2026-11-30 before the held-out set, which adds ~45 s),
5.4 min at load 3.7-4 (2026-12-01), 16 min at load 9-14):  python -m bench.adapt
Quick (~2 min; ~1 min with --level-table):   python -m bench.adapt --quick
Simulation only, reusing a level table:      python -m bench.adapt --no-real --level-table benchmarks/adaptation.json
The dip reserve (evaluated, not the default): add --dip-reserve
Tuning of the policy (TUNING traces only):   python scripts/adapt_tune.py (docs/streaming.md section 4)
Output: benchmarks/adaptation.json (schema: docs/results-schema.md, section adaptation.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from cachegen_common import flags
from cachegen_common.config_file import CONFIGS, parse_with_config
from cachegen_common.files import atomic_write_json
from cachegen_common.header import environment as header_environment
from streaming.adapt.params import DEFAULT_PRESET, POLICY_PRESETS, preset as policy_preset
from streaming.adapt.traces import GENERATOR_SEED
from bench.adapt.sim import (
    SLOS, ISSUE_ALL_TEXT_S, measure_level_table, load_quality, start_offsets, trace_sets,
    TUNING, simulate_all,
)
from bench.adapt.stats import aggregate, BOOT_REPS, BOOT_SEED, BOOT_MIN_TRACES, goals
from bench.adapt.real import run_real, sim_vs_real
from bench.adapt.report import print_summary

_REPO = Path(__file__).resolve().parents[2]


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
    """adaptation.json's ``environment`` (:func:`cachegen_common.header.environment`)."""
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
    flags.add_config(ap, default=CONFIGS / "adaptation.yaml")
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
                    help="the adaptive policy's parameters: a preset of streaming.adapt.params.PolicyParams "
                         f"(default {DEFAULT_PRESET}: chosen on the tuning traces; 'default': AdaptivePolicy's "
                         "own defaults); recorded as config.policy_preset")
    ap.add_argument("--dip-reserve", action="store_true",
                    help="run the adaptive policy with the dip reserve (DIP_RESERVE: dip_chunks=5, "
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
    a = parse_with_config(ap, argv)
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
                                    "generator": "streaming.adapt.traces.artifact_generator: iid uniform 0.1-10 Gbit/s "
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
    print_summary(rows, agree, checks, doc["goals"])
    print(f"wrote {a.out} ({doc['wall_s']} s)")
    return 0

