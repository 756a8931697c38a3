"""Benchmark contexts and store population (stages 1-2 of ``run_benchmarks.py``).

1. Prompts of the configured tasks are built offline (``kv_extraction_hf.prompts``, or
   the user's file given by ``--data-path``); the context part of each is prefilled once
   with transformers and its KV cache kept.
2. Every KV mode encodes the loadable prefix (a multiple of the engine's KV block,
   strictly shorter than the prompt) into independently decodable chunks (codec) and puts
   them into the KV store server, which runs behind a real shaped link (streaming.link).

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 5 (chunks encoded independently so
each can be streamed at its own level). Run: ``python run_benchmarks.py``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

import codec as codec_pkg
from evaluation.summary import plot_label
from harness.config import RunConfig
from kv_extraction_hf.errors import ExtractionError
from kv_extraction_hf.extract import prefill_kv
from kv_extraction_hf.prompts import build_prompt
from streaming.identity import codec_identity, level_slot, model_identity

KV_MODES = ("raw", "quant8", "kivi2", "kivi4", "fp8", "cachegen", "kvtc")
"""Modes whose request loads KV from the store (``text`` prefills; the adaptive mode
reads the ``cachegen`` entries at a per-chunk level)."""


class BenchmarkError(RuntimeError):
    """A run that cannot proceed (missing engine, model, store, bad sizes); printed as one line."""


def log(msg: str) -> None:
    """A time-stamped progress line on stderr (the console keeps progress and the summary)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Variant:
    """One measured configuration: ``mode`` and ``level`` (cachegen / kvtc levels; else None)."""

    mode: str
    level: int | None = None

    @property
    def label(self) -> str:
        """Plot/summary label: ``mode`` or ``mode-l<level>`` (docs/results-schema.md)."""
        return plot_label(self.mode, self.level)

    @property
    def codec(self) -> str | None:
        """Codec name in the store entry this variant reads (None = text)."""
        if self.mode == "text":
            return None
        return "cachegen" if self.mode == "cachegen-adaptive" else self.mode


@dataclass
class Context:
    """One benchmark context: its prompt, its KV and where the store keeps it.

    ``k``/``v``: ``[L, T_load, H, D]`` model dtype; ``load_tokens``: loadable prefix
    (multiple of the KV block, < len(prompt)); ``keys``: codec name -> store key;
    ``sizes``: (codec, level) -> stored bytes (level None for single-level codecs);
    ``dtype_bytes``: bytes of K+V of the prefix in the model dtype;
    ``hf_prefill_tps``: tokens/s of the HF prefill that extracted this context.
    """

    cid: str
    prompt: Any
    k: Any
    v: Any
    load_tokens: int
    keys: dict[str, str] = field(default_factory=dict)
    identities: dict[str, dict] = field(default_factory=dict)  # codec -> stored EntryIdentity dict
    sizes: dict[tuple[str, int | None], int] = field(default_factory=dict)
    dtype_bytes: int = 0
    hf_prefill_tps: float = 0.0


def variants(cfg: RunConfig, codec_levels: tuple[int, ...],
             kvtc_levels: tuple[int, ...] = ()) -> list[Variant]:
    """Expand modes into variants, text first (it provides the lossless reference output).

    ``cachegen`` expands into one variant per level of ``cfg.levels`` (all of
    ``codec_levels`` when None), ``kvtc`` into one per level of ``cfg.kvtc_levels`` (all
    of ``kvtc_levels`` when None); every other mode is one variant with level None.
    """
    out: list[Variant] = []
    order = sorted(cfg.modes, key=lambda m: (m != "text", cfg.modes.index(m)))
    for mode in order:
        if mode == "cachegen":
            out.extend(Variant("cachegen", lv) for lv in (cfg.levels or codec_levels))
        elif mode == "kvtc":
            out.extend(Variant("kvtc", lv) for lv in (cfg.kvtc_levels or kvtc_levels))
        else:
            out.append(Variant(mode))
    return out


def store_levels(vlist: list[Variant], cfg: RunConfig,
                 codec_levels: tuple[int, ...]) -> dict[str, list[int | None]]:
    """Codec name -> levels its store entry must hold for these variants.

    The adaptive mode needs every configured cachegen level (it picks one per chunk);
    single-level codecs map to ``[None]``.
    """
    out: dict[str, list[int | None]] = {}
    for var in vlist:
        if var.codec is None:
            continue
        if var.mode == "cachegen-adaptive":
            out["cachegen"] = sorted(set(out.get("cachegen", [])) | set(cfg.levels or codec_levels))
        elif var.mode in ("cachegen", "kvtc"):
            out[var.mode] = sorted(set(out.get(var.mode, [])) | {var.level})
        else:
            out[var.codec] = [None]
    return out


