"""``python -m bench.codec``: runs :func:`bench.codec.cli.main`."""
import sys

from bench.codec.cli import main

sys.exit(main())
