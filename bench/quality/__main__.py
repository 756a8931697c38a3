"""``python -m bench.quality``: runs :func:`bench.quality.cli.main`."""
import sys

from bench.quality.cli import main

sys.exit(main())
