"""Sliding-window storage (docs/models.md "Sliding-window storage"): a KV cache whose
sliding-window layers keep only the tokens a continuation can attend to. The package's
face: it forwards the names ``codec.window`` has always offered.

- ``codec.window.container``: the container (encode/decode of windowed KV, its header).
- ``codec.window.layout``: the layout rules (which tokens a layer keeps, the layout tag,
  the shortest servable prefix).

    from codec import window
    data = window.encode_windowed(k, v, windows, codec="cachegen")   # k, v [L, T, H, D]

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_window.py -q
"""
from __future__ import annotations

from .container import (WINDOW_KIND, WindowGroup, WindowedKV, decode_chunk_dense, decode_dense,
                        decode_windowed, decode_windowed_chunks, encode_windowed,
                        encode_windowed_chunks, encode_windowed_with_stats, encode_with_stats,
                        is_windowed, peek_window_header)
from .layout import WINDOW_VERSION, kept_tokens, layer_groups, window_list

__all__ = ["WINDOW_KIND", "WINDOW_VERSION", "WindowGroup", "WindowedKV", "layer_groups", "kept_tokens",
           "encode_windowed", "encode_windowed_with_stats", "encode_windowed_chunks", "decode_windowed",
           "decode_windowed_chunks", "decode_chunk_dense", "peek_window_header", "is_windowed",
           "encode_with_stats", "decode_dense", "window_list"]
