"""The CacheGen connector's settings: what both of its sides read and never change.

CacheGenConnector (third_party.vllm.cachegen_connector) builds one ConnectorSettings when
vLLM creates it, from vLLM's config and the operator's kv_connector_extra_config, and hands
it to the side it builds for its role (third_party.vllm.scheduler.CacheGenScheduler or
third_party.vllm.worker.CacheGenWorker). A malformed operator option fails here, at engine
start, with one line. Not runnable by itself.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from third_party.vllm.decode_cpus import decode_cpus
from third_party.vllm.sources import engine_identity, load_callable, make_source
from third_party.vllm.trust import allowed_stores, max_key_chars


def bool_option(extra: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean extra-config option; raises ValueError on anything but true/false."""
    v = extra.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"extra config {key} must be true or false, got {v!r}")
    return v


class StatsWriter:
    """Appends one JSON line per record to the extra config's "stats_path" (nothing without
    one). Thread-safe within a process: one lock per writer; each line is written whole."""

    def __init__(self, path: str | None):
        self.path = path or None
        self._lock = threading.Lock()

    def write(self, rec: dict[str, Any]) -> None:
        """Append ``rec`` (values json can not encode are written as str)."""
        if not self.path:
            return
        line = json.dumps(rec, default=str) + "\n"
        with self._lock:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()


TARGET_CODECS = ("cachegen", "kvtc")   # the codecs a target picks a level of


def target_points(extra: dict[str, Any], weights_hash: str | None, folder=None) -> dict[str, dict[str, Any]]:
    """codec -> ``{"target", "codec", "level", "hash", "table"}`` of extra config "target"
    on the model ``weights_hash``, read off the model's operating-point table in the cache
    (``kv_extraction_hf.calibrate.operating_points.find_table``; extra config
    "operating_point_table": a table's sha256 to use that one). The connector never fits a
    table (that needs the measurement code, outside the connector): ``python -m
    bench.operating_points --target T`` or ``run_benchmarks.py --target T`` fits it once per
    model. A codec without a table row is left out (it keeps its own default level).
    Raises ValueError (one line) on a bad target, no table of the model, or a target that no
    level meets (``codec.operating_points.TargetUnmet``)."""
    from codec import operating_points as op
    from codec.errors import CodecError
    from kv_extraction_hf.calibrate.operating_points import find_table, point_summary

    target = op.parse_target(extra["target"])
    if not weights_hash:
        raise ValueError("extra config target needs the engine's model identity (weights hash)")
    try:
        if extra.get("operating_point_table"):
            table = op.load_table(str(extra["operating_point_table"]), folder)
        else:
            table = find_table(weights_hash, "cachegen", folder)
    except CodecError as exc:
        raise ValueError(f"extra config operating_point_table: {exc}") from None
    if table is None or table["model"].get("weights_hash") != weights_hash:
        raise ValueError(f"no operating-point table of this model (weights {weights_hash[:12]}) in "
                         f"{folder or op.default_dir()}; fit it once: python -m bench.operating_points "
                         f"--model MODEL --target {target.name}")
    out = {}
    for c in TARGET_CODECS:
        if any(r["codec"] == c for r in table["rows"]):
            out[c] = point_summary(op.operating_point(table, c, target))  # TargetUnmet is a ValueError
    return out


