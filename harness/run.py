"""The benchmark run behind ``run_benchmarks.py``: the stages wired in order.

extract -> encode -> store + shaped link -> stream + decode -> inject -> measure.
Stages: harness.contexts (prompts, KV, store population), harness.engines (HF / vLLM
engines and the request protocol), harness.quality (scores, perplexity pass),
harness.adaptation (traces, SLO), harness.results (records, results.json, the table);
harness.lifecycle makes every way a run ends clean up after it.
Paper: CacheGen (Liu et al., SIGCOMM 2024) sections 5-7. Run: ``python run_benchmarks.py``.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm import tqdm

import codec as codec_pkg
from codec.schedules import HARNESS_LEVELS
from evaluation.summary import higher_is_better
from harness import fault_injection, lifecycle
from harness.adaptation import adaptation_experiment, slo_violated
from harness.config import ROOT, RunConfig
from harness.contexts import (BenchmarkError, build_contexts, failure_record, log,
                              one_line, populate_store, store_layout, store_levels, variants)
from harness.engines.api import Engine
from harness.engines.hf import HFEngine
from harness.engines.vllm import VLLMEngine, check_vllm, vllm_model_check
from harness.engines.numerics import extraction_dtype
from harness.engines.protocol import measure_prefill_speed, request_params, warm_up_variants
from harness.quality import perplexity_pass, score_output
from harness.targets import apply_target, point_summaries
from cachegen_common.header import git_commit
from harness.results import ResultsWriter, environment, print_summary, run_record
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.model import load_model
from streaming.link import ShapedLink
from streaming.link.cleanup import cleanup_stale
from streaming.store.redis_server import cleanup_stale_dirs
from streaming.errors import StoreError
from streaming.store.redis_cluster import check_cluster_store, is_cluster_url
from streaming.store import start_store_server

FILL_RATE_MBPS = 10_000.0  # link rate while filling the store: not measured, so not throttled
MAX_LEN_MARGIN_TOKENS = 16  # vLLM's max_model_len above the longest prompt + output
STORE_CLIENT_TIMEOUT_S = 120.0  # filling the store: a whole multi-level entry per put (MBs on 2 cores)


def resolve_out(cfg: RunConfig) -> Path:
    """The results file: ``cfg.out``, relative paths against the repository root."""
    out = Path(cfg.out)
    return out if out.is_absolute() else Path(ROOT) / out


def engine_log_path(out_path: Path) -> Path:
    """Where the engine's own logs go: ``<results stem>.engine.log`` beside the results."""
    return out_path.with_name(out_path.stem + ".engine.log")


LOG_ENV_KEYS = ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")