def load_prefix(context_tokens: int, prompt_tokens: int, block_tokens: int,
                whole_blocks: bool = True) -> int:
    """Tokens of the context whose KV is loaded, strictly fewer than the prompt (the engine
    must prefill at least one token to produce logits): rounded down to whole KV blocks of
    ``block_tokens`` when ``whole_blocks``, else every such token (the vLLM connector loads
    a partial last block; docs/vllm-connector.md, "The last partial block")."""
    n = min(context_tokens, prompt_tokens - 1)
    return n // block_tokens * block_tokens if whole_blocks else n


def build_contexts(cfg: RunConfig, bundle) -> list[Context]:
    """Prompts of every task, their context KV extracted once (tqdm progress).

    Raises:
        BenchmarkError: a task cannot build its prompt (bad data, size too small) or a
            context is shorter than one KV block.
    """
    jobs = [(t, i) for t in cfg.tasks for i in range(cfg.num_contexts)]
    out = []
    for task, i in tqdm(jobs, desc="extract KV", unit="ctx", file=sys.stderr):
        try:
            p = build_prompt(task, bundle.tokenizer, cfg.context_tokens, seed=cfg.seed, index=i,
                             max_prompt_tokens=bundle.info.max_context, **prompt_data_kwargs(cfg))
        except ExtractionError as exc:
            raise BenchmarkError(f"task {task!r}: {exc}") from None
        load = load_prefix(len(p.context_ids), len(p.input_ids), cfg.block_tokens,
                           whole_blocks=cfg.whole_blocks or cfg.vllm_hybrid_kv)
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


def prompt_data_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The ``build_prompt`` keyword arguments for the user's data (``--data-path``,
    ``--data-map``, ``--no-truncate``); empty when the run uses the built-in generators."""
    if not cfg.data_path:
        return {}
    return {"data_path": cfg.data_path, "data_map": dict(cfg.data_map or {}) or None,
            "truncate": cfg.truncate}


def chunk_ranges(load_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` token ranges of the streamed chunks of a prefix (the last
    may be shorter)."""
    return [(a, min(a + chunk_tokens, load_tokens)) for a in range(0, load_tokens, chunk_tokens)]


def store_layout(cfg: RunConfig, info) -> tuple[list[int | None] | None, int]:
    """(windows, extra_tokens) of the store's entries: sliding-window storage
    (``codec.window``: a sliding layer keeps its last W + ``cfg.block_tokens`` tokens, so a
    block-aligned load one block short of the entry is still servable) when
    ``cfg.window_storage`` is "auto" and the model has sliding-window layers
    (``info.hybrid``), with vLLM's hybrid KV cache manager on or off (on, the connector
    writes a sliding layer only the tokens of the blocks it keeps, all within the stored
    W + block); else (None, 0): the full layout."""
    if cfg.window_storage != "auto" or not getattr(info, "hybrid", False):
        return None, 0
    ws = [info.sliding_window if info.kind(i) == "sliding" else None for i in range(info.num_layers)]
    return ws, cfg.block_tokens


def _calibration_tag(config: Any) -> str:
    """The calibration hashes a window layout's per-group config dict {layers: KvtcConfig}
    names, in layer-group order, joined by "+" (EntryIdentity.calibration_hashes); ""
    for any other config."""
    if isinstance(config, dict):
        return "+".join(getattr(c, "calibration", "") or "" for _, c in sorted(config.items()))
    return ""


