"""CacheGen-style KV-cache codec: quantization, entropy coding, safe bitstreams, baselines.

Implements CacheGen (Liu et al., SIGCOMM 2024, section 5: layer-wise quantization,
per-(layer, channel) arithmetic coding, chunked streaming) and the baselines raw, quant8,
KIVI-2/4 and FP8 behind one API. Knows no model, engine or network.

    import codec
    data = codec.encode_kv(k, v, codec="cachegen")     # k, v [L, T, H, D] fp16/bf16/fp32
    k2, v2 = codec.decode_kv(data, device="cpu")
    codec.peek_header(data)["ratio_vs_dtype"]

Benchmark: python -m bench.codec --quick  (see docs/codec.md)

The package is lazy (PEP 562 ``__getattr__``): the torch-free parts (``codec.config``,
``codec.errors``, ``codec.level_table``) import without torch; the API names below load
``codec.api`` / ``codec.registry`` (and torch) on first use.
"""
from .config import CodecConfig   # torch-free
from .schedules import QuantizationSpec   # torch-free
from .errors import CodecError                      # torch-free

__all__ = ["encode_kv", "encode_blob", "encode_chunks", "decode_kv", "decode_kv_into", "decode_chunk",
           "decode_chunks", "peek_header", "encode_with_stats", "CODECS", "get_codec",
           "CodecConfig", "QuantizationSpec", "CodecError", "CODEC_VERSION",
           "DEFAULT_CHUNK_TOKENS", "chunk_bounds", "config_hash", "default_level", "levels",
           "resolve_level"]

_API = frozenset(__all__) - {"CODECS", "get_codec", "CodecConfig", "QuantizationSpec",
                              "CodecError"}


def __getattr__(name: str):
    """PEP 562: the torch-backed names (``codec.api``, ``codec.registry``) and the
    submodules are imported on first use, so ``import codec.level_table`` or
    ``import codec.config`` loads no torch. AttributeError for any other name."""
    if name in _API:
        from . import api
        value = getattr(api, name)
    elif name in ("CODECS", "get_codec"):
        from . import registry
        value = getattr(registry, name)
    elif not name.isidentifier() or name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    else:
        import importlib

        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
