"""``python -m kv_extraction_hf.model``: runs :func:`kv_extraction_hf.model.main`."""
import sys

from kv_extraction_hf.model import main

sys.exit(main())
