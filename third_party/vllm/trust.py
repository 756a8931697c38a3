"""Trust boundary of the CacheGen connector: what a client's `kv_transfer_params` may ask.

Purpose: in vLLM's OpenAI server any HTTP client sets
`kv_transfer_params`. Everything that names a filesystem path, a host or a port, or turns
on saving therefore comes from the operator's `kv_connector_extra_config` only; a request
may only CHOOSE among what the operator allowed (a source kind, a named store, a codec
level, a context key, a policy). Anything else is rejected: the request falls back to a
plain prefill and the reason goes to the log and the stats record (kind "rejected").

Operator keys (extra config) read here:
  stores: {"name": "host:port", ...}  KV store servers a request may name ("store": name);
      the legacy single "store": "host:port" is registered as the name "default".
  source_dir: root folder of the local source (a request names a context folder under it).
  source: default source kind ("store" if a store is configured, else "local").
  allow_client_save: false (default) | true - may requests ask for a save.
  max_key_chars: longest context key accepted; may only lower the bound every source
      shares (streaming.store.context_keys.MAX_KEY_CHARS, the default); above it the connector
      refuses to start (one line).
Request keys accepted (types checked, strings bounded): see REQUEST_KEYS / SAVE_KEYS.
Keys are plain names: [A-Za-z0-9._-], not starting with "." (no "/", no "..", no absolute
path, no NUL), at most max_key_chars characters (streaming.store.context_keys.check_context_key:
the same rule the local source applies at save and lookup).

Paper: CacheGen (Liu et al., SIGCOMM 2024) section 7 runs the KV store beside a serving
engine; the split between operator configuration and per-request choice follows vLLM's
own `kv_transfer_config` (engine-wide) vs `kv_transfer_params` (per request) and LMCache's
server-side storage configuration. No vLLM import: unit-tested without an engine
(tests/vllm_connector/test_connector_trust.py). Not runnable.
"""

from __future__ import annotations

import math
import re
from typing import Any

from streaming.adapt.params import POLICY_INPUTS, POLICY_PRESETS, POLICY_REQUEST_KEYS
from streaming.adapt.params import check_value as check_policy_value
from streaming.store.context_keys import check_context_key, key_limit

# request keys and the check each gets (see _check_* below)
REQUEST_KEYS = ("source", "store", "context_key", "context_tokens", "mode", "level",
                "policy", "model_id", "weights_hash", "codec_tag", "identity", "load_tokens",
                "save", "stats_tag", "prefix_match")
SAVE_KEYS = ("source", "store", "context_key", "codec", "level", "chunk_tokens",
             "num_tokens", "model_id", "weights_hash", "codec_tag", "stats_tag")
# a request's "policy": "preset" (a streaming.adapt.params.POLICY_PRESETS name), the
# per-request measurements (POLICY_INPUTS, numbers) and exactly the fields of the one policy
# object streaming.adapt.params.PolicyParams (each checked by its kind): one policy object
POLICY_KEYS = POLICY_REQUEST_KEYS
SOURCES = ("store", "local")
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._\-]*$")
_TEXT_MAX = 200  # mode, model_id, codec_tag, stats_tag, ...
_MAX_INT = 1 << 31


class RequestRejected(ValueError):
    """kv_transfer_params ask for something the operator's configuration does not allow.
    str(e) is one line naming every offending field."""


def allowed_stores(extra: dict[str, Any]) -> dict[str, str]:
    """Operator's store allow-list: name -> "host:port" (extra "stores", plus the legacy
    single "store" as "default"). Raises ValueError on a malformed entry."""
    out: dict[str, str] = {}
    stores = extra.get("stores") or {}
    if not isinstance(stores, dict):
        raise ValueError("extra config 'stores' must map a name to 'host:port'")
    for name, addr in stores.items():
        if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > 64:
            raise ValueError(f"store name {name!r} must be a plain name")
        out[name] = _check_addr(addr)
    if extra.get("store"):
        out.setdefault("default", _check_addr(extra["store"]))
    return out


def _check_addr(addr: Any) -> str:
    if isinstance(addr, (list, tuple)) and len(addr) == 2:
        addr = f"{addr[0]}:{addr[1]}"
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store address must be 'host:port', got {addr!r}")
    return f"{host}:{int(port)}"


