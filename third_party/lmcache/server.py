"""Start LMCache's MP server (``lmcache server``) with our serdes registered.

LMCache parses its ``--l2-adapter`` JSON in the server process and has no plugin loader
for serdes, so ``register()`` must run there first; this launcher does that, then hands
every argument to LMCache's own CLI unchanged:

    .venv-lmcache/bin/python -m third_party.lmcache.server --l2-adapter \\
        '{"type": "fs", "base_path": "/tmp/kv", "serde": {"type": "cachegen"}}' ...

(``lmcache server --help`` lists the other options.) Exit status: LMCache's; 2 with a
one-line error when lmcache is not installed or a serde name is taken.
"""
from __future__ import annotations

import sys


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
    lmcache_main(["server", *args])
    return 0


if __name__ == "__main__":
    sys.exit(main())
