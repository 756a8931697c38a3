"""Text fidelity of the quality benchmark: codec lists and labels, the per-window scores
(KL, top-1 agreement, perplexity) and :func:`run_text_quality` over WikiText-2 windows.
Part of bench.quality (the command is bench.quality.cli)."""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from bench.quality.config import DEFAULT_BATCH, DEFAULT_CODEC_WORKERS, FAMILY_DEFAULT, QualityError


# ----------------------------------------------------------------------------- codecs
def codec_levels(name: str) -> list[Optional[int]]:
    """The levels to measure for registered codec ``name`` (``codec.level_table``),
    ``[None]`` for codecs without levels (raw, fp8, quant8, kivi). ValueError on an
    unknown codec."""
    from codec import level_table

    return list(level_table.levels(name)) or [None]


def default_level(name: str) -> Optional[int]:
    """The level a codec uses when none is given (``codec.level_table``; None for codecs
    without levels). ValueError on an unknown codec."""
    from codec import level_table

    return level_table.default_level(name)


def parse_codec_spec(spec: Optional[str]) -> list[tuple[str, Optional[int]]]:
    """``"all"``/None -> every registered codec and level (:func:`codec_levels`), raw
    last; else ``"name[:l1,l2];name2;..."`` (``;``-separated; levels optional = all;
    also LMCache's serdes ``lmcache-fp8``, ``lmcache-asym_k16_v8`` and ours inside LMCache,
    ``lmcache-<codec>-<tokens>[-max|-r<ratio>]``: bench/lmcache/rows.py; those need lmcache).
    Raises QualityError for an unknown codec or level."""
    import codec
    from bench.lmcache import peers as lmcache_peers
    from bench.lmcache import rows as lmcache_rows

    out: list[tuple[str, Optional[int]]] = []
    if spec is None or spec.strip() == "all":
        names = [n for n in codec.CODECS if n != "raw"] + (["raw"] if "raw" in codec.CODECS else [])
        for n in names:
            out.extend((n, lv) for lv in codec_levels(n))
        # LMCache's own serdes, when lmcache imports (the optional .venv-lmcache)
        out[-1:-1] = [(n, None) for n in lmcache_peers.available()] if out else []
        return out
    for part in [p.strip() for p in spec.split(";") if p.strip()]:
        name, _, levels = part.partition(":")
        name = name.strip()
        # our serdes inside LMCache (bench/lmcache/rows.py) and LMCache's own serdes
        ours, peer = lmcache_rows.is_row(name), lmcache_peers.is_peer(name)
        if ours or peer:
            if not (lmcache_rows.can_run(name) if ours else name in lmcache_peers.available()):
                raise QualityError(f"'{name}' needs lmcache (bash scripts/setup.sh lmcache; "
                                   f"run with .venv-lmcache/bin/python)")
            if levels.strip():
                raise QualityError(f"'{name}' has no levels" + (" (the serde picks them)" if ours else ""))
            out.append((name, None))
            continue
        if name not in codec.CODECS:
            raise QualityError(f"unknown codec '{name}' (available: {', '.join(sorted(codec.CODECS))})")
        allowed = codec_levels(name)
        if not levels.strip():
            out.extend((name, lv) for lv in allowed)
            continue
        for tok in levels.split(","):
            try:
                lv = int(tok)
            except ValueError:
                raise QualityError(f"level '{tok}' of codec '{name}' is not an integer") from None
            if lv not in allowed:
                raise QualityError(f"codec '{name}' has no level {lv} (levels: {allowed})")
            out.append((name, lv))
    return out


def level_label(name: str, level: Optional[int], anchors: tuple = (0, 0)) -> str:
    """The row label: ``codec.level_table.label``, plus `` +S/R`` for exact anchors
    (``codec.anchors``: S sink and R recent tokens stored exactly; none when (0, 0))."""
    from codec import level_table

    base = level_table.label(name, level)
    return base if not any(anchors) else f"{base} +{anchors[0]}/{anchors[1]}"