@dataclass
class ConnectorSettings:
    """Read-only settings of one connector (either role).

    extra: the operator's kv_connector_extra_config (a copy).
    block_size: tokens per block of vLLM's block table.
    identity: this engine's model identity (streaming.identity; None in unit tests): every
        stored entry is checked against it.
    decode_cpus: CPUs the load runs on (None: the worker's own binding).
    prefix_caching: vLLM's prefix caching is on.
    allow_lossy_cache: extra config "allow_lossy_prefix_cache".
    async_load: loads run in a worker background thread (extra config "async_load").
    partial_block: extra config "load_partial_block": the load may end inside a block (the
        stored prefix up to the prompt's last token) instead of at the last whole block.
    engine_load: extra config "engine_load" (default true): the scheduler side tracks the
        engine's requests and gives an adaptive policy the prefill queued ahead of its load
        (policy input engine_queue_tokens, third_party.vllm.engine_load.engine_queue_tokens);
        false: the request's own policy inputs only.
    key_fn: extra config "key_fn" loaded, or None (streaming.store:context_key).
    chunk_hook: test-only extra config "test_chunk_hook" loaded, or None.
    stats: the stats writer of extra config "stats_path".
    operating_points: codec -> its operating point for extra config "target" (near-lossless,
        lmcache, kl:X) on this engine's model (``target_points``: target, codec, level,
        hash, table); empty without a target. A request that names no "level" saves and
        loads at it.
    """

    extra: dict[str, Any]
    block_size: int = 128
    identity: Any = None
    decode_cpus: set[int] | None = None
    prefix_caching: bool = False
    allow_lossy_cache: bool = False
    async_load: bool = False
    partial_block: bool = True
    engine_load: bool = True
    key_fn: Callable | None = None
    chunk_hook: Callable | None = None
    stats: StatsWriter = field(default_factory=lambda: StatsWriter(None))
    operating_points: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, block_size: int = 128, identity: Any = None,
                   prefix_caching: bool = False) -> "ConnectorSettings":
        """Settings from the operator's extra config. Raises ValueError (one line) on a
        malformed store list, key bound, "decode_cpus", "async_load",
        "load_partial_block", "engine_load" or hook."""
        extra = dict(extra or {})
        allowed_stores(extra)  # a malformed operator store list fails at start, clearly
        max_key_chars(extra)   # so does a key bound above the one every source shares
        if extra.get("target") is not None:  # a misspelt quality target, too
            from codec.operating_points import parse_target

            parse_target(extra["target"])
        # test-only hook (off by default): "module:function" called as
        # hook(params, chunk_start_token, cancelled) before each chunk is placed
        # (params: the request's kv_transfer_params; cancelled() -> bool)
        return cls(
            extra=extra, block_size=int(block_size), identity=identity,
            decode_cpus=decode_cpus(extra.get("decode_cpus", "all")),
            prefix_caching=bool(prefix_caching),
            # lossy KV loaded with prefix caching on enters vLLM's local prefix cache and is
            # then reused by later requests (even plain ones): refused unless allowed
            allow_lossy_cache=bool(extra.get("allow_lossy_prefix_cache", False)),
            # load in a worker background thread (vLLM's async load contract), so that an
            # abort stops the load at the next chunk; default false (before the forward)
            async_load=bool_option(extra, "async_load", False),
            # vLLM's scheduler takes a hit that ends inside a block (it only keeps the last
            # prompt token for the forward); false: stop at the last whole block
            partial_block=bool_option(extra, "load_partial_block", True),
            engine_load=bool_option(extra, "engine_load", True),
            key_fn=load_callable(extra["key_fn"]) if extra.get("key_fn") else None,
            chunk_hook=load_callable(extra["test_chunk_hook"])
            if extra.get("test_chunk_hook") else None,
            stats=StatsWriter(extra.get("stats_path")))

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> "ConnectorSettings":
        """Settings of the engine vllm_config describes: its block size, prefix caching,
        the operator's extra config and the model identity (hashed once, here)."""
        cc = getattr(vllm_config, "cache_config", None)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        out = cls.from_extra(extra, block_size=cc.block_size,
                             prefix_caching=bool(getattr(cc, "enable_prefix_caching", False)))
        out.identity = engine_identity(vllm_config, extra)  # after the options' checks
        if extra.get("target") is not None:
            out.operating_points = target_points(extra, getattr(out.identity, "weights_hash", None))
        return out

    def prefix_mode(self) -> str:
        """Operator's extra config "prefix_match": "off" (default), "params" (requests with
        kv_transfer_params but no context key search the prefix index) or "all" (every
        request, also those without kv_transfer_params). true means "params". Raises
        ValueError on another value."""
        m = self.extra.get("prefix_match", "off")
        m = "params" if m is True else ("off" if m in (False, None) else str(m))
        if m not in ("off", "params", "all"):
            raise ValueError(f"extra config prefix_match must be off, params or all, got {m!r}")
        return m

    def make_source(self, kind: str):
        """A new KV source of ``kind`` ("store" or "local") under these settings."""
        return make_source(kind, self.extra, self.identity)
