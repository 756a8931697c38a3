"""KVTC: transform coding of the KV cache (decorrelate, allocate bits, entropy-code).

Implements the transform-coding KV codec of Staniszewski et al., "KV Cache Transform
Coding for Compact Storage in LLM Inference" (arXiv 2511.01815, 2025), sections 3.1-3.3,
with this project's rANS coder and probability model as the entropy stage:

1. Decorrelation: per layer and per K/V, an orthonormal PCA basis of the H*D features
   (all KV heads of the layer together; block-diagonal per-head bases are a fitting
   option) and a mean, learned once on calibration text (``fit_calibration``). Keys can be
   decorrelated BEFORE rotary position embedding: the encoder undoes RoPE (rotate-half
   convention, the calibration's ``rope_theta``) at the token's absolute position and the
   decoder redoes it, so the codec stays model-free (docs/codec.md section "KVTC").
2. Bit allocation: reverse water-filling over the component variances (Cover & Thomas,
   Elements of Information Theory, 2nd ed., theorem 10.3.3): per (K/V, layer) a water
   level theta; components with variance <= theta get zero bits and are dropped, the
   others are quantized uniformly with the same step sqrt(12 theta) (entropy-coded
   uniform scalar quantization has equal-step optimal allocation at high rate). Each
   level's theta scale is solved on the calibration data so that the measured empirical
   entropy meets the level's target bits per element. With a distortion metric (how the
   model uses K and V: the query energy along each key channel, the output projection's
   gain for values; ``fit_calibration(metric=, whiten=True)``, docs/codec.md 8.5) the PCA
   and the water-filling run in the metric-whitened space (x S, S = M^(1/2) per head), so
   the allocation minimises the error the model sees rather than the plain MSE; the
   artifact then holds the encoder's ``analysis`` matrix S U beside the decoder's
   ``basis`` S^-1 U.
   Joint transform over layer groups (kvtc format 4, the default calibration; this
   project's addition, docs/codec.md 8.8): with ``group_layers`` = G the K and V of G
   consecutive layers share ONE basis (each (K/V, layer) block whitened by its metric
   and scaled by its water-level weight, the blocks concatenated, one PCA per group and
   one water level for all): K, V and neighbouring layers are all projections of the
   same residual stream, and the joint basis codes what they share once (the idea of
   cross-layer SVD, Chang et al., "xKV: Cross-Layer SVD for KV-Cache Compression",
   arXiv 2503.18893, 2025, here with bit allocation and entropy coding). On the default
   model it roughly halves the weighted error at equal bytes.
3. Entropy coding: the quantized coefficients of each (K/V, layer)'s kept components
   only (the "kept" column layout, kvtc format 2: all of them concatenated, split into
   two halves) go through ``codec.entropy.encode_symbols`` (per-column models clustered
   into a codebook, 32-bit rANS; docs/bitstream.md sections 1-4 and 4.5) - the same
   coder as cachegen. The older padded layout (every layer at the largest kept width)
   is still decoded. A grouped calibration codes each group's kept columns the same way
   (layout "grouped", one symbol offset per group).
4. The first ``sink_tokens`` tokens of the context (attention sinks) and optionally the
   last ``recent_tokens`` are stored exactly, as KVTC and CacheGen's variant do.
5. Tail tiers (kvtc format 3; this project's addition, docs/codec.md 8.6-8.7): a level
   may code the last R1 (R1 + R2, ...) tokens of the context at finer levels B1 (B2, ...)
   (``DEFAULT_LEVEL_TIERS``, ``KvtcConfig.tiers``): the value error of a token reaches
   the output weighted by the attention it gets, and the last few hundred tokens get
   most of it. The encoder knows each chunk's absolute position (``token_offset``,
   ``total_tokens``); the tail rows are coded as spans of the same container, each with
   its own kept-layout fields and entropy tables, named in the header.

The calibration (bases, means, variances, per-level allocation) has one form from the fit
to the decode: ``KvtcCalibration``, immutable, named by the sha256 of its content
(``.hash``); its bytes (``to_bytes`` / ``from_bytes``, a versioned safetensors artifact)
are its file and what the KV store keeps (through ``codec.artifacts``: the store never
imports this package). The bitstream header names that hash. An ENCODE is given its calibration explicitly
(``KvtcConfig(calibration=...)``: the object, an artifact path or a hash; the
documented default for a model is ``kv_extraction_hf.calibrate.default_calibration``,
resolved once by the caller that owns the model); there is no implicit choice. A
DECODE finds the calibration by the hash its chunk names (content-addressed): among
those registered with ``register_calibration`` (or used by an encode in this process),
else in the cache folder (``$CACHEGEN_CACHE`` or
``~/.cache/cachegen-harness``)/kvtc/<hash>.safetensors, and raises CodecError naming the
hash otherwise.

    from codec import kvtc
    cal = kvtc.fit_calibration(k_samples, v_samples)          # [L, N, H, D] each
    path = cal.save(kvtc.default_calibration_dir())           # <dir>/<hash>.safetensors
    same = kvtc.KvtcCalibration.from_bytes(cal.to_bytes())    # same.hash == cal.hash
    data = codec.encode_kv(k, v, codec="kvtc", level=2,
                           config=kvtc.KvtcConfig(calibration=cal))
    k2, v2 = codec.decode_kv(data)                            # finds it by its hash

Make a calibration for a model: python -m kv_extraction_hf.calibrate --model default --out FILE
Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_kvtc.py -q

Package layout (one job per module; this ``__init__`` forwards the public names only):
``rope`` (RoPE and its decode kernels), ``calibration`` (the artifact and the level
defaults), ``registry`` (where an encode and a decode find a calibration; the artifact as
bytes for the KV store), ``pca`` and ``rate`` (the transforms and the per-level rate
solve), ``fit`` (the calibration fit; pure), ``workers`` (decode pool, bf16 product),
``kept`` (the kept column layout), ``layout`` (formats, tiers, spans, the row coders),
``inverse`` (the decode's inverse transform), ``options`` (``KvtcConfig``), ``codec``
(``KvtcCodec``). Dependencies point one way: rope, calibration, workers, kept <- registry,
pca, rate, layout, inverse <- fit, codec.

A test that patches a module attribute patches the module that owns it (e.g.
``monkeypatch.setattr(kvtc.workers, "_decode_workers", f)``, ``kvtc.calibration.
DEFAULT_LEVEL_TIERS``): the code reads those names through their module.
"""