# ----------------------------------------------------------------------------- scores
def _row_dot(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product of two ``[n, vocab]`` float64 tensors (no ``[n, vocab]`` temporary)."""
    return torch.bmm(p.unsqueeze(1), x.unsqueeze(2)).reshape(-1)


def reference_scores(ref_logits: torch.Tensor, targets: Sequence[int]) -> dict:
    """What :func:`window_scores` needs from the lossless logits, computed once per window:
    float64 probabilities ``p`` ``[n, vocab]`` and their row sums ``s``, the per-row
    ``sum_v p * logits - s * logsumexp(logits)`` (``plp``), argmax ``[n]``, targets ``[n, 1]``
    and ``ref_nll`` (mean NLL, nats). Raises ValueError on bad shapes."""
    if ref_logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got {tuple(ref_logits.shape)}")
    tgt = torch.as_tensor(list(targets), dtype=torch.long).reshape(-1, 1)
    if tgt.shape[0] != ref_logits.shape[0]:
        raise ValueError(f"{tgt.shape[0]} targets for {ref_logits.shape[0]} logit rows")
    x = ref_logits.to(torch.float64)
    lse = torch.logsumexp(x, dim=-1)
    p = torch.exp(x - lse.unsqueeze(1))
    s = p.sum(-1)
    return {"p": p, "s": s, "plp": _row_dot(p, x) - s * lse, "argmax": x.argmax(-1), "tgt": tgt,
            "shape": tuple(ref_logits.shape), "ref_nll": float((lse - x.gather(1, tgt).reshape(-1)).mean())}


def window_scores(ref_logits, logits: torch.Tensor, targets: Sequence[int] = ()) -> dict:
    """Paired scores of one window: decoded-KV logits against lossless-KV logits.

    ``ref_logits``, ``logits``: ``[n, vocab]`` float (row i predicts ``targets[i]``);
    ``targets``: ``n`` token ids. ``ref_logits`` may instead be the dict of
    :func:`reference_scores` (then ``targets`` is taken from it). Returns ``{"kl": mean over rows of KL(P_ref || P) in
    nats, "top1": share of rows with argmax(logits) == argmax(ref_logits), "nll": mean
    negative log-likelihood of targets under logits (nats), "ref_nll": the same under
    ref_logits}``, computed in float64 as KL = sum_v P_ref (log P_ref - log P) with
    log P = logits - logsumexp(logits) (identical logits give exactly 0). Raises ValueError on shape mismatch.
    """
    ref = ref_logits if isinstance(ref_logits, dict) else reference_scores(ref_logits, targets)
    if logits.dim() != 2 or ref["shape"] != tuple(logits.shape):
        raise ValueError(f"logits shapes differ or are not [n, vocab]: {ref['shape']} vs {tuple(logits.shape)}")
    x = logits.to(torch.float64)
    lse = torch.logsumexp(x, dim=-1)
    kl = ref["plp"] - (_row_dot(ref["p"], x) - ref["s"] * lse)
    top1 = (x.argmax(-1) == ref["argmax"]).to(torch.float64)
    return {"kl": float(kl.mean()), "top1": float(top1.mean()),
            "nll": float((lse - x.gather(1, ref["tgt"]).reshape(-1)).mean()), "ref_nll": ref["ref_nll"]}


def summarize_rows(acc: dict, n_resamples: int = 10000, seed: int = 0) -> list[dict]:
    """Rows of quality.json from per-window accumulators ``{(codec, level): {"kl": [...],
    "top1": [...], "ppl_change_pct": [...], "bytes", "dtype_bytes", "elements", ...}}``:
    means with 95% bootstrap CIs over windows (``evaluation.stats.mean_ci``)."""
    from evaluation.stats import mean_ci

    rows = []
    for key, a in acc.items():
        name, level = key[:2]
        anc = tuple(key[2]) if len(key) > 2 else (0, 0)
        if not a["kl"]:
            continue
        ex = a.get("exact_tokens") or []
        kl = mean_ci(a["kl"], n_resamples=n_resamples, seed=seed)
        top1 = mean_ci(a["top1"], n_resamples=n_resamples, seed=seed)
        ppl = mean_ci(a["ppl_change_pct"], n_resamples=n_resamples, seed=seed)
        rows.append({
            "codec": name, "level": level,
            "default": name == FAMILY_DEFAULT and level == default_level(name) and not any(anc),
            # exact anchors (codec.anchors) and every token the stored KV keeps exactly (the
            # anchors plus the codec's own sinks / recent tokens), per window; None = unknown
            "anchors": {"sink": anc[0], "recent": anc[1]},
            "exact_tokens": (ex[0] if len(set(ex)) == 1 else float(np.mean(ex)))
            if ex and None not in ex else None,
            "ratio_vs_dtype": a["dtype_bytes"] / a["bytes"],
            "bits_per_element": 8.0 * a["bytes"] / a["elements"],
            # window storage: the codec's own ratio, against the KV elements it was given
            # (== ratio_vs_dtype for the full layout)
            "ratio_vs_stored": a["dtype_bytes"] * a.get("stored_elements", a["elements"])
            / a["elements"] / a["bytes"],
            "stored_fraction": a.get("stored_elements", a["elements"]) / a["elements"],
            "n_windows": kl["n"],
            "kl": kl["mean"], "kl_ci": kl["ci"], "kl_sd": kl["sd"],
            "top1_agreement": top1["mean"], "top1_agreement_ci": top1["ci"],
            "ppl_change_pct": ppl["mean"], "ppl_change_pct_ci": ppl["ci"], "ppl_change_pct_sd": ppl["sd"],
            "encode_s": a["encode_s"], "decode_s": a["decode_s"], "forward_s": a["forward_s"],
            "per_window": {"kl": a["kl"], "top1": a["top1"], "ppl_change_pct": a["ppl_change_pct"]},
        })
        if "serde" in a:
            rows[-1]["serde"] = a["serde"]
    return rows


# ----------------------------------------------------------------------------- text quality
def encode_decode_all(jobs: list, one: Callable, workers: int) -> list:
    """``[one(job) for job in jobs]``, run by ``workers`` threads (1: in this thread), in
    the order of ``jobs``. ``one`` must not raise (return an error marker instead).
    While the threads run, torch runs its ops on one thread each: two OpenMP teams on two
    cores stall at every barrier when a core is taken (a 1-token forward ran ~6x slower
    under load here), and the codecs' bytes and decoded KV are the same with torch at 1 or
    2 threads (checked for every registered codec and level on a 2048-token window of the
    default model; tests/extraction/test_quality_batch.py compares the rows)."""
    if workers <= 1 or len(jobs) <= 1:
        return [one(j) for j in jobs]
    import torch
    from concurrent.futures import ThreadPoolExecutor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="codec") as ex:
            return list(ex.map(one, jobs))
    finally:
        torch.set_num_threads(threads)


def code_one(k: torch.Tensor, v: torch.Tensor, pair: tuple, configs: dict, windows=None):
    """One codec row of a window: ``(k2, v2, stats, encode s, decode s)`` from the real
    bitstream of ``pair`` = (codec, level, (sink, recent)) on ``k``, ``v`` ``[L, T, H, D]``,
    or the exception it raised (the caller skips that codec). ``stats`` carries
    ``exact_tokens`` (None where the container does not say: LMCache serdes, windows)."""
    from bench.lmcache import peers as lmcache_peers
    from bench.lmcache import rows as lmcache_rows
    from codec import anchors as exact
    from codec import window

    peer = lmcache_peers.is_peer(pair[0])
    ours = lmcache_rows.is_row(pair[0])
    try:
        t1 = time.perf_counter()
        if any(pair[2]):   # exact anchors around our codec's ordinary container
            if peer or ours:
                raise ValueError("exact anchors apply to the codecs of codec.CODECS only")
            data, stats = exact.encode_with_stats(k, v, pair[0], pair[1], configs.get(pair[0]),
                                                  sink=pair[2][0], recent=pair[2][1])
        elif peer:       # LMCache's own serde code (bench/lmcache/peers.py)
            data, stats = lmcache_peers.encode_with_stats(k, v, pair[0])
        elif ours:     # our serdes inside LMCache, object by object (bench/lmcache/rows.py)
            data, stats = lmcache_rows.encode_with_stats(k, v, pair[0], configs)
        else:
            data, stats = window.encode_with_stats(k, v, windows, codec=pair[0], level=pair[1],
                                                   config=configs.get(pair[0]))
        t2 = time.perf_counter()
        k2, v2 = lmcache_peers.decode(data) if peer else lmcache_rows.decode(data) if ours \
            else exact.decode(data) if any(pair[2]) else window.decode_dense(data)
        t3 = time.perf_counter()
        if "exact_tokens" not in stats:   # an ordinary container counts its codec's own
            stats = dict(stats, exact_tokens=None if peer or ours or window.is_windowed(data)
                         else exact.exact_tokens(data))
    except Exception as exc:  # noqa: BLE001 - a codec that cannot run here is skipped
        return exc
    return k2.to(k.dtype), v2.to(v.dtype), stats, t2 - t1, t3 - t2


def _add_scores(a: dict, s: dict, stats: dict, forward_s: float) -> None:
    """Add one window's scores ``s`` (``window_scores``) and its codec ``stats`` to the
    accumulator ``a`` of one codec/level row."""
    a["kl"].append(s["kl"])
    a["top1"].append(s["top1"])
    a["ppl_change_pct"].append(100.0 * (math.exp(s["nll"] - s["ref_nll"]) - 1.0))
    a["bytes"] += stats["bytes"]
    a["dtype_bytes"] += stats["dtype_bytes"]
    a["elements"] += stats["elements"]
    a["stored_elements"] += stats.get("stored_elements", stats["elements"])
    a["exact_tokens"].append(stats.get("exact_tokens"))
    if "levels" in stats:        # a serde row: the levels its objects were coded at
        sd = a.setdefault("serde", {"levels": {}, "frame_bytes": 0, "coarser": 0, "finer": 0,
                                    "encodes": 0, "objects": 0})
        for lv, c in stats["levels"].items():
            sd["levels"][lv] = sd["levels"].get(lv, 0) + c
            sd["objects"] += c
        for f in ("frame_bytes", "coarser", "finer", "encodes"):
            sd[f] += stats[f]
    a["forward_s"] += forward_s


def run_text_quality(bundle, token_ids: Sequence[int], pairs: list[tuple[str, Optional[int]]],
                     n_windows: int, context: int, continuation: int, seed: int = 0,
                     log: Callable[[str], None] = print, batch: int = DEFAULT_BATCH,
                     codec_workers: int = DEFAULT_CODEC_WORKERS,
                     configs: Optional[dict] = None, windows=None,
                     anchors: Sequence[tuple[int, int]] = ((0, 0),),
                     checkpoint: Optional[tuple] = None,
                     max_new_windows: Optional[int] = None) -> tuple[list[dict], dict]:
    """Paired text-fidelity measurement on ``n_windows`` windows of ``token_ids``.

    ``token_ids``: the tokenized corpus; windows of ``context + continuation`` tokens at
    :func:`kv_extraction_hf.wikitext.token_windows` offsets (seeded, non-overlapping).
    ``pairs``: (codec, level) to measure. Each window is prefilled once; per codec/level
    the KV is encoded + decoded (``codec.encode_with_stats`` / ``codec.decode_kv``) and
    only the continuation is run: ``batch`` codecs' decoded KV at a time in one batched
    forward (``kv_extraction_hf.inject.continuation_logits_batch``: each entry's logits
    are those of its own batch-1 forward bit for bit; the lossless ``raw`` row checks it on
    every window; ``forward_s`` of a row is its share of the batch's time). Returns (rows as
    :func:`summarize_rows`, info dict with offsets, skipped codecs and their reasons, the
    lossless check, timings). A codec that raises on encode/decode is skipped (reason
    printed and recorded). ``codec_workers``: codecs of a batch encoded + decoded at once by
    that many threads (the same bytes and logits as one at a time; a row's ``encode_s`` /
    ``decode_s`` are then wall seconds while another codec ran beside it). Raises
    ValueError when ``batch`` < 1. ``configs``: codec name -> the config its encodes get
    (kvtc: a ``codec.kvtc.KvtcConfig`` naming its calibration; ``prepare_kvtc``).
    ``windows``: per-layer sliding windows for sliding-window storage (``codec.window``;
    sizes then against the full layout), None = the full layout. ``anchors``: the exact
    anchor settings ``(sink, recent)`` each codec/level is measured at (``codec.anchors``;
    (0, 0) = none, the ordinary container); rows carry ``anchors`` and ``exact_tokens``.
    Anchors other than (0, 0) need the full layout and our own codecs (ValueError).
    ``checkpoint``: ``(path, identity, environment)`` makes the run resumable
    (``bench.quality.checkpoint``): the state is saved after every window, and a state of
    the same run (same identity, codecs, offsets, sizes, seed, anchors) already at ``path`` is
    resumed at its next window; info then has ``resumed_windows`` and ``segments`` (the
    window each segment started at, with its environment). Raises
    ``checkpoint.CheckpointMismatch`` (a ValueError) for a state of another run.
    ``max_new_windows``: measure at most that many windows in this call (0 with a
    checkpoint: summarize the saved windows only); info's ``windows_measured`` is the number
    of windows the rows hold.
    """
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.inject import batch_is_exact, continuation_logits, continuation_logits_batch

    configs = configs or {}
    from kv_extraction_hf.wikitext import token_windows

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    anchors = [tuple(a) for a in anchors]
    if any(any(a) for a in anchors) and windows is not None:
        raise ValueError("exact anchors need the full layout (window storage off)")
    pairs = [(name, level, a) for name, level in pairs for a in anchors]
    offsets = token_windows(len(token_ids), context + continuation, n_windows, seed)
    acc: dict = {p: {"kl": [], "top1": [], "ppl_change_pct": [], "bytes": 0, "dtype_bytes": 0,
                     "elements": 0, "stored_elements": 0, "exact_tokens": [], "encode_s": 0.0, "decode_s": 0.0, "forward_s": 0.0} for p in pairs}
    skipped: dict[str, str] = {}
    ref_ppl: list[float] = []
    exact_shapes: list[bool] = []        # per batched forward: ran batched (True) or at batch 1
    t_prefill = t_scores = 0.0
    t0 = time.perf_counter()
    start, earlier_s, segments, key = 0, 0.0, [], None
    if checkpoint is not None:
        from bench.quality import checkpoint as ckpt

        path, identity, env = checkpoint
        key = ckpt.run_key({"identity": identity, "pairs": [[n, lv, list(a)] for n, lv, a in pairs],
                            "offsets": list(offsets), "context": context, "continuation": continuation,
                            "seed": seed})
        state = ckpt.load_state(path, key)
        if state is not None:
            start, acc, skipped = state["windows_done"], state["acc"], state["skipped"]
            ref_ppl, exact_shapes = state["ref_ppl"], state["exact_shapes"]
            t_prefill, t_scores, earlier_s = state["prefill_s"], state["scores_s"], state["elapsed_s"]
            segments = state["segments"]
            log(f"  resuming from {path}: {start}/{len(offsets)} windows done")
        segments = segments + [{"from_window": start, "environment": env}]
    for w, off in enumerate(offsets):
        if w < start:
            continue
        if max_new_windows is not None and w - start >= max_new_windows:
            break
        ctx = list(token_ids[off:off + context])
        cont = list(token_ids[off + context:off + context + continuation])
        t = time.perf_counter()
        k, v = prefill_kv(bundle, ctx)
        ref_logits = continuation_logits(bundle, k, v, ctx, cont)
        t_prefill += time.perf_counter() - t
        t = time.perf_counter()
        ref = reference_scores(ref_logits, cont)
        del ref_logits
        t_scores += time.perf_counter() - t
        todo = [p for p in pairs if level_label(*p) not in skipped]
        def one(pair):
            return code_one(k, v, pair, configs, windows)


        for i in range(0, len(todo), batch):
            group = []                       # (pair, k2, v2, stats) decoded from the real bitstream
            for pair, got in zip(todo[i:i + batch], encode_decode_all(todo[i:i + batch], one, codec_workers)):
                if isinstance(got, Exception):
                    label = level_label(*pair)
                    skipped[label] = f"{type(got).__name__}: {' '.join(str(got).split())[:200]}"
                    log(f"  skip {label}: {skipped[label]}")
                    continue
                k2, v2, stats, enc_s, dec_s = got
                acc[pair]["encode_s"] += enc_s
                acc[pair]["decode_s"] += dec_s
                group.append((pair, k2, v2, stats))
                del got
            if not group:
                continue
            t3 = time.perf_counter()
            all_logits = continuation_logits_batch(bundle, [(g[1], g[2]) for g in group], ctx, cont)
            t4 = time.perf_counter()
            exact_shapes.append(bool(batch_is_exact(len(group), len(ctx), len(cont), k.dtype)))
            for (pair, _, _, stats), logits in zip(group, all_logits):
                _add_scores(acc[pair], window_scores(ref, logits, cont), stats, (t4 - t3) / len(group))
            del group, all_logits
            t_scores += time.perf_counter() - t4
        ref_ppl.append(math.exp(ref["ref_nll"]))
        if checkpoint is not None:
            ckpt.save_state(checkpoint[0], key, w + 1, acc, {
                "skipped": skipped, "ref_ppl": ref_ppl, "exact_shapes": exact_shapes, "prefill_s": t_prefill,
                "scores_s": t_scores, "elapsed_s": earlier_s + time.perf_counter() - t0, "segments": segments})
        log(f"  window {w + 1}/{len(offsets)} (offset {off}) done, {time.perf_counter() - t0:.0f} s")
    for label in skipped:
        acc = {p: a for p, a in acc.items() if level_label(*p) != label}
    rows = summarize_rows(acc)
    lossless = [r for r in rows if r["codec"] == "raw"]
    check = None
    if lossless:
        r = lossless[0]
        check = {"max_kl": max(r["per_window"]["kl"]), "min_top1": min(r["per_window"]["top1"]),
                 "passed": max(r["per_window"]["kl"]) == 0.0 and min(r["per_window"]["top1"]) == 1.0}
    info = {"offsets": offsets, "skipped": skipped, "lossless_check": check,
            "reference_ppl_mean": float(np.mean(ref_ppl)) if ref_ppl else None,
            "prefill_s": t_prefill, "scores_s": t_scores, "batch": batch,
            "batch_exact": all(exact_shapes) if exact_shapes else None, "codec_workers": codec_workers,
            "total_s": earlier_s + time.perf_counter() - t0, "windows_measured": len(ref_ppl)}
    if checkpoint is not None:
        info.update(resumed_windows=start, segments=segments)
    return rows, info


