"""`python -m streaming.link`: runs streaming.link.main (its command line is described there)."""

import sys

from streaming.link import main

if __name__ == "__main__":
    sys.exit(main())