@contextlib.contextmanager
def _restore_env(saved: dict[str, str | None]):
    """Restore the environment variables in ``saved`` (None = unset) when the block ends."""
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def route_engine_logs(path: Path) -> None:
    """Send vLLM's logs (this process and its engine processes, which inherit the
    environment) to ``path`` instead of the console: a logging config for vLLM's
    ``VLLM_LOGGING_CONFIG_PATH``. Must run before vLLM is imported."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    handler = {"class": "logging.FileHandler", "filename": str(path), "mode": "a",
               "formatter": "plain", "level": "INFO"}
    conf = {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(process)d "
                                               "%(name)s: %(message)s"}},
            "handlers": {"file": handler},
            "loggers": {name: {"handlers": ["file"], "level": "INFO", "propagate": False}
                        for name in ("vllm", "cachegen")}}  # vllm.* incl. our connector; cachegen.*: sources, warm-up
    conf_path = path.with_name(path.name + ".config.json")
    conf_path.write_text(json.dumps(conf))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(conf_path)


@contextlib.contextmanager
def stderr_to(path: Path | None):
    """Point file descriptor 2 at ``path`` (appending) while the block runs, so processes
    started in it (vLLM's engine core and workers) write their warnings and progress bars
    there for their whole life; this process's stderr is restored after. No-op for None."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def cleanup_leftovers() -> None:
    """Remove what killed runs left: their processes, shm, temp folders (run registry),
    shaped-link namespaces and Redis data folders; says what was removed."""
    lifecycle.cleanup_stale_runs(log=log)
    try:
        gone = cleanup_stale()
        if gone:
            log(f"removed shaped-link leftovers of a killed run: {', '.join(gone)}")
    except Exception as exc:  # noqa: BLE001 - stale cleanup is best effort
        log(f"warning: stale link cleanup failed: {exc}")
    gone = cleanup_stale_dirs()
    if gone:
        log(f"removed Redis folders of a killed run: {', '.join(gone)}")


def run(cfg: RunConfig, argv: list[str], verbose: bool = False) -> dict[str, Any]:
    """Run the whole benchmark; returns the results document (also written to cfg.out).

    Args:
        cfg: the resolved configuration.
        argv: the command line (recorded in results.json).
        verbose: keep vLLM's logs on the console (else they go to ``*.engine.log``).
    Raises:
        BenchmarkError: engine, model or store unavailable, or bad task sizes.
        KeyboardInterrupt / lifecycle.Terminated: interrupted; the exception carries
            ``results_path`` (None when no results file was written) and ``n_runs``.
    """
    t_run = time.perf_counter()
    out_path = resolve_out(cfg)
    state: dict[str, ResultsWriter] = {}  # "writer" once results.json is being written
    # route_engine_logs changes the environment that vLLM's processes inherit: put it back
    # after the run, so processes started later by the caller (tests, a server) log as usual
    saved_env = {k: os.environ.get(k) for k in LOG_ENV_KEYS}
    if cfg.store and is_cluster_url(cfg.store):  # a bad cluster: one line, before anything starts
        try:
            check_cluster_store(cfg.store)
        except (ValueError, StoreError) as exc:
            raise BenchmarkError(str(exc)) from None
    with lifecycle.RunRegistry() as registry, _restore_env(saved_env):
        try:
            cleanup_leftovers()
            if cfg.engine == "vllm" and not verbose:
                route_engine_logs(engine_log_path(out_path))
                log(f"vLLM logs: {engine_log_path(out_path)}")
            if cfg.engine == "vllm":
                check_vllm()
            with ExitStack() as stack:
                stack.enter_context(fault_injection.install(log=log))   # off unless $CACHEGEN_FAULT
                _run_stages(cfg, argv, out_path, stack, registry, state, verbose)
        except (KeyboardInterrupt, SystemExit) as exc:
            writer = state.get("writer")
            exc.results_path = out_path if writer is not None and writer.written else None
            exc.n_runs = len(writer.doc["runs"]) if writer is not None else 0
            raise
    writer = state["writer"]
    writer.finish(wall_s=time.perf_counter() - t_run)
    print_summary(writer.doc)
    log(f"wrote {out_path} ({len(writer.doc['runs'])} runs) in {writer.doc['wall_s']:.0f} s")
    return writer.doc


def _run_stages(cfg: RunConfig, argv: list[str], out_path: Path, stack: ExitStack,
                registry: lifecycle.RunRegistry, state: dict[str, ResultsWriter],
                verbose: bool = False) -> None:
    """Stages 1-5 inside ``stack`` (link, servers, engine, temp folder); the results
    writer is put in ``state["writer"]`` as soon as it exists."""
    log("loading model")
    try:
        # under vLLM the KV is extracted in the engine's dtype: an entry of another dtype
        # is never served (the connector's identity check), so a float32 checkpoint would
        # otherwise give a run whose KV requests all miss
        bundle = load_model(cfg.model, dtype=extraction_dtype(cfg.engine), log=log)
    except ExtractionError as exc:
        raise BenchmarkError(str(exc)) from None
    info = bundle.info
    if cfg.engine == "vllm":
        log(vllm_model_check(info, cfg.vllm_hybrid_kv))   # one-line refusal of a layer kind
    # a codec that fails (its calibration, an encode, a decode) is recorded in "failures"
    # with its reason and the run goes on without it
    failures: list[dict[str, Any]] = []
    configs: dict[str, Any] = {}     # codec -> the config its encodes get
    layout = store_layout(cfg, info)  # (windows, extra tokens): sliding-window storage, or (None, 0)
    kvtc_record, kvtc_error = None, None
    if "kvtc" in cfg.modes:
        try:
            kvtc_record, configs["kvtc"] = prepare_kvtc(bundle, layout[0])
        except BenchmarkError as exc:
            log(f"kvtc: {exc} (the kvtc rows are recorded as failed, the run goes on)")
            kvtc_error = str(exc)
    # --target: each codec's levels become its operating point on this model (fitted on first use)
    cfg, points_record = apply_target(cfg, bundle, configs, layout[0])
    points = point_summaries(points_record)
    codec_levels_all = tuple(sorted(HARNESS_LEVELS))
    vlist = variants(cfg, codec_levels_all, tuple(codec_pkg.levels("kvtc")))
    levels = store_levels(vlist, cfg, codec_levels_all)
    if kvtc_error is not None and "kvtc" in levels:
        failures.extend(failure_record("calibration", "kvtc", lv, kvtc_error) for lv in levels.pop("kvtc"))
    contexts = build_contexts(cfg, bundle)
    max_new = max(c.prompt.max_new_tokens for c in contexts)
    max_len = max(len(c.prompt.input_ids) for c in contexts) + max_new + MAX_LEN_MARGIN_TOKENS

    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cachegen-run-")))
    registry.add_dir(tmp)
    link = stack.enter_context(ShapedLink(max(cfg.bandwidth_mbps), method=cfg.link_method))
    backend = cfg.store or str(tmp / "store")
    if backend == "redis":
        # a real redis-server (Debian's) started beside the store server, behind the link
        from streaming.store.redis_server import RedisServer

        backend = stack.enter_context(RedisServer(link=link)).direct_url
    elif backend.startswith(("redis://", "redis+cluster://")) and link.method != "userspace-tokenbucket":
        raise BenchmarkError(
            "an external redis:// or redis+cluster:// store is reachable from the store server only with "
            "--link-method userspace; use --store redis to let the harness start Redis "
            "behind the shaped link")
    log(f"link: {link.method}; store backend: {backend}")
    server = start_store_server(backend, link=link)
    stack.callback(server.stop)
    registry.snapshot()
    store_addr = f"{server.host}:{server.port}"
    client = server.client(timeout=STORE_CLIENT_TIMEOUT_S)
    link.set_rate(FILL_RATE_MBPS)
    if layout[0] is not None:
        log(f"window storage: sliding layers keep their last {info.sliding_window} + {layout[1]} tokens")
    populate_store(cfg, client, info, contexts, levels, configs=configs, failures=failures, layout=layout,
                   points=points)

    header = {"command": " ".join(argv), "git_commit": git_commit(Path(ROOT)),
              "environment": environment(link.method),
              "model": {k: getattr(info, k) for k in ("model_id", "weights_hash", "dtype",
                                                      "num_layers", "num_kv_heads", "head_dim")},
              "config": cfg.to_dict(), "higher_is_better": higher_is_better()}
    if kvtc_record is not None:
        header["kvtc_calibration"] = kvtc_record
    if points_record is not None:
        header["operating_points"] = points_record
    header["store_layout"] = {"window_storage": cfg.window_storage, "applied": layout[0] is not None,
                              "windows": layout[0], "extra_tokens": layout[1]}
    writer = state["writer"] = ResultsWriter(out_path, header)
    writer.add_failures(failures)
    ppl: dict[str, dict] = {}
    # variants whose codec has no store entry for a context are not served there (failed)
    if cfg.quality:
        log("quality: perplexity and KL of held-out continuations (HF engine)")
        ppl_fail: list[dict[str, Any]] = []
        ppl, layer_rows = perplexity_pass(cfg, bundle,
                                          [v for v in vlist if v.codec is None
                                           or v.codec in levels], configs=configs,
                                          failures=ppl_fail, layout=layout)
        writer.extend("codec_layers", layer_rows)
        writer.add_failures(ppl_fail)

    engine: Engine
    if cfg.engine == "vllm":
        log("starting vLLM (one engine, our connector, for every mode)")
        with stderr_to(None if verbose else engine_log_path(out_path)):
            engine = VLLMEngine(info.path, tmp / "connector-stats.jsonl", max_len, store_addr,
                                hybrid_kv=cfg.vllm_hybrid_kv)
    else:
        engine = HFEngine(bundle)
    stack.callback(engine.close)
    # what sets the engine's numerics (threads, binding, dtype, seed): see "Reproducibility"
    writer.doc["environment"]["engine"] = dict(engine.settings)
    registry.snapshot()
    link.set_rate(max(cfg.bandwidth_mbps))
    prefill_tps = measure_prefill_speed(engine, contexts)
    log(f"{engine.name} prefill speed: {prefill_tps:.0f} tokens/s")
    if cfg.engine == "hf":  # the codecs decode in this process: compile their kernels untimed
        warm = warm_up_variants(engine, contexts[0], vlist, lambda v: request_params(
            v, contexts[0], store_addr, info, cfg, prefill_tps, max(cfg.bandwidth_mbps)))
        writer.doc["environment"]["engine"]["warmup_s"] = warm
        log(f"warm-up (untimed, one request per KV variant): {warm}")

    _ttft_requests(cfg, engine, bundle, vlist, contexts, link, store_addr, prefill_tps, ppl,
                   writer, points)
    _adaptation_stage(cfg, engine, bundle, levels, contexts, link, store_addr, writer)


def _ttft_requests(cfg: RunConfig, engine: Engine, bundle, vlist: list, contexts: list, link,
                   store_addr: str, prefill_tps: float, ppl: dict[str, dict],
                   writer: ResultsWriter, points: dict[str, dict] | None = None) -> None:
    """The timed requests: every (bandwidth, variant, context, repeat) request served and recorded, each
    scored against the text mode's output on the same context; a failed request is recorded
    in "failures" and the run goes on. ``points``: codec -> its operating point's summary
    (``harness.targets.point_summaries``), named on the rows of that codec at that level."""
    info = bundle.info
    refs: dict[str, tuple[str, list[int]]] = {}
    jobs = [(bw, var, ctx, rep) for bw in cfg.bandwidth_mbps for var in vlist
            for ctx in contexts for rep in range(cfg.repeats)]
    current_bw = None
    for bw, var, ctx, rep in tqdm(jobs, desc="TTFT runs", unit="req", file=sys.stderr):
        if var.codec is not None and var.codec not in ctx.keys:
            continue            # its calibration or encode failed: in "failures" already
        if bw != current_bw:
            link.set_rate(bw)
            current_bw = bw
        params = request_params(var, ctx, store_addr, info, cfg, prefill_tps, bw)
        try:
            t = engine.serve(ctx, var, params, ctx.prompt.max_new_tokens)
        except (BenchmarkError, ValueError) as exc:   # incl. codec.CodecError
            reason = one_line(exc)
            log(f"{var.label}: request on {ctx.cid} failed: {reason} (recorded, the run "
                f"goes on)")
            writer.add_failures([failure_record("request", var.mode, var.level, reason,
                                                context_id=ctx.cid, bandwidth_mbps=bw,
                                                repeat=rep)])
            continue
        text = bundle.tokenizer.decode(t.output_ids, skip_special_tokens=True)
        if var.mode == "text" and ctx.cid not in refs:
            refs[ctx.cid] = (text, t.output_ids)
        ref_text, ref_ids = refs.get(ctx.cid, (None, None))
        q = score_output(ctx.prompt, text, t.output_ids, ref_text, ref_ids)
        q.update(ppl.get(var.label, {}))
        adaptive = var.mode == "cachegen-adaptive"
        if var.codec is not None and getattr(t, "miss_reason", None):
            log(f"{var.label}: request on {ctx.cid} loaded nothing: {t.miss_reason} "
                f"(recorded in failures)")
            writer.add_failures([failure_record("load", var.mode, var.level, t.miss_reason,
                                                context_id=ctx.cid, bandwidth_mbps=bw,
                                                repeat=rep)])
        rec = run_record(var, bw, engine.name, ctx, rep, t, q, text, cfg.slo_s if adaptive else None,
                         slo_violated(t, cfg.slo_s, prefill_tps) if adaptive else None)
        point = (points or {}).get(var.mode)
        if point is not None and point["level"] == var.level:
            rec["operating_point"] = point
        writer.add_run(rec)


def _adaptation_stage(cfg: RunConfig, engine: Engine, bundle, levels: dict, contexts: list, link,
                      store_addr: str, writer: ResultsWriter) -> None:
    """After the timed requests: the engine closed, the adaptation experiment over the bandwidth traces on the
    first context's cachegen entry (recorded as not run when that entry's encode failed)."""
    info = bundle.info
    engine.close()  # a live vLLM engine would compete for the CPU with the HF engine below
    if cfg.traces and "cachegen" in levels and "cachegen" not in contexts[0].keys:
        # the adaptation experiment streams the first context's cachegen entry: its encode
        # failed (in "failures" already), so the experiment is recorded as not run
        why = "adaptation experiment skipped: the first context has no cachegen entry (its encode failed)"
        log(why)
        writer.add_failures([failure_record("adaptation", "cachegen-adaptive", None, why)])
    elif cfg.traces and "cachegen" in levels:
        hf_tps = statistics.median(c.hf_prefill_tps for c in contexts)
        writer.extend("adaptation", adaptation_experiment(cfg, bundle, link, store_addr, info,
                                                          contexts, hf_tps))


def prepare_kvtc(bundle, windows=None) -> tuple[dict[str, Any], Any]:
    """(provenance, config) of the kvtc encodes: the model's default kvtc calibration
    (kv_extraction_hf.calibrate.default_calibration, on the default calibration text),
    fitted on first use then cached, registered; with ``windows`` (sliding-window storage,
    harness.contexts.store_layout) one calibration per layer group instead
    (kv_extraction_hf.calibrate.groups, same text and settings). provenance: results.json
    ``kvtc_calibration`` (``calibration_provenance``: hash, source, group_layers, text
    {source, description, sha256}; per group under ``groups``); config: a ``KvtcConfig``
    (or ``{layers: KvtcConfig}``) for every kvtc encode. The hash(es) enter every kvtc
    entry's identity (harness.contexts.populate_store); a decode (here or in the vLLM
    connector's worker) finds the artifact by hash in the cache folder. BenchmarkError
    when no calibration can be made."""
    from codec import kvtc
    from codec.kvtc import KvtcConfig
    from kv_extraction_hf.calibrate import calibration_provenance, default_calibration

    log("kvtc: default calibration (fitted on first use, then cached)"
        + (", one per layer group (window storage)" if windows is not None else ""))
    try:
        if windows is not None:
            from kv_extraction_hf.calibrate.groups import group_calibrations, groups_record

            hashes = group_calibrations(bundle, windows, log=log)
            rec = groups_record(hashes, "default (per layer group)")
            log("kvtc: calibrations " + ", ".join(f"{len(g['layers'])} layers {g['hash'][:12]}"
                                                  for g in rec["groups"]))
            return rec, {g: KvtcConfig(calibration=h) for g, h in hashes.items()}
        path = default_calibration(bundle, log=log)
        rec = calibration_provenance(kvtc.load_calibration(path), "default")
    except (ExtractionError, kvtc.CodecError, OSError, ValueError) as exc:
        raise BenchmarkError(f"kvtc calibration unavailable: {exc}") from None
    log(f"kvtc: calibration {rec['hash'][:16]} (text: {rec['text']['source']}, sha256 "
        f"{rec['text']['sha256'][:12]})")
    return rec, KvtcConfig(calibration=rec["hash"])
