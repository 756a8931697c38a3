"""The KV that ``python -m bench.codec`` measures and the kvtc calibration it encodes with:
synthetic KV with the structure of real caches (:func:`synthetic_kv`, ``--quick``), KV dumps
(``--kv``) or prefilled prompts of the model (:func:`load_contexts`), and the calibration
of the kvtc rows (:func:`prepare_kvtc`, never fitted on the measured contexts). Separate
from bench/codec/cli.py (the command) because this is the one part that loads the model.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import torch

QUICK_SHAPE = (8, 1024, 2, 64)   # synthetic KV for --quick: L, T, H, D


def synthetic_kv(L: int, T: int, H: int, D: int, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
    """A KV with the structure of real ones: keys with a few large RoPE channel pairs
    rotating with position, a huge first (attention-sink) token, per-layer magnitudes;
    values smoother, heavier-tailed. [L, T, H, D] each."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(T, dtype=torch.float32)
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))       # [D/2]
    ang = pos[:, None] * freqs[None]                                                # [T, D/2]
    base = torch.randn(L, 1, H, D // 2, generator=g) * torch.linspace(4, 0.5, D // 2)
    drift = torch.randn(L, T, H, D // 2, generator=g) * 0.6
    amp = base + drift                                                              # [L,T,H,D/2]
    k = torch.cat([amp * torch.cos(ang)[None, :, None], amp * torch.sin(ang)[None, :, None]], -1)
    k = k * torch.linspace(1.0, 2.0, L).reshape(L, 1, 1, 1)
    k[:, 0] *= 6
    v = torch.distributions.StudentT(4.0).sample((L, T, H, D)) * 0.3
    v = v + 0.2 * torch.randn(L, 1, H, D, generator=g)
    v[:, 0] *= 0.1
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


def load_contexts(args, log) -> tuple[list[dict], Optional[Any], dict]:
    """Returns (contexts [{name, k, v, context_ids, continuation_ids}], model bundle or
    None, model info dict)."""
    if args.quick:
        L, T, H, D = QUICK_SHAPE
        ctxs = [{"name": f"synthetic-{i}", "seed": args.seed + i,
                 **dict(zip(("k", "v"), synthetic_kv(L, T, H, D, seed=args.seed + i))),
                 "context_ids": None, "continuation_ids": None}
                for i in range(args.contexts)]
        return ctxs, None, {"model_id": "synthetic", "dtype": "bfloat16", "num_layers": L,
                            "num_kv_heads": H, "head_dim": D}
    bundle = None
    info: dict = {}
    if not args.no_model:
        from kv_extraction_hf.model import load_model

        log("loading model ...")
        bundle = load_model(args.model, log=lambda m: None)
        info = {key: getattr(bundle.info, key) for key in ("model_id", "weights_hash", "dtype",
                                                            "num_layers", "num_kv_heads",
                                                            "head_dim")}
    ctxs = []
    if args.kv:
        from kv_extraction_hf.dump import load_kv, metadata_ids

        for path in args.kv:
            k, v, meta = load_kv(path)
            ids = metadata_ids(meta, "token_ids", path, max_len=k.shape[1])
            cont = metadata_ids(meta, "continuation_ids", path) if meta.get("continuation_ids") else None
            ctxs.append({"name": Path(path).stem, "k": k, "v": v, "context_ids": ids,
                         "continuation_ids": cont or None})
            # (kv_extraction_hf.dump writes the model's fields as model_*; older dumps: bare)
            wh = meta.get("model_weights_hash") or meta.get("weights_hash")
            info = info or {"model_id": meta.get("model_id"),
                            "dtype": meta.get("model_dtype") or meta.get("dtype"),
                            **({"weights_hash": wh} if wh else {})}
        return ctxs, bundle, info
    if bundle is None:
        print("error: without --kv the benchmark needs the model (drop --no-model) or use "
              "--quick", file=sys.stderr)
        raise SystemExit(2)
    from kv_extraction_hf.extract import prefill_kv
    from kv_extraction_hf.prompts import build_prompt

    for i in range(args.contexts):
        p = build_prompt(args.task, bundle.tokenizer, args.context_tokens, args.seed, i)
        log(f"prefill {p.name} ({len(p.context_ids)} tokens)")
        k, v = prefill_kv(bundle, p.context_ids)
        ctxs.append({"name": p.name, "k": k, "v": v, "context_ids": list(p.context_ids),
                     "continuation_ids": list(p.continuation_ids) or None})
    return ctxs, bundle, info


def prepare_kvtc(args, bundle, log, info: Optional[dict] = None) -> str:
    """The calibration the ``kvtc`` rows encode with (registered, so their chunks decode);
    returns its hash, which the caller passes to every kvtc encode (``KvtcConfig``).

    ``--kvtc-calibration FILE``: that artifact, whatever else applies. With the model: its
    default calibration (kv_extraction_hf.calibrate.default_calibration, fitted on the
    default calibration text on first use, then cached). ``--quick``: a calibration fitted
    on synthetic KV of another seed than the measured contexts (never on them). ``--kv``
    without the model: the cached default calibration of the dump's model (its
    ``weights_hash``, ``info``), else ValueError naming the two ways to give one."""
    from codec import kvtc

    if getattr(args, "kvtc_calibration", None):
        return kvtc.register_calibration(args.kvtc_calibration)
    if bundle is not None:
        from kv_extraction_hf.calibrate import default_calibration

        return kvtc.register_calibration(default_calibration(bundle, log=log))
    if args.quick:
        L, T, H, D = QUICK_SHAPE
        k, v = synthetic_kv(L, T, H, D, seed=args.seed + 10_000)
        return kvtc.register_calibration(kvtc.fit_calibration(
            k[:, 4:].float(), v[:, 4:].float(), meta={"data": "synthetic (bench.codec --quick)"}))
    from kv_extraction_hf.calibrate import cached_default_calibration

    path = cached_default_calibration((info or {}).get("weights_hash"))
    if path is None:
        raise ValueError("the kvtc rows need a calibration: --kvtc-calibration FILE, or the "
                         "model (drop --no-model) for its default calibration")
    return kvtc.register_calibration(path)
