"""The model-config part of an entry identity: every config field that changes K/V for the
same weights, in one canonical, readable form.

Why: the same weights with an edited ``config.json`` (RoPE scaling turned on, ``rope_theta``
changed, a sliding window set) compute different K/V for the same tokens; an entry stored
before the edit must then be a miss, never served (kind of vLLM #56311). The weights hash
cannot see it, so the identity carries these fields (``EntryIdentity.kv_config``, canonical
JSON, and ``config_hash``, its sha256) and `check_entry` names the field that differs.

Both engines compute it from the same object: a transformers ``PretrainedConfig`` (the HF
path's ``AutoConfig.from_pretrained(folder)``, vLLM's ``model_config.hf_config``, which is
the same class built by the same transformers) - never from the raw ``config.json``, whose
absent fields mean a per-model default only the config class knows. transformers >= 5
keeps RoPE in ``rope_parameters`` (``rope_theta`` inside; one dict per layer type for
models whose sliding and full layers differ); older configs keep ``rope_theta`` and
``rope_scaling`` apart: both forms normalise to the fields ``rope_theta`` and
``rope_scaling`` here.

Fields (those the config has; the text model's config of a multimodal one):
  geometry: model_type, num_hidden_layers, num_attention_heads, num_key_value_heads
      (default: num_attention_heads), head_dim (default: hidden_size // heads), hidden_size;
  RoPE: rope_theta, rope_scaling (the whole dict, rope_theta taken out, ``type`` read as
      ``rope_type``; None for plain RoPE), partial_rotary_factor (default 1.0), rotary_pct,
      rotary_dim, rope_local_base_freq; max_position_embeddings and
      original_max_position_embeddings only when a RoPE type depends on them (every type
      but default and linear: dynamic, yarn, longrope, llama3, ...);
  windows: sliding_window (None when use_sliding_window is false), layer_types,
      sliding_window_pattern, max_window_layers;
  attention and norms: query_pre_attn_scalar, attn_logit_softcapping,
      attention_multiplier, attention_bias, qk_layernorm, use_qk_norm, rms_norm_eps,
      layer_norm_eps, hidden_act, hidden_activation, embedding_multiplier,
      residual_multiplier.
Not in it (they do not change K/V): dtype (its own identity field), token ids of special
tokens, vocab_size, use_cache, generation settings, transformers_version, names and paths.

Standard library only, no transformers import (the config is duck-typed): here so that the
HF path (kv_extraction_hf.model), the store identity (streaming.identity) and the vLLM
connector read the same fields the same way. Not runnable.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Mapping

KV_CONFIG_FORMAT = "cgh-kv-config-v1"
# read as they are when present
_PLAIN = ("model_type", "hidden_size", "rotary_pct", "rotary_dim", "rope_local_base_freq",
          "sliding_window_pattern", "max_window_layers", "query_pre_attn_scalar",
          "attn_logit_softcapping", "attention_multiplier", "attention_bias", "qk_layernorm",
          "use_qk_norm", "rms_norm_eps", "layer_norm_eps", "hidden_act", "hidden_activation",
          "embedding_multiplier", "residual_multiplier")
# counts and lengths: kept as ints (everything else numeric is canonical as a float)
_COUNTS = ("hidden_size", "rotary_dim", "sliding_window_pattern", "max_window_layers",
           "max_position_embeddings", "original_max_position_embeddings", "sliding_window")
# RoPE types whose frequencies do not depend on the model's maximum positions
_POSITION_FREE_ROPE = ("default", "linear")


def _config_dict(config: Any) -> dict:
    """The text model's config of `config` (a PretrainedConfig or a plain dict) as a dict."""
    if isinstance(config, Mapping):
        d = dict(config)
        text = d.get("text_config")
        return dict(text) if isinstance(text, Mapping) else d
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except TypeError:
            config = get_text()
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        raise ValueError(f"model config of type {type(config).__name__} has no to_dict()")
    return dict(to_dict())


