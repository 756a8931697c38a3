"""``python -m bench.coder``: runs :func:`bench.coder.cli.main`."""
import sys

from bench.coder.cli import main

sys.exit(main())
