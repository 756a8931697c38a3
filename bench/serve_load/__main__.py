"""``python -m bench.serve_load``: runs :func:`bench.serve_load.cli.main`."""
import sys

from bench.serve_load.cli import main

sys.exit(main())
