"""`python -m streaming.store`: runs streaming.store.main (its command line is described there)."""

import sys

from streaming.store import main

if __name__ == "__main__":
    sys.exit(main())
