"""The one check every reader of a stored entry runs (`check_entry`), and how a reader
combines its expectations (`merge_expected`).

Readers (store client, Redis client, local-folder source, HF engine path, vLLM connector)
call `check_entry(expected, found)` and treat a mismatch as a miss with the returned
reason, never as data. Separate from the record (streaming.identity_entry) because this
is the policy of comparison, not the data. Also importable from streaming.identity.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Iterable, Mapping

from cachegen_common.kv_config import describe_difference
from streaming.identity_entry import _INT_FIELDS, _STR_FIELDS, EntryIdentity


def check_entry(expected: EntryIdentity | Mapping | None, found: Mapping | EntryIdentity | None,
                levels: Iterable[int] | None = None) -> str | None:
    """None when a stored entry may be served for `expected`, else the reason (one line).

    Every field `expected` knows ("" / 0 = unknown) must be present and equal in `found`
    (the entry's identity dict, from its manifest); an entry without an identity, or
    without a field the reader knows, is a mismatch - never served on trust. A model
    config that differs is named by its first differing field ("model config rope_theta
    differs: entry has ..., reader expects ..."). The partition is compared always ("" is
    the shared partition, not unknown): an entry of another partition is a miss. Expected
    level_configs must appear with the same config hash in the entry; `levels`, when
    given, are levels the reader will fetch and must be in the entry's level_configs.
    Raises nothing: a malformed `found` is a mismatch.
    """
    if expected is None:
        return None
    try:
        exp = expected if isinstance(expected, EntryIdentity) else EntryIdentity.from_dict(expected)
    except (ValueError, TypeError) as e:
        return f"reader identity unusable: {e}"
    if found is None:
        if exp == EntryIdentity():
            return None
        return "entry carries no identity (written before identities were recorded)"
    try:
        got = found if isinstance(found, EntryIdentity) else EntryIdentity.from_dict(found)
    except (ValueError, TypeError) as e:
        return f"entry identity malformed: {e}"
    if exp.partition != got.partition:
        return "entry belongs to another cache partition (cache_salt / LoRA adapter differ)"
    for n in _STR_FIELDS + _INT_FIELDS:
        want, have = getattr(exp, n), getattr(got, n)
        if n == "config_hash" and want and want != have:
            if not have:
                return "entry records no model config (written before configs were recorded)"
            return describe_difference(got.kv_config, exp.kv_config)
        if want and want != have:
            return f"{n} mismatch: entry has {have!r}, reader expects {want!r}" if have else \
                f"entry has no {n}, reader expects {want!r}"
    if got.kv_layout and not exp.kv_layout and exp.level_configs:
        # a reader that names the levels it wants but not a window layout wants the full one
        return f"entry stores a sliding-window layout ({got.kv_layout[:40]}...), reader expects the full layout"
    have_lc = dict(got.level_configs)
    for lv, h in exp.level_configs:
        if lv not in have_lc:
            return f"level {lv} not in the entry (it has levels {sorted(have_lc)})"
        if have_lc[lv] != h:
            return (f"level {lv} config mismatch: entry encoded with config {have_lc[lv][:16]}, "
                    f"reader expects {h[:16]} (codec schedule changed?)")
    if levels is not None and exp.codec:
        for lv in levels:
            if lv is not None and int(lv) not in have_lc:
                return f"level {lv} not in the entry (it has levels {sorted(have_lc)})"
    return None


def merge_expected(*parts: EntryIdentity | Mapping | None) -> EntryIdentity:
    """Combine expectations field by field (first known value wins; a later DIFFERENT known
    value raises ValueError: the reader's own model and a request disagree)."""
    out: dict[str, Any] = {}
    for p in parts:
        if p is None:
            continue
        e = p if isinstance(p, EntryIdentity) else EntryIdentity.from_dict(p)
        for f in fields(EntryIdentity):
            v = getattr(e, f.name)
            if not v:
                continue
            if f.name in out and out[f.name] != v:
                raise ValueError(f"conflicting expectations for {f.name}: {out[f.name]!r} vs {v!r}")
            out[f.name] = v
    return EntryIdentity(**out)

