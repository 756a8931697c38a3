"""CacheGen-style KV-cache codec: quantization, entropy coding, safe bitstreams, baselines.

Implements CacheGen (Liu et al., SIGCOMM 2024, section 5: layer-wise quantization,
per-(layer, channel) arithmetic coding, chunked streaming) and the baselines raw, quant8,
KIVI-2/4 and FP8 behind one API. Knows no model, engine or network.

    import codec
    data = codec.encode_kv(k, v, codec="cachegen")     # k, v [L, T, H, D] fp16/bf16/fp32
    k2, v2 = codec.decode_kv(data, device="cpu")
    codec.peek_header(data)["ratio_vs_dtype"]

Benchmark: python -m bench.codec --quick  (see docs/codec.md)
"""
from .api import (CODEC_VERSION, DEFAULT_CHUNK_TOKENS, chunk_bounds, config_hash,
                  decode_chunk, decode_chunks, decode_kv, decode_kv_into, default_level, encode_blob,
                  encode_chunks, encode_kv, encode_with_stats, levels, peek_header,
                  resolve_level)
from .registry import CODECS, get_codec
from .config import CodecConfig, QuantizationSpec
from .errors import CodecError

__all__ = ["encode_kv", "encode_blob", "encode_chunks", "decode_kv", "decode_kv_into", "decode_chunk",
           "decode_chunks", "peek_header", "encode_with_stats", "CODECS", "get_codec",
           "CodecConfig", "QuantizationSpec", "CodecError", "CODEC_VERSION",
           "DEFAULT_CHUNK_TOKENS", "chunk_bounds", "config_hash", "default_level", "levels",
           "resolve_level"]