from __future__ import annotations

from ..errors import CodecError  # callers catch kvtc.CodecError
from . import (calibration, codec, fit, inverse, kept, layout, options, pca, rate, registry,
               rope, workers)
from .rope import apply_rope, undo_rope
from .calibration import (CALIBRATION_FORMAT, CALIBRATION_VERSION, DEFAULT_KEY_WATER,
                          DEFAULT_LEVEL, DEFAULT_LEVEL_SINKS, DEFAULT_LEVEL_TARGETS,
                          DEFAULT_LEVEL_TIERS, KvtcCalibration, default_calibration_dir,
                          level_tiers, load_calibration)
from .registry import (calibration_bytes, calibration_from_bytes, get_calibration,
                       has_calibration, register_calibration, registered_calibrations)
from .fit import fit_calibration
from .layout import KVTC_FORMAT_VERSION, KVTC_TIERED_FORMAT, MAX_TIERS, check_tiers
from .codec import KvtcCodec
from .options import KvtcConfig

__all__ = ["KvtcCalibration", "KvtcConfig", "KvtcCodec", "CodecError", "fit_calibration",
           "register_calibration", "registered_calibrations", "get_calibration",
           "load_calibration", "default_calibration_dir", "has_calibration",
           "calibration_bytes", "calibration_from_bytes", "apply_rope", "undo_rope",
           "CALIBRATION_FORMAT", "CALIBRATION_VERSION", "DEFAULT_LEVEL", "DEFAULT_LEVEL_TARGETS",
           "DEFAULT_LEVEL_TIERS", "DEFAULT_LEVEL_SINKS", "DEFAULT_KEY_WATER",
           "KVTC_FORMAT_VERSION", "KVTC_TIERED_FORMAT", "MAX_TIERS", "check_tiers",
           "level_tiers", "calibration", "codec", "fit", "inverse", "kept", "layout", "options", "pca",
           "rate", "registry", "rope", "workers"]
