"""Codecs behind one API: CacheGen (entropy-coded) and the baselines raw, quant8, KIVI, FP8.

Each codec turns one chunk of KV (K and V, each [L, T, H, D], fp16/bf16/fp32) into a
codec-specific header dict, named numpy arrays and a payload, which ``codec.api`` wraps in
the safe container of ``codec.bitstream`` (magic, version, CRC32; docs/bitstream.md), and
back. Baselines as the CacheGen paper compares against (Liu et al., SIGCOMM 2024, section 7.1)
plus KIVI and an FP8 cast:

- ``raw``: the KV in the model's dtype (lossless).
- ``quant8``: CacheGen's 8-bit baseline: the reference quantizer with 256 bins, one scale
  per (layer, token), symbols stored as bytes, no entropy coding.
- ``kivi2`` / ``kivi4``: KIVI (Liu et al., ICML 2024) asymmetric 2/4-bit: keys per-channel
  (groups of 32 tokens), values per-token (groups of 32 channels within a head; the whole
  head when head_dim is not a multiple of 32), the last 128 tokens of the context (and
  any trailing partial key group) kept in the model dtype.
- ``fp8``: cast to float8 e4m3 (saturating at +-448, no scaling), 1 byte per element.
- ``cachegen``: CacheGen (paper section 5.2) with this project's measured quantizer
  (``CodecConfig.for_model(L, level)``, variant "harness"); ``cachegen-ref``: the LMCache
  reference quantizer and the LMCache/artifact schedules (variant "reference").

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_api*.py -q

Layout: ``codec/base.py`` (the shared vocabulary: dtypes, EncodedChunk, bit helpers, the
Codec base), ``codec/codecs/baselines.py`` (raw, fp8, KIVI), ``codec/codecs/cachegen.py``
(CacheGenCodec: cachegen, cachegen-ref, quant8), ``codec/kvtc/`` (kvtc) and
``codec/registry.py`` (CODECS, get_codec, resolve_level). This package's face names the
codec classes. Add a codec: a ``Codec`` subclass in its own module, registered in
``codec/registry.py``.
"""

from __future__ import annotations

from .baselines import Fp8Codec, KiviCodec, RawCodec
from .cachegen import CacheGenCodec

__all__ = ["CacheGenCodec", "Fp8Codec", "KiviCodec", "RawCodec"]