def populate_store(cfg: RunConfig, client, info, contexts: list[Context],
                   codec_levels: dict[str, list[int | None]],
                   configs: dict[str, Any] | None = None,
                   failures: list[dict] | None = None,
                   layout: tuple[list[int | None] | None, int] = (None, 0),
                   points: dict[str, dict] | None = None) -> None:
    """Encode every context with every codec (all levels) and put it into the store.

    Fills ``ctx.keys`` (codec -> store key) and ``ctx.sizes`` ((codec, level) -> bytes).
    ``configs``: codec name -> the config object its encodes get (kvtc: a
    ``codec.kvtc.KvtcConfig`` naming its calibration; the level is set per call). A codec
    that names a calibration artifact in its header (kvtc) puts the artifact's hash into
    the entry identity, so an entry made with another calibration never hits.
    An encode that fails (ValueError, incl. codec.CodecError) leaves that codec out of
    ``ctx.keys``: with ``failures`` (a list) a ``failure_record`` ("encode") is appended
    and a one-line log says why; without it the error is raised as BenchmarkError.
    ``layout``: ``store_layout``'s (windows, extra_tokens); with windows the chunks are
    ``codec.window.encode_windowed_chunks`` containers and the entry identity's
    ``kv_layout`` names the layout (a reader of the full layout never gets them; a load
    shorter than ``codec.window.layout.min_load_tokens`` is a miss).
    ``points``: codec -> its operating point's summary (``harness.targets.point_summaries``:
    target, codec, level, hash, table), named in the manifest ``meta`` of that codec's
    entries as ``operating_point`` (not part of the identity: a reader needs only the chunks).
    """
    from codec import window

    configs = configs or {}
    ws, extra = layout
    jobs = [(c, name) for c in contexts for name in codec_levels]
    for ctx, name in tqdm(jobs, desc="encode + store", unit="entry", file=sys.stderr):
        chunks: dict[int | None, list[bytes]] = {}
        try:
            for lv in codec_levels[name]:
                if ws is not None:
                    data = window.encode_windowed_chunks(ctx.k, ctx.v, ws, codec=name, level=lv,
                                                         config=configs.get(name),
                                                         chunk_tokens=cfg.chunk_tokens, extra_tokens=extra)
                else:
                    data = codec_pkg.encode_chunks(ctx.k, ctx.v, codec=name, level=lv,
                                                   config=configs.get(name),
                                                   chunk_tokens=cfg.chunk_tokens)
                chunks[level_slot(name, lv)] = data
                ctx.sizes[(name, lv)] = sum(len(d) for d in data)
        except ValueError as exc:
            reason = one_line(exc)
            if failures is None:
                raise BenchmarkError(f"{name} encode failed: {reason}") from None
            log(f"{name}: encode failed on {ctx.cid}: {reason} (its runs are skipped)")
            failures.extend(failure_record("encode", name, lv, reason, context_id=ctx.cid)
                            for lv in codec_levels[name])
            continue
        # the key and manifest carry the full identity (model, tokenizer, dtype, shape, codec
        # config per level, codec version): a reused store with a changed schedule misses
        ident = codec_identity(model_identity(info), name, codec_levels[name],
                               calibration_hash=_calibration_tag(configs.get(name)) if ws is not None
                               else calibration_of(chunks))
        if ws is not None:
            ident = ident.replace(kv_layout=window.layout.layout_tag(ws, extra))
        ctx.identities[name] = ident.to_dict()
        ctx.keys[name] = client.put_entry(ident, ctx.prompt.context_ids[:ctx.load_tokens], chunks,
                                          chunk_ranges(ctx.load_tokens, cfg.chunk_tokens),
                                          meta={"context": ctx.cid, **({"operating_point": points[name]}
                                                                       if name in (points or {}) else {})})


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``"<Type>: <message>"`` of an exception on one line, at most ``limit`` characters."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}"[:limit] if msg else type(exc).__name__


def failure_record(stage: str, mode: str, level: int | None, reason: str,
                   **extra: Any) -> dict[str, Any]:
    """One entry of results.json ``failures`` (docs/results-schema.md): ``stage``
    ("calibration" | "encode" | "perplexity" | "request" | "load" | "adaptation"), ``mode``, ``level``, ``label``
    (``plot_label``), ``reason`` (one line) and optional extra fields (``context_id``,
    ``bandwidth_mbps``, ``repeat``)."""
    return {"stage": stage, "mode": mode, "level": level, "label": plot_label(mode, level),
            "reason": reason, **extra}


def calibration_of(chunks: dict[int | None, list[bytes]]) -> str:
    """The calibration hash the encoded chunks name in their headers (kvtc's
    ``config.calibration``), "" when the codec uses none. Raises BenchmarkError when the
    levels of one entry name different calibrations."""
    found = set()
    for data in chunks.values():
        for d in data[:1]:
            cfg = codec_pkg.peek_header(d).get("config") or {}
            if isinstance(cfg, dict) and cfg.get("calibration"):
                found.add(str(cfg["calibration"]))
    if len(found) > 1:
        raise BenchmarkError(f"one store entry's levels name {len(found)} calibrations")
    return found.pop() if found else ""
