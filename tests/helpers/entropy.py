"""The entropy coder's frequency normalization as docs/bitstream.md 4.3 writes it: the
reference the codec's ``normalize_freqs`` and the coded tables are checked against."""
from __future__ import annotations


def normalize_spec(counts):
    """docs/bitstream.md 4.3, literally (pure Python integers)."""
    nb = len(counts)
    c = [int(v) for v in counts]
    if sum(c) == 0:
        c = [1] * nb
    N = sum(c)
    spare = 65536 - nb
    f = [1 + (v * spare) // N for v in c]
    rem = [(v * spare) % N for v in c]
    r = 65536 - sum(f)
    for s in sorted(range(nb), key=lambda s: (-rem[s], s))[:r]:
        f[s] += 1
    return f
