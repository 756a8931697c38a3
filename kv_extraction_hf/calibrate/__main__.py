"""``python -m kv_extraction_hf.calibrate``: runs :func:`kv_extraction_hf.calibrate.main`."""
import sys

from kv_extraction_hf.calibrate import main

sys.exit(main())