def check_key(key: Any, max_chars: int | None = None) -> str:
    """A context key as a plain name (also a folder name under the local root): returns it;
    raises RequestRejected for a non-string, an empty one, one longer than `max_chars`
    (None: the shared bound, streaming.store.context_keys.MAX_KEY_CHARS), or one with a path
    separator, a leading ".", "..", NUL or another character outside [A-Za-z0-9._-]
    (streaming.store.context_keys.check_context_key)."""
    try:
        return check_context_key(key, key_limit(max_chars))
    except ValueError as e:
        raise RequestRejected(str(e)) from None


def max_key_chars(extra: dict[str, Any]) -> int:
    """The operator's key bound (extra "max_key_chars", default and ceiling
    streaming.store.context_keys.MAX_KEY_CHARS). Raises ValueError (one line) above the ceiling
    or for a non-integer: checked when the connector starts."""
    return key_limit(extra.get("max_key_chars"))


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str) or len(v) > _TEXT_MAX or "\x00" in v:
        raise RequestRejected(f"{name} must be a string of at most {_TEXT_MAX} characters")
    return v


def _int(name: str, v: Any, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < _MAX_INT:
        raise RequestRejected(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


def _num(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestRejected(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _level(v: Any) -> Any:
    if isinstance(v, list):
        if len(v) > 4096:
            raise RequestRejected("level list is too long")
        return [None if x is None else _int("level", x) for x in v]
    return None if v is None else _int("level", v)


def _store(v: Any, stores: dict[str, str]) -> str:
    """A store named by the request -> its address; only names (or the exact addresses)
    the operator configured."""
    if not isinstance(v, str):
        raise RequestRejected("store must be the name of a configured store")
    if v in stores:
        return stores[v]
    if v in stores.values():  # the exact configured address selects that store too
        return v
    names = ", ".join(sorted(stores)) or "none configured"
    raise RequestRejected(f"store {v[:80]!r} is not allowed (configured stores: {names})")


def _source(v: Any, extra: dict[str, Any], stores: dict[str, str]) -> str:
    if v not in SOURCES:
        raise RequestRejected(f"source must be one of {', '.join(SOURCES)}, got {v!r}")
    if v == "local" and not extra.get("source_dir"):
        raise RequestRejected("source 'local' is not enabled (no source_dir in the "
                              "server's kv_connector_extra_config)")
    if v == "store" and not stores:
        raise RequestRejected("source 'store' is not enabled (no stores in the server's "
                              "kv_connector_extra_config)")
    return v


def default_source(extra: dict[str, Any]) -> str:
    """The source a request gets when it names none: extra "source", else "store" when a
    store is configured, else "local"."""
    if extra.get("source") in SOURCES:
        return str(extra["source"])
    return "store" if (extra.get("stores") or extra.get("store")) else "local"


def _policy(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise RequestRejected("policy must be an object of numbers")
    bad = sorted(set(map(str, v)) - set(POLICY_KEYS))
    if bad:
        raise RequestRejected(f"policy keys not allowed: {', '.join(map(str, bad))[:200]}")
    out: dict[str, Any] = {}
    for k, x in v.items():
        if k == "preset":
            if not isinstance(x, str) or x not in POLICY_PRESETS:
                raise RequestRejected(f"policy.preset must be one of {', '.join(POLICY_PRESETS)}")
        elif k in POLICY_INPUTS:
            _num(f"policy.{k}", x)
        else:
            try:
                check_policy_value(k, x)
            except ValueError as e:
                raise RequestRejected(str(e)) from None
        out[k] = x  # ints stay ints (window, probe_after, ...)
    return out


def _identity(v: Any) -> dict[str, Any]:
    # only adds checks (streaming.identity.check_entry): its fields are validated there
    from streaming.identity import EntryIdentity

    if not isinstance(v, dict):
        raise RequestRejected("identity must be an object")
    if "partition" in v:  # the server's, from the request's cache_salt / LoRA (never a client's)
        raise RequestRejected("identity.partition is not a request field (the server derives "
                              "it from the request's cache_salt)")
    try:
        return EntryIdentity.from_dict(v).to_dict()
    except (ValueError, TypeError) as e:
        raise RequestRejected(f"identity: {e}") from None


def validate_request(params: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Check a request's `kv_transfer_params` against the operator's extra config.

    params: the request's dict (JSON from the client). extra: kv_connector_extra_config.
    Returns a NEW dict with only allowed keys, "store" resolved to a configured address,
    "source" filled (default_source), and a validated "save" (dict) when saving is allowed.
    The operator's source_dir is NOT copied in (the local source knows its root).
    Raises RequestRejected (one line naming every offending field) for unknown keys, a
    path-like or over-long key, a store or source the operator did not configure, a save
    when extra "allow_client_save" is not true, or a value of the wrong type.
    """
    if not isinstance(params, dict):
        raise RequestRejected(f"kv_transfer_params must be an object, got {type(params).__name__}")
    stores = allowed_stores(extra)
    try:
        max_key = max_key_chars(extra)
    except ValueError as e:
        raise RequestRejected(str(e)) from None
    errors: list[str] = []
    unknown = sorted(str(k)[:40] for k in params if k not in REQUEST_KEYS)
    if unknown:
        errors.append(f"unknown field(s) {', '.join(unknown)} (allowed: {', '.join(REQUEST_KEYS)})")
    out: dict[str, Any] = {}

    def take(name: str, fn) -> None:
        if name in params and params[name] is not None:
            try:
                out[name] = fn(params[name])
            except RequestRejected as e:
                errors.append(str(e))

    take("source", lambda v: _source(v, extra, stores))
    take("store", lambda v: _store(v, stores))
    take("context_key", lambda v: check_key(v, max_key))
    take("context_tokens", lambda v: _int("context_tokens", v, 1))
    take("load_tokens", lambda v: _int("load_tokens", v, 0))
    take("level", _level)
    take("policy", _policy)
    take("identity", _identity)
    take("prefix_match", lambda v: bool(v))
    for name in ("mode", "model_id", "weights_hash", "codec_tag", "stats_tag"):
        take(name, lambda v, n=name: _text(n, v))
    if "save" in params and params["save"] is not None:
        try:
            out["save"] = validate_save(params["save"], extra, stores, max_key)
        except RequestRejected as e:
            errors.append(str(e))
    if errors:
        raise RequestRejected("; ".join(errors))
    if "source" not in out:
        try:
            out["source"] = _source(default_source(extra), extra, stores)
        except RequestRejected as e:
            if out.get("context_key") or out.get("context_tokens"):
                raise
            out["source"] = default_source(extra)  # a save-only or text request
    if out["source"] == "store" and "store" not in out and stores:
        if len(stores) == 1 or "default" in stores:
            out["store"] = stores.get("default") or next(iter(stores.values()))
        elif out.get("context_key") or out.get("context_tokens"):
            raise RequestRejected(f"several stores are configured ({', '.join(sorted(stores))}): "
                                  "name one with 'store'")
    return out


def validate_save(save: Any, extra: dict[str, Any], stores: dict[str, str] | None = None,
                  max_key: int | None = None) -> dict[str, Any]:
    """A request's "save" object, allowed only when extra "allow_client_save" is true.
    Returns the validated dict (store resolved, source filled); raises RequestRejected."""
    if not extra.get("allow_client_save"):
        raise RequestRejected("save is not allowed (the server's kv_connector_extra_config "
                              "does not set allow_client_save)")
    if not isinstance(save, dict):
        raise RequestRejected("save must be an object")
    stores = allowed_stores(extra) if stores is None else stores
    unknown = sorted(str(k)[:40] for k in save if k not in SAVE_KEYS)
    if unknown:
        raise RequestRejected(f"unknown save field(s) {', '.join(unknown)}")
    out: dict[str, Any] = {}
    src = save.get("source") or ("local" if extra.get("source_dir") else "store")
    out["source"] = _source(src, extra, stores)
    if save.get("store") is not None:
        out["store"] = _store(save["store"], stores)
    elif out["source"] == "store":
        if not stores:
            raise RequestRejected("save to a store needs a configured store")
        out["store"] = stores.get("default") or next(iter(stores.values()))
    if save.get("context_key") is not None:
        out["context_key"] = check_key(save["context_key"], max_key)
    elif out["source"] == "local":
        raise RequestRejected("save to the local source needs a context_key")
    for name in ("level", "chunk_tokens", "num_tokens"):
        if save.get(name) is not None:
            out[name] = _int(f"save.{name}", save[name], 1 if name != "level" else 0)
    for name in ("codec", "model_id", "weights_hash", "codec_tag", "stats_tag"):
        if save.get(name) is not None:
            out[name] = _text(f"save.{name}", save[name])
    return out
