"""Sliding-window storage's layout rules, apart from the container (``codec.window.container``):
which tokens a layer of window W keeps (``kept_tokens``), the shortest prefix a consumer
may load from a windowed entry (``min_load_tokens``), the layer groups and the layout's
canonical name (``layout_tag``, the store's entry identity ``kv_layout``). Plain ints
only: the codec knows no model. Used by ``codec.window.container``; ``codec.window``
forwards the names it offered before the split.
"""
from __future__ import annotations

from typing import Optional, Sequence

WINDOW_VERSION = 1            # header["window_version"]: bumped when the layout changes
# A tag lists one window per layer (a few characters each): 64 KiB holds thousands of
# layers; a longer tag is not one this codec wrote.
MAX_TAG_CHARS = 1 << 16


def window_list(windows: Sequence[Optional[int]], num_layers: int) -> list[Optional[int]]:
    """``windows`` checked: one entry per layer, each None or an int >= 1 (ValueError)."""
    ws = list(windows)
    if len(ws) != num_layers:
        raise ValueError(f"windows has {len(ws)} entries for {num_layers} layers")
    for i, w in enumerate(ws):
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"windows[{i}] must be None (full attention) or an int >= 1, got {w!r}")
    return ws


def layer_groups(windows: Sequence[Optional[int]]) -> list[tuple[Optional[int], tuple[int, ...]]]:
    """The layer groups of a window list: ``[(window, layers), ...]``, the full-attention
    group (window None) first, then one group per distinct window, ascending; layers
    ascending in each. ValueError on a bad entry."""
    ws = window_list(windows, len(list(windows)))
    keys = sorted(set(ws), key=lambda w: -1 if w is None else w)
    return [(w, tuple(i for i, x in enumerate(ws) if x == w)) for w in keys]


def kept_tokens(total_tokens: int, window: Optional[int], extra_tokens: int = 0) -> int:
    """Tokens a layer of ``window`` keeps of a ``total_tokens`` context: all for None,
    else ``min(total_tokens, window + extra_tokens)`` (the module docstring says why W,
    not W - 1; ``extra_tokens`` > 0 lets a consumer load a prefix up to that many tokens
    shorter than the context, :func:`min_load_tokens`)."""
    return total_tokens if window is None else min(total_tokens, window + extra_tokens)


def min_load_tokens(windows: Sequence[Optional[int]], total_tokens: int, extra_tokens: int = 0) -> int:
    """The shortest prefix n of a ``total_tokens`` windowed entry a consumer may load and
    continue from (it then computes positions n, n + 1, ...; a query at p in a layer of
    window W attends p - W + 1 .. p, and the consumer may re-run position n - 1, which
    needs n - W .. n - 2): every sliding layer must keep position ``n - W`` on, i.e.
    n >= start + W with start = T - kept (or start = 0). With ``extra_tokens`` = S that
    is n >= T - S. Full-attention layers keep everything. Returns 1 when any prefix is
    servable (no window shorter than the context). ValueError on a bad window list."""
    ws = window_list(windows, len(list(windows)))
    n = 1
    for w in ws:
        if w is None:
            continue
        start = total_tokens - kept_tokens(total_tokens, w, extra_tokens)
        if start > 0:
            n = max(n, start + w)
    return n


def layout_tag(windows: Sequence[Optional[int]], extra_tokens: int = 0) -> str:
    """A canonical one-line name of a windowed layout (the store's entry identity
    ``kv_layout``): "window/1:" + compact JSON of the per-layer windows and the extra
    tokens. Two layouts give the same tag iff they keep the same tokens."""
    import json

    ws = window_list(windows, len(list(windows)))
    return f"window/{WINDOW_VERSION}:" + json.dumps({"windows": ws, "extra_tokens": int(extra_tokens)},
                                                    separators=(",", ":"))


def parse_layout_tag(tag: str) -> tuple[list[Optional[int]], int]:
    """(windows, extra_tokens) of a :func:`layout_tag`; ValueError when it is not one."""
    import json

    head = f"window/{WINDOW_VERSION}:"
    if not isinstance(tag, str) or not tag.startswith(head):
        raise ValueError(f"not a window layout tag: {str(tag)[:60]!r}")
    if len(tag) > MAX_TAG_CHARS:
        raise ValueError(f"window layout tag of {len(tag)} characters, over the limit of {MAX_TAG_CHARS}")
    try:
        d = json.loads(tag[len(head):])
        ws, extra = d["windows"], d["extra_tokens"]
    except RecursionError:   # a tag is two levels deep; deeper nesting comes from hostile bytes
        raise ValueError("window layout tag unreadable: nested too deeply") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"window layout tag unreadable: {e}") from None
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0 or not isinstance(ws, list):
        raise ValueError("window layout tag: extra_tokens must be an int >= 0 and windows a list")
    return window_list(ws, len(ws)), extra


def stored_fraction(windows: Sequence[Optional[int]], total_tokens: int) -> float:
    """Stored KV elements over those of the full layout (every layer all T tokens), before
    any coding: ``sum_l kept_tokens(T, w_l) / (L * T)``."""
    ws = window_list(windows, len(list(windows)))
    return sum(kept_tokens(total_tokens, w) for w in ws) / (len(ws) * total_tokens)