def _canon(v: Any) -> Any:
    """Numbers as floats (4 and 4.0 are the same factor), containers recursively."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        f = float(v)
        return f if math.isfinite(f) else str(f)
    if isinstance(v, Mapping):
        return {str(k): _canon(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    return str(v)


def _field(name: str, v: Any) -> Any:
    """One top-level field canonical: counts as ints, other numbers as floats."""
    if name in _COUNTS and isinstance(v, (int, float)) and not isinstance(v, bool) \
            and float(v).is_integer():
        return int(v)
    return _canon(v)


def _rope_split(params: Any) -> tuple[Any, Any]:
    """(rope_theta, rope_scaling) of one RoPE parameter dict (legacy or transformers 5)."""
    if not isinstance(params, Mapping):
        return None, None
    p = {str(k): v for k, v in params.items()}
    if "type" in p and "rope_type" not in p:
        p["rope_type"] = p.pop("type")
    p.pop("type", None)
    theta = p.pop("rope_theta", None)
    p.pop("partial_rotary_factor", None)   # a field of its own (transformers 5 repeats it here)
    if p.get("rope_type") in (None, "default") and set(p) <= {"rope_type"}:
        p = None   # plain RoPE: nothing scaled
    return _canon(theta), _canon(p)


def _rope(d: Mapping) -> tuple[Any, Any, set[str]]:
    """(rope_theta, rope_scaling, RoPE types used) of a config dict; per layer type
    ({type: value}) when the config's rope_parameters are per layer type."""
    rp = d.get("rope_parameters")
    if isinstance(rp, Mapping) and rp and all(isinstance(v, Mapping) for v in rp.values()):
        thetas, scalings, types = {}, {}, set()
        for lt, sub in sorted(rp.items()):
            thetas[str(lt)], scalings[str(lt)] = _rope_split(sub)
            types.add(str((sub.get("rope_type") or sub.get("type") or "default")))
        return thetas, scalings, types
    merged: dict[str, Any] = {}
    if isinstance(d.get("rope_scaling"), Mapping):
        merged.update(d["rope_scaling"])
    if isinstance(rp, Mapping):
        merged.update(rp)
    if d.get("rope_theta") is not None and "rope_theta" not in merged:
        merged["rope_theta"] = d["rope_theta"]
    theta, scaling = _rope_split(merged)
    types = {str((scaling or {}).get("rope_type") or "default")}
    return theta, scaling, types


def kv_config(config: Any) -> dict[str, Any]:
    """The K/V-shaping fields of a model config (see the module docstring), canonical:
    numbers of RoPE and attention fields as floats, counts as ints, the format tag under
    "format". config: a transformers PretrainedConfig (duck-typed: ``to_dict``,
    ``get_text_config``) or its dict. Raises ValueError when it cannot be read."""
    d = _config_dict(config)
    out: dict[str, Any] = {"format": KV_CONFIG_FORMAT}
    heads = d.get("num_attention_heads")
    for n in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        v = d.get(n)
        if n == "num_key_value_heads" and v is None:
            v = heads
        if n == "head_dim" and v is None and heads and d.get("hidden_size"):
            v = int(d["hidden_size"]) // int(heads)
        if v is not None:
            out[n] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _canon(v)
    for n in _PLAIN:
        if n in d:
            out[n] = _field(n, d[n])
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), Mapping) else {}
    partial = d.get("partial_rotary_factor", rp.get("partial_rotary_factor"))
    out["partial_rotary_factor"] = _canon(1.0 if partial is None else partial)
    out["rope_theta"], out["rope_scaling"], types = _rope(d)
    if any(t not in _POSITION_FREE_ROPE for t in types):
        for n in ("max_position_embeddings", "original_max_position_embeddings"):
            if d.get(n) is not None:
                out[n] = _field(n, d[n])
    window = d.get("sliding_window")
    out["sliding_window"] = None if d.get("use_sliding_window") is False else _field("sliding_window", window)
    if d.get("layer_types") is not None:
        out["layer_types"] = [str(t) for t in d["layer_types"]]
    return out


def kv_config_json(fields: Mapping[str, Any]) -> str:
    """Canonical JSON of kv_config()'s output (sorted keys, no spaces): the identity field."""
    return json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))


def kv_config_hash(config_json: str) -> str:
    """sha256 (hex) of a kv_config_json() string: the identity's config_hash."""
    return hashlib.sha256(b"cgh-kv-config\x00" + config_json.encode("utf-8")).hexdigest()


def config_json_of(config: Any) -> str:
    """kv_config_json(kv_config(config)); "" when the config cannot be read (None, or no
    to_dict): an unknown config is left unknown, never guessed."""
    if config is None:
        return ""
    try:
        return kv_config_json(kv_config(config))
    except (ValueError, TypeError, AttributeError):
        return ""


def describe_difference(entry_json: str, reader_json: str) -> str:
    """One line naming the first K/V-shaping field in which an entry's config differs from
    the reader's: 'model config rope_theta differs: entry has 100000.0, reader expects
    10000.0' (and how many more differ). Either side unreadable: says so."""
    try:
        a, b = json.loads(entry_json or "{}"), json.loads(reader_json or "{}")
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise ValueError("not an object")
    except ValueError:
        return "model config differs (the entry's recorded config is unreadable)"
    # fields both sides have first: one that appears only on one side is usually a
    # consequence (max positions enter once a RoPE type uses them)
    names = sorted((n for n in set(a) | set(b) if a.get(n, "<absent>") != b.get(n, "<absent>")),
                   key=lambda n: (not (n in a and n in b), n))
    if not names:
        return "model config differs (config hash only)"

    def show(v: Any) -> str:
        s = json.dumps(v, sort_keys=True) if v != "<absent>" else "no such field"
        return s if len(s) <= 120 else s[:117] + "..."

    n = names[0]
    more = f" (and {len(names) - 1} more: {', '.join(names[1:4])})" if len(names) > 1 else ""
    return (f"model config {n} differs: entry has {show(a.get(n, '<absent>'))}, reader expects "
            f"{show(b.get(n, '<absent>'))}{more}")
