"""Our codecs as LMCache multiprocess-mode L2 serdes: serde types ``cachegen`` and ``kvtc``.

LMCache (``pip install lmcache==0.5.6``, see docs/lmcache.md) stores KV chunks in L2
backends (fs, Redis protocol, ...) through an optional serde named in the adapter's JSON:
``{"type": "fs", "base_path": "/cache", "serde": {"type": "cachegen", "level": 1}}``.
LMCache has no plugin loader for serdes: the process that parses that JSON (the LMCache
server) must call ``register()`` first, or be started with our launcher
``python -m third_party.lmcache.server ...`` (the arguments of ``lmcache server``).

- ``register()`` (this module) adds the two factories to
  ``lmcache.v1.distributed.serde.factory``; serde.py holds the factories and the
  Serializer/Deserializer pair, settings.py the validated config (and the parsing of
  LMCache's JSON into it), frame.py the framed bitstream, layout.py the layouts (which
  kernel groups are coded, which stored verbatim), slot.py the slot and the ladder of
  steps an object is coded at in it (levels, floor steps, raw), position.py where an
  object sits in its context (sink tokens, kvtc's RoPE positions).
- The bytes are our versioned, CRC-checked codec containers (``codec.encode_kv``) inside
  a small frame naming the serde identity, the object key and the layout; anything
  that does not match or verify raises, which LMCache turns into a miss.

Nothing is imported here at import time: importing the package needs no LMCache.
A library plus one service command (server.py); tests: tests/lmcache_serde/ (run
with the optional environment, ``bash scripts/setup.sh lmcache``).
"""
from __future__ import annotations

SERDE_TYPES = ("cachegen", "kvtc")


def register(names: tuple = SERDE_TYPES) -> list[str]:
    """Register our serde factories with LMCache's serde registry (idempotent).

    Args: names: which of ``SERDE_TYPES`` to register (default both).
    Returns: the names now registered by us (already-registered ones of ours included).
    Raises: ImportError when lmcache is not installed; ValueError for an unknown name or
      when another package already registered a serde under one of the names.
    Call it in the LMCache server process before it parses its ``--l2-adapter`` JSON.
    """
    from lmcache.v1.distributed.serde import factory

    from . import serde as ours

    out = []
    for name in names:
        if name not in SERDE_TYPES:
            raise ValueError(f"unknown serde type {name!r}; ours are {list(SERDE_TYPES)}")
        fn = ours.FACTORIES[name]
        have = factory._SERDE_FACTORY_REGISTRY.get(name)
        if have is None:
            factory.register_serde_factory(name, fn)
        elif have is not fn:
            raise ValueError(f"an LMCache serde named {name!r} is already registered by "
                             f"{getattr(have, '__module__', '?')}; ours cannot replace it")
        out.append(name)
    return out
