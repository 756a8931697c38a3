"""Start LMCache's MP server (``lmcache server``) with our serdes registered.

LMCache parses its ``--l2-adapter`` JSON in the server process and has no plugin loader
for serdes, so ``register()`` must run there first; this launcher does that, checks the
options of every ``--l2-adapter`` whose serde is ours (one line and exit 2 on a bad one,
not LMCache's traceback from deep inside its start-up), then hands every argument to
LMCache's own CLI unchanged:

    .venv-lmcache/bin/python -m third_party.lmcache.server --l2-adapter \\
        '{"type": "fs", "base_path": "/tmp/kv", "serde": {"type": "cachegen"}}' ...

(``lmcache server --help`` lists the other options.) Exit status: LMCache's; 2 with a
one-line error when lmcache is not installed, a serde name is taken, an ``--l2-adapter``
value is not a JSON object or names one of our serdes with a bad option, or the server
refuses a config with a ValueError.
"""
from __future__ import annotations

import json
import sys
from typing import Iterator


def _adapter_values(args: list[str]) -> Iterator[str]:
    """The values of every ``--l2-adapter`` (``--l2-adapter V`` and ``--l2-adapter=V``)."""
    for i, a in enumerate(args):
        if a == "--l2-adapter" and i + 1 < len(args):
            yield args[i + 1]
        elif a.startswith("--l2-adapter="):
            yield a.split("=", 1)[1]


def check_adapters(args: list[str]) -> None:
    """Validate our serdes' options in the ``--l2-adapter`` values of ``args`` (LMCache's
    own options are LMCache's to check). Raises ValueError with a one-line message."""
    from codec.errors import CodecError

    from . import SERDE_TYPES
    from .settings import parse_settings

    for value in _adapter_values(args):
        try:
            cfg = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--l2-adapter is not JSON ({e}): {value[:80]!r}") from None
        except RecursionError:   # an option is two levels deep; this is not an adapter
            raise ValueError(f"--l2-adapter is nested too deeply: {value[:80]!r}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"--l2-adapter must be a JSON object, got {value[:80]!r}")
        serde = cfg.get("serde")
        if not isinstance(serde, dict) or serde.get("type") not in SERDE_TYPES:
            continue
        try:
            parse_settings(serde["type"], {k: v for k, v in serde.items() if k != "type"})
        except (ValueError, CodecError) as e:
            raise ValueError(f"--l2-adapter {cfg.get('type', '?')!r} serde {serde['type']!r}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from . import register

        register()
        from lmcache.cli.main import main as lmcache_main
    except (ImportError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e} (install: bash scripts/setup.sh lmcache)",
              file=sys.stderr)
        return 2
    try:
        check_adapters(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        lmcache_main(["server", *args])
    except ValueError as e:      # LMCache's own config checks raise ValueError at start-up
        print(f"error: lmcache server: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
