"""Print the codec's bin schedules (keys and values, per layer) of every variant and level.

The layer-wise quantization of CacheGen (Liu et al., SIGCOMM 2024, section 5.2) as
``codec.config.CodecConfig.for_model`` derives it for a model depth: the reference variant
(LMCache's default schedule and the CacheGen artifact's levels) and the harness variant.

Run: python -m bench.schedules [NUM_LAYERS]      (default 30, the default model's depth)
"""
from __future__ import annotations

import sys
from typing import Optional

from codec.config import VARIANTS, CodecConfig
from codec.schedules import HARNESS_LEVELS, LEVELS


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        n = int(argv[0]) if argv else 30
        if n < 1:
            raise ValueError
    except ValueError:
        print(f"error: NUM_LAYERS must be a positive integer, got {argv[0]!r}", file=sys.stderr)
        return 2
    for variant in VARIANTS:
        for level in (LEVELS if variant == "reference" else sorted(HARNESS_LEVELS)):
            print(CodecConfig.for_model(n, level, variant=variant).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
