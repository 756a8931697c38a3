"""Sliding-window storage: a KV cache whose sliding-window layers keep only the tokens a
continuation can attend to.

Separate from ``codec.api`` because it is a layout ABOVE the codecs: it splits the
layers into groups by their window, encodes each group with the ordinary codec
(``codec.api``, any registered codec) and wraps the group bitstreams in one small
container of its own. The codec still knows no model: the caller gives each layer's
window as a plain int (``None`` = full attention), e.g. Gemma 3 270M's
``[512] * 5 + [None] + ...``.

Layout. For a context of T tokens, a layer of window W keeps its last ``min(T, W)``
tokens (positions ``T - min(T, W) .. T - 1``, the first kept one recorded); a full layer
keeps all T. Why W and not W - 1: in Hugging Face's masks (and Gemma 3's reference), a
query at position p of a layer with window W attends to positions p - W + 1 .. p, so the
next token (p = T) needs the last W - 1 context tokens. One more is kept because a
consumer that re-runs the LAST context token over the other T - 1
(``kv_extraction_hf.inject.continuation_logits``: its logits at that token are not in the
KV) needs positions T - W .. T - 2; together W tokens. Keeping W - 1 changes those
logits (tests/extraction/test_window_storage.py). Stored elements at T = 8192 on Gemma 3
270M (3 full + 15 sliding layers, W = 512): (3 + 15 x 512 / 8192) / 18 = 0.21875 of the
full layout.

Container (docs/models.md "Sliding-window storage"): a ``codec.bitstream`` container
(magic, CRC32) whose JSON header has ``kind`` "kvwindow", ``window_version`` 1, the
logical shape (L, H, D, dtype, total_tokens) and this container's token range
(token_offset, T, chunk_index, num_chunks, chunk_tokens), the codec and level, and
``groups``: per group its ``layers`` (model layer indexes), ``window`` (int or null),
``start`` (first kept position), its own ``token_offset`` and ``T`` in this container (0
tokens: the group is absent, e.g. a chunk entirely before the window holds only the full
layers) and ``bytes``; the payload is the groups' ordinary codec containers, concatenated
in that order. Any header that does not parse or does not agree with its sub-containers
raises CodecError.

kvtc: each group is encoded on its own, so a kvtc calibration must be fitted for the
group's layers; with a calibration of the whole model the encode is refused (one-line
ValueError). Give ``config`` as a dict ``{layers tuple: config}`` to set one per group.
cachegen / cachegen-ref / quant8 use the full model's schedule restricted to the group's
layers (each layer keeps its own bins); raw, fp8, kivi2, kivi4 need no config.

    from codec import window
    data = window.encode_windowed(k, v, windows, codec="cachegen")   # k, v [L, T, H, D]
    wkv = window.decode_windowed(data)          # WindowedKV: groups [Lg, Tg, H, D]
    k2, v2 = wkv.dense()                        # [L, T, H, D], zeros before each window

Run the tests: .venv/bin/python -m pytest tests/codec/test_codec_window.py -q
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .. import bitstream
from ..api import (DEFAULT_CHUNK_TOKENS, MAX_DIM, MAX_ELEMENTS, check_kv, check_level, as_device, encode_one,
                  backend_for, unpack_kind, chunk_bounds, decode_kv, peek_header)
from ..base import DTYPE_BYTES, DTYPE_NAMES, DTYPES
from ..config import CodecConfig, QuantizationSpec
from ..errors import CodecError
from ..registry import CODECS, get_codec

__all__ = ["WINDOW_KIND", "WINDOW_VERSION", "WindowGroup", "WindowedKV", "layer_groups", "kept_tokens",
           "encode_windowed", "encode_windowed_with_stats", "encode_windowed_chunks", "decode_windowed",
           "decode_windowed_chunks", "decode_chunk_dense", "peek_window_header", "is_windowed",
           "encode_with_stats", "decode_dense"]

WINDOW_KIND = "kvwindow"      # header["kind"] of a windowed container


# The layout rules (which tokens each layer keeps, the layout tag, the shortest servable
# prefix) are codec.window.layout's; this module uses them to build and read containers.
from .layout import WINDOW_VERSION, window_list, kept_tokens, layer_groups  # noqa: E402


@dataclass(frozen=True)
class WindowGroup:
    """One layer group of a :class:`WindowedKV`: ``layers`` (model layer indexes),
    ``window`` (None = full attention), ``start`` (absolute position of the first token
    kept; 0 for full layers) and ``k``/``v`` ``[len(layers), Tg, H, D]`` holding positions
    ``start .. start + Tg - 1``."""

    layers: tuple[int, ...]
    window: Optional[int]
    start: int
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class WindowedKV:
    """A decoded windowed KV: ``total_tokens`` context positions (T, what the consumer's
    cache must count) and the layer groups (:class:`WindowGroup`). The logical shape is
    ``[L, T, H, D]`` (``shape``); ``dense()`` gives it with zeros at positions a layer
    does not keep."""

    total_tokens: int
    groups: tuple[WindowGroup, ...]

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def dtype(self) -> torch.dtype:
        return self.groups[0].k.dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical (full layout) shape ``(L, T, H, D)``."""
        g = self.groups[0].k
        return (self.num_layers, self.total_tokens, g.shape[2], g.shape[3])

    @property
    def windows(self) -> list[Optional[int]]:
        """Each layer's window (None = full), indexed by layer."""
        out: list[Optional[int]] = [None] * self.num_layers
        for g in self.groups:
            for i in g.layers:
                out[i] = g.window
        return out

    @property
    def stored_elements(self) -> int:
        """K and V elements held: ``2 * sum Lg * Tg * H * D``."""
        return sum(2 * g.k.numel() for g in self.groups)

    @property
    def full_elements(self) -> int:
        """K and V elements of the full layout: ``2 * L * T * H * D``."""
        L, T, H, D = self.shape
        return 2 * L * T * H * D

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Layer ``i``'s kept ``(k [t, H, D], v [t, H, D], start)`` (views). IndexError
        on a layer that is not in any group."""
        for g in self.groups:
            if i in g.layers:
                j = g.layers.index(i)
                return g.k[j], g.v[j], g.start
        raise IndexError(f"layer {i} not in this windowed KV ({self.num_layers} layers)")

    def prefix(self, n: int) -> "WindowedKV":
        """The windowed KV of the first ``n`` context positions (1 <= n <= T): every
        group's kept tokens before position n (a group may then hold none). ValueError
        on a bad n."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.total_tokens:
            raise ValueError(f"prefix length must be in [1, {self.total_tokens}], got {n!r}")
        gs = []
        for g in self.groups:
            t = max(0, min(g.k.shape[1], n - g.start))
            gs.append(dataclasses.replace(g, start=min(g.start, n), k=g.k[:, :t], v=g.v[:, :t]))
        return WindowedKV(n, tuple(gs))

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)``, each ``[L, T, H, D]`` in the stored dtype, zeros at the positions a
        layer does not keep: the input ``kv_extraction_hf.inject.make_cache`` takes
        (a sliding layer of the model's own cache drops them before any attention)."""
        L, T, H, D = self.shape
        g0 = self.groups[0].k
        k = torch.zeros((L, T, H, D), dtype=g0.dtype, device=g0.device)
        v = torch.zeros_like(k)
        for g in self.groups:
            t = g.k.shape[1]
            idx = list(g.layers)
            k[idx, g.start:g.start + t] = g.k
            v[idx, g.start:g.start + t] = g.v
        return k, v


# ------------------------------------------------------------------------ encoding
def _runs(bins: list[int]) -> tuple[QuantizationSpec, ...]:
    """Contiguous specs of a per-layer bins list (equal neighbours merged)."""
    out: list[QuantizationSpec] = []
    for i, b in enumerate(bins):
        if out and out[-1].bins == b:
            out[-1] = QuantizationSpec(out[-1].start_layer, i + 1, b)
        else:
            out.append(QuantizationSpec(i, i + 1, b))
    return tuple(out)


def _group_config(c, level: Optional[int], config: Any, layers: tuple[int, ...], num_layers: int):
    """The config a group's encode gets: the entry of a ``{layers: config}`` dict; a
    cachegen-family schedule (given or the level's preset for the full depth) restricted to
    the group's layers; otherwise ``config`` itself."""
    if isinstance(config, dict):
        if tuple(layers) not in config:
            raise ValueError(f"config dict has no entry for layer group {tuple(layers)}")
        return config[tuple(layers)]
    if config is None and not hasattr(c, "resolve_config"):
        return None
    if config is not None and not isinstance(config, CodecConfig):
        return config
    if not hasattr(c, "resolve_config"):
        raise ValueError(f"codec {c.name!r} takes no config")
    full = c.resolve_config(num_layers, level, config)
    if not isinstance(full, CodecConfig):
        return config
    sel = list(layers)
    return dataclasses.replace(full, num_layers=len(sel),
                               key_specs=_runs([full.key_bins[i] for i in sel]),
                               value_specs=_runs([full.value_bins[i] for i in sel]))


def _encode_group(k, v, c, level, gcfg, lo, hi, total, index, count, backend, ct, layers):
    """One group's ordinary container for tokens [lo, hi); a refused encode becomes a
    one-line ValueError naming the group."""
    sel = list(layers)
    contiguous = sel == list(range(sel[0], sel[-1] + 1))
    kg = k[sel[0]:sel[-1] + 1, lo:hi] if contiguous else k[sel, lo:hi]
    vg = v[sel[0]:sel[-1] + 1, lo:hi] if contiguous else v[sel, lo:hi]
    try:
        return encode_one(kg, vg, c.name, level, gcfg, lo, total, index, count,
                           backend=backend, chunk_tokens=ct)
    except (ValueError, CodecError) as e:
        msg = " ".join(str(e).split())
        raise ValueError(f"window storage: {c.name} cannot encode layer group {tuple(layers)} "
                         f"({len(sel)} layers) on its own: {msg} (pass config as a dict "
                         f"{{layers: config}} fitted for each group, or store the full layout)") from None


def _encode_container(k, v, groups, c, level, configs, a, b, total, index, count, backend, ct,
                      extra: int = 0) -> tuple[bytes, dict]:
    """The windowed container of tokens [a, b) and the summed stats of its groups."""
    L, _, H, D = k.shape
    parts, meta = [], []
    stats: dict = {}
    for (w, layers), gcfg in zip(groups, configs):
        start = total - kept_tokens(total, w, extra)
        lo = max(a, start)
        entry = {"layers": list(layers), "window": w, "start": start, "token_offset": lo,
                 "T": max(0, b - lo), "bytes": 0}
        if lo < b:
            data, st = _encode_group(k, v, c, level, gcfg, lo, b, total, index, count, backend, ct, layers)
            entry["bytes"] = len(data)
            parts.append(data)
            for key, x in st.items():
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    stats[key] = stats.get(key, 0) + x
        meta.append(entry)
    dtype_name = DTYPE_NAMES[k.dtype]
    lvl = level
    if parts:
        lvl = peek_header(parts[0])["level"]
    header = {"kind": WINDOW_KIND, "window_version": WINDOW_VERSION, "codec": c.name, "level": lvl,
              "L": L, "H": H, "D": D, "dtype": dtype_name, "total_tokens": total, "token_offset": a,
              "T": b - a, "chunk_index": index, "num_chunks": count, "chunk_tokens": ct,
              **({"extra_tokens": extra} if extra else {}), "groups": meta}
    data = bitstream.pack(header, {}, b"".join(parts))
    stored = stats.get("elements", 0)
    full = 2 * L * (b - a) * H * D
    stats.update(bytes=len(data), stored_elements=stored, elements=full,
                 dtype_bytes=full * DTYPE_BYTES[dtype_name])
    return data, stats


def _extra(extra_tokens) -> int:
    if isinstance(extra_tokens, bool) or not isinstance(extra_tokens, int) or extra_tokens < 0:
        raise ValueError(f"extra_tokens must be an int >= 0, got {extra_tokens!r}")
    return extra_tokens


def _prepare(k, v, windows, codec, level, config, backend):
    c = get_codec(codec)
    if not isinstance(config, dict):
        level = check_level(c, level, config)
    L, T, _, _ = check_kv(k, v)
    groups = layer_groups(window_list(windows, L))
    configs = [_group_config(c, level, config, layers, L) for _, layers in groups]
    return c, level, T, groups, configs, backend_for(k.device, backend)


def encode_windowed_with_stats(k: torch.Tensor, v: torch.Tensor, windows: Sequence[Optional[int]],
                               codec: str = "cachegen", level: Optional[int] = None, config: Any = None,
                               backend: str = "auto", extra_tokens: int = 0) -> tuple[bytes, dict]:
    """:func:`encode_windowed` plus the stats of ``codec.encode_with_stats`` summed over the
    groups, with ``bytes`` (the container), ``elements`` and ``dtype_bytes`` of the FULL
    layout (``2 * L * T * H * D``: ratios and bits per element are against the
    full-attention layout in the KV's dtype) and ``stored_elements`` (what the groups hold)."""
    c, level, T, groups, configs, bk = _prepare(k, v, windows, codec, level, config, backend)
    return _encode_container(k, v, groups, c, level, configs, 0, T, T, 0, 1, bk, T, _extra(extra_tokens))


def encode_windowed(k: torch.Tensor, v: torch.Tensor, windows: Sequence[Optional[int]],
                    codec: str = "cachegen", level: Optional[int] = None, config: Any = None,
                    backend: str = "auto", extra_tokens: int = 0) -> bytes:
    """Encode a KV cache in the windowed layout as ONE container.

    Args:
      k, v: [L, T, H, D] as ``codec.encode_kv`` (finite fp16/bf16/fp32, any device).
      windows: L entries, ``None`` for a full-attention layer or the layer's sliding
        window W (tokens, int >= 1): that layer keeps its last ``min(T, W)`` tokens.
      codec, level, backend: as ``codec.encode_kv`` (any registered codec).
      extra_tokens: a sliding layer keeps ``min(T, W + extra_tokens)`` tokens, so that a
        prefix down to ``T - extra_tokens`` tokens stays servable (:func:`codec.window.layout.min_load_tokens`;
        the store keeps one KV block: a consumer's loads are block-aligned).
      config: as ``codec.encode_kv`` for the whole model (a cachegen ``CodecConfig`` of L
        layers is restricted to each group's layers), or a dict ``{layers tuple: config}``
        giving each group's own (kvtc: a calibration fitted for those layers).
    Returns: bytes (``decode_windowed`` needs nothing else).
    Raises: ValueError on bad input, or (one line) when the codec cannot encode a group
      on its own (kvtc with a calibration of the whole model).
    """
    return encode_windowed_with_stats(k, v, windows, codec, level, config, backend, extra_tokens)[0]


def encode_windowed_chunks(k: torch.Tensor, v: torch.Tensor, windows: Sequence[Optional[int]],
                           codec: str = "cachegen", level: Optional[int] = None, config: Any = None,
                           chunk_tokens: Optional[int] = None, backend: str = "auto",
                           extra_tokens: int = 0) -> list[bytes]:
    """``codec.encode_chunks`` in the windowed layout: one windowed container per chunk of
    ``chunk_tokens`` tokens (``codec.chunk_bounds``; None = the config's, else 1024), each
    holding its tokens of every group that keeps any (a chunk entirely before a window has
    no sliding group of that window). Arguments and errors as :func:`encode_windowed`."""
    c, level, T, groups, configs, bk = _prepare(k, v, windows, codec, level, config, backend)
    if chunk_tokens is None and isinstance(config, CodecConfig):
        chunk_tokens = config.chunk_tokens
    bounds = chunk_bounds(T, chunk_tokens)
    ct = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    extra = _extra(extra_tokens)
    return [_encode_container(k, v, groups, c, level, configs, a, b, T, i, len(bounds), bk, ct, extra)[0]
            for i, (a, b) in enumerate(bounds)]


# ------------------------------------------------------------------------ decoding
def _int(h: dict, key: str, lo: int, hi: int) -> int:
    x = h.get(key)
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise CodecError(f"window header field {key!r} invalid: {x!r}")
    return x


def _unpack(data: Any) -> tuple[dict, bytes]:
    header, _, payload = unpack_kind(data, WINDOW_KIND, "windowed KV")
    if header.get("window_version") != WINDOW_VERSION or isinstance(header.get("window_version"), bool):
        raise CodecError(f"window_version {header.get('window_version')!r} not supported "
                         f"(this decoder reads {WINDOW_VERSION})")
    return header, payload


def peek_window_header(data: bytes) -> dict:
    """The validated header of a windowed container: codec, level, L, H, D, dtype,
    total_tokens, token_offset, T, chunk_index, num_chunks, chunk_tokens and ``groups``
    (per group: layers, window, start, token_offset, T, bytes; as the module docstring),
    plus ``bytes`` (len(data)). Raises CodecError on any malformed input."""
    h, payload = _unpack(data)
    if not isinstance(h.get("codec"), str) or h["codec"] not in CODECS:
        raise CodecError(f"unknown codec {h.get('codec')!r} in window header")
    L = _int(h, "L", 1, MAX_DIM["L"])
    H, D = _int(h, "H", 1, MAX_DIM["H"]), _int(h, "D", 1, MAX_DIM["D"])
    if not isinstance(h.get("dtype"), str) or h["dtype"] not in DTYPES:
        raise CodecError(f"window header dtype {h.get('dtype')!r} not in {sorted(DTYPES)}")
    total = _int(h, "total_tokens", 1, MAX_DIM["T"])
    if L * total * H * D > MAX_ELEMENTS:
        raise CodecError("window header declares a KV larger than the decoder's limit")
    a = _int(h, "token_offset", 0, total - 1)
    b = a + _int(h, "T", 1, total - a)
    _int(h, "num_chunks", 1, MAX_DIM["T"])
    _int(h, "chunk_index", 0, h["num_chunks"] - 1)
    _int(h, "chunk_tokens", 1, MAX_DIM["T"])
    lvl = h.get("level")
    if lvl is not None and (isinstance(lvl, bool) or not isinstance(lvl, int)):
        raise CodecError(f"window header level invalid: {lvl!r}")
    extra = _int(h, "extra_tokens", 0, MAX_DIM["T"]) if "extra_tokens" in h else 0
    groups = h.get("groups")
    if not isinstance(groups, list) or not 1 <= len(groups) <= L:
        raise CodecError("window header groups must be a list of 1..L groups")
    seen: list[int] = []
    used = 0
    for j, g in enumerate(groups):
        if not isinstance(g, dict):
            raise CodecError(f"window header group {j} is not a dict")
        layers = g.get("layers")
        if not isinstance(layers, list) or not layers or any(
                isinstance(x, bool) or not isinstance(x, int) for x in layers):
            raise CodecError(f"window header group {j}: layers must be a non-empty list of ints")
        seen += layers
        if "window" not in g:
            raise CodecError(f"window header group {j} lacks its window")
        w = g["window"]
        if w is not None:
            w = _int(g, "window", 1, MAX_DIM["T"])
        if _int(g, "start", 0, total) != total - kept_tokens(total, w, extra):
            raise CodecError(f"window header group {j}: start {g['start']} does not match window {w} "
                             f"of {total} tokens")
        lo = max(a, g["start"])
        if _int(g, "T", 0, total) != max(0, b - lo) or (g["T"] and _int(g, "token_offset", 0, total) != lo):
            raise CodecError(f"window header group {j}: token range does not match the container's")
        used += _int(g, "bytes", 0 if not g["T"] else 1, len(payload))
        if bool(g["bytes"]) != bool(g["T"]):
            raise CodecError(f"window header group {j}: bytes and tokens disagree")
    if sorted(seen) != list(range(L)):
        raise CodecError(f"window header groups do not cover layers 0..{L - 1} exactly once")
    if used != len(payload):
        raise CodecError(f"window groups declare {used} bytes, the payload has {len(payload)}")
    out = {key: h[key] for key in ("codec", "level", "L", "H", "D", "dtype", "total_tokens", "token_offset",
                                   "T", "chunk_index", "num_chunks", "chunk_tokens")}
    out["extra_tokens"] = extra
    out["groups"] = [{key: g.get(key) for key in ("layers", "window", "start", "token_offset", "T", "bytes")}
                     for g in groups]
    out["bytes"] = len(data)
    return out


def is_windowed(data: Any) -> bool:
    """Whether ``data`` parses as a windowed container (False for an ordinary one or junk)."""
    try:
        _unpack(data)
    except CodecError:
        return False
    return True


def _decode_parts(data: bytes, device, backend: str) -> tuple[dict, list]:
    """(validated header, per group (k, v) or None when absent from this container)."""
    h = peek_window_header(data)
    _, payload = _unpack(data)
    out, pos = [], 0
    for j, g in enumerate(h["groups"]):
        if not g["T"]:
            out.append(None)
            continue
        sub = payload[pos:pos + g["bytes"]]
        pos += g["bytes"]
        sh = peek_header(sub)
        want = {"codec": h["codec"], "L": len(g["layers"]), "T": g["T"], "H": h["H"], "D": h["D"],
                "dtype": h["dtype"], "token_offset": g["token_offset"], "total_tokens": h["total_tokens"]}
        bad = [key for key, x in want.items() if sh[key] != x]
        if bad:
            raise CodecError(f"window group {j}: sub-container {bad[0]}={sh[bad[0]]!r}, header says "
                             f"{want[bad[0]]!r}")
        out.append(decode_kv(sub, device, backend=backend))
    return h, out


def decode_chunk_dense(data: bytes, device: Any = "cpu", backend: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One windowed container (a chunk of ``encode_windowed_chunks``, or the whole
    context) as ``(k, v)``, each ``[L, Tc, H, D]`` for the container's own tokens
    (``token_offset`` .. + T) in the stored dtype, zeros where a layer keeps nothing: what
    a chunk-by-chunk loader (the store's sources) places at those positions. Raises
    CodecError on malformed input; ValueError on a bad device or backend."""
    backend_for(as_device(device), backend)
    h, parts = _decode_parts(data, device, backend)
    L, Tc, H, D = h["L"], h["T"], h["H"], h["D"]
    k = torch.zeros((L, Tc, H, D), dtype=DTYPES[h["dtype"]], device=as_device(device))
    v = torch.zeros_like(k)
    for g, p in zip(h["groups"], parts):
        if p is None:
            continue
        a = g["token_offset"] - h["token_offset"]
        idx = list(g["layers"])
        k[idx, a:a + g["T"]] = p[0].to(k.dtype)
        v[idx, a:a + g["T"]] = p[1].to(v.dtype)
    return k, v


def decode_windowed(data: bytes, device: Any = "cpu", backend: str = "auto") -> WindowedKV:
    """Decode one windowed container (``encode_windowed`` output, or the only chunk).

    Returns: a :class:`WindowedKV` (groups' k/v ``[Lg, Tg, H, D]`` in the original dtype on
    ``device``; ``total_tokens`` = T). ``backend`` as ``codec.decode_kv``.
    Raises: CodecError on malformed input or a chunk that is not the whole context (use
    :func:`decode_windowed_chunks`); ValueError on a bad device or backend."""
    return decode_windowed_chunks([data], device, backend)


def decode_windowed_chunks(chunks: Sequence[bytes], device: Any = "cpu", backend: str = "auto"
                           ) -> WindowedKV:
    """Decode all chunks of one ``encode_windowed_chunks`` call into one :class:`WindowedKV`
    (each group's tokens concatenated). Raises CodecError if chunks are missing, out of
    order, from different KVs or malformed; ValueError on a bad device or backend."""
    backend_for(as_device(device), backend)
    if not chunks:
        raise CodecError("no chunks")
    first = None
    pieces: list[list] = []
    pos = 0
    for i, data in enumerate(chunks):
        h, parts = _decode_parts(data, device, backend)
        if first is None:
            first, pieces = h, [[] for _ in h["groups"]]
        if h["token_offset"] != pos or h["chunk_index"] != i:
            raise CodecError(f"chunk {i} starts at token {h['token_offset']}, expected {pos}")
        for key in ("codec", "L", "H", "D", "dtype", "total_tokens", "num_chunks"):
            if h[key] != first[key]:
                raise CodecError(f"chunk {i} has {key}={h[key]!r}, chunk 0 has {first[key]!r}")
        if [(g["layers"], g["window"]) for g in h["groups"]] != \
                [(g["layers"], g["window"]) for g in first["groups"]]:
            raise CodecError(f"chunk {i} has other layer groups than chunk 0")
        for j, p in enumerate(parts):
            if p is not None:
                pieces[j].append(p)
        pos += h["T"]
    if pos != first["total_tokens"] or len(chunks) != first["num_chunks"]:
        raise CodecError(f"chunks cover {pos} of {first['total_tokens']} tokens")
    groups = []
    for g, ps in zip(first["groups"], pieces):
        if not ps:
            raise CodecError(f"layer group {g['layers']} holds no tokens")
        k = torch.cat([p[0] for p in ps], 1) if len(ps) > 1 else ps[0][0]
        v = torch.cat([p[1] for p in ps], 1) if len(ps) > 1 else ps[0][1]
        if k.shape[1] != first["total_tokens"] - g["start"]:
            raise CodecError(f"layer group {g['layers']} holds {k.shape[1]} tokens, expected "
                             f"{first['total_tokens'] - g['start']}")
        groups.append(WindowGroup(tuple(g["layers"]), g["window"], g["start"], k, v))
    return WindowedKV(first["total_tokens"], tuple(groups))


# ------------------------------------------------------------------ either layout
def encode_with_stats(k: torch.Tensor, v: torch.Tensor, windows: Optional[Sequence[Optional[int]]] = None,
                      codec: str = "cachegen", level: Optional[int] = None, config: Any = None,
                      backend: str = "auto") -> tuple[bytes, dict]:
    """:func:`encode_windowed_with_stats` when some layer has a window, else (``windows``
    None or all None) ``codec.encode_with_stats`` itself (the ordinary container, the
    same bytes). Arguments and errors as :func:`encode_windowed`."""
    if windows is None or all(w is None for w in windows):
        from ..api import encode_with_stats as plain

        return plain(k, v, codec, level, config, backend=backend)
    return encode_windowed_with_stats(k, v, windows, codec, level, config, backend)


def decode_dense(data: bytes, device: Any = "cpu", backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` ``[L, T, H, D]`` from either container: ``codec.decode_kv`` of an ordinary
    one, :meth:`WindowedKV.dense` of a windowed one (zeros where a layer keeps nothing).
    Raises CodecError on malformed input; ValueError on a bad device or backend."""
    if is_windowed(data):
        return decode_windowed(data, device, backend).dense()
    return decode_kv(data, device, backend=backend)
