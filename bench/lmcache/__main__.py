"""``python -m bench.lmcache``: runs :func:`bench.lmcache.cli.main`."""
import sys

from bench.lmcache.cli import main

sys.exit(main())
