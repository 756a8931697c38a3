"""``python -m bench.adapt``: runs :func:`bench.adapt.cli.main`."""
import sys

from bench.adapt.cli import main

sys.exit(main())
