"""``python -m bench.store_load``: runs :func:`bench.store_load.cli.main`."""
import sys

from bench.store_load.cli import main

sys.exit(main())
